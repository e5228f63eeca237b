"""The exactness harness of the parallel-composition tests (TP/SP/DP in test_parallel_compose.py,
CP in test_context_parallel.py): a pipeline in megatron-core's DDP beside a one-process reference
with its own AdamW, and the per-parameter errors between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from runtime_case import MICRO_BATCH, rel_error


@dataclass
class ComposedPipeline:
    """One rank's DDP-wrapped chunks, their runtime and optimizer, and the reference's."""

    model: list[Any]
    runtime: Any
    optimizer: Any
    ref_optimizer: torch.optim.Optimizer
    names_of: dict[int, str]
    ref_params: dict[str, torch.nn.Parameter]


def compose_pipeline(
    reference: torch.nn.Module,
    model_cfg: Any,
    schedule: Any,
    comm: Any,
    settings: Any,
    overlap_grad_reduce: bool,
    distributed_optimizer: bool,
    redistribution: float = 0.0,
    sliced: bool = False,
) -> ComposedPipeline:
    """Chunks copied from ``reference`` for this rank, in Megatron's DDP (several buckets even for
    the tiny model), their runtime and optimizer, and an AdamW over the reference."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_pp_ext.megatron.ddp import wrap_chunks
    from megatron_pp_ext.megatron.model import build_chunks_from
    from megatron_pp_ext.megatron.optimizer import MainGradOptimizer
    from megatron_pp_ext.runtime import PipelineRuntime

    chunks, names_of = build_chunks_from(reference, model_cfg, schedule.placement, comm.rank, sliced=sliced)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=2000,
    )
    model = wrap_chunks(chunks, ddp_config)
    runtime = PipelineRuntime(
        model,
        comm,
        (model_cfg.seq_length, MICRO_BATCH, model_cfg.hidden_size),
        model_cfg.torch_dtype,
        attn_redistribution=redistribution,
    )
    ref_optimizer = torch.optim.AdamW(
        reference.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    return ComposedPipeline(
        model=model,
        runtime=runtime,
        optimizer=MainGradOptimizer(model, settings),
        ref_optimizer=ref_optimizer,
        names_of=names_of,
        ref_params=dict(reference.named_parameters()),
    )


def record_grad_errors(pipeline: ComposedPipeline, grad_errors: dict[str, float]) -> None:
    """Fold this step's ``main_grad`` vs reference ``.grad`` errors into ``grad_errors`` (max)."""
    for chunk in pipeline.model:
        for param in chunk.parameters():
            name = pipeline.names_of[id(param)]
            error = rel_error(param.main_grad, pipeline.ref_params[name].grad)
            grad_errors[name] = max(grad_errors.get(name, 0.0), error)


def param_errors(pipeline: ComposedPipeline) -> dict[str, float]:
    """Each chunk parameter against the reference's, by the reference's name."""
    return {
        pipeline.names_of[id(p)]: rel_error(
            p.detach(), pipeline.ref_params[pipeline.names_of[id(p)]].detach()
        )
        for chunk in pipeline.model
        for p in chunk.parameters()
    }


def reduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """What finalize_model_grads does for SP norms, on the reference (no DDP there)."""
    from megatron.core import parallel_state

    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def reference_norm(model: torch.nn.Module) -> float:
    """The reference's gradient norm as Megatron counts it under TP (duplicates once)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param_is_not_tensor_parallel_duplicate(param):
            total += param.grad.double().pow(2).sum()
    torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return float(total.sqrt())
