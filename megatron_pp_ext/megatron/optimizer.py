"""The optimizer step after ``finalize_model_grads``: Megatron's optimizer on GPU, a torch one on CPU.

Everything up to the optimizer step is the same on both paths: DDP grad buffers zeroed, the
schedule's forward and backward, ``finalize_model_grads`` (data-parallel reduction, SP norm
all-reduce, per-token scaling). Then:

- with CUDA, megatron-core's ``get_megatron_optimizer`` (Adam, distributed optimizer when the
  DDP config asks for it, gradient clipping by the global norm), as Megatron-LM builds it;
- without CUDA it cannot be built (``FP32Optimizer.__init__`` allocates with ``device='cuda'``),
  so :class:`MainGradOptimizer` steps ``torch.optim.AdamW`` on ``main_grad``, with Megatron's
  clipping rule (global L2 norm over the model-parallel group, tensor-parallel duplicates counted
  once). Under the distributed optimizer's layout DDP leaves each data-parallel rank only its
  shard of the reduced gradients; this path all-gathers the shards first, so every rank takes the
  same full step (the memory saving of sharded optimizer state is a GPU-path property).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed.param_and_grad_buffer import shard_buffer
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0


class MainGradOptimizer:
    """``torch.optim.AdamW`` over DDP-wrapped chunks, stepping on ``main_grad``; ``step()``
    returns the global gradient norm before clipping."""

    def __init__(self, model: Sequence[Any], settings: OptimizerSettings) -> None:
        self.model = list(model)
        self.settings = settings
        self.params = [p for chunk in self.model for p in chunk.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            betas=settings.betas,
            eps=settings.eps,
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> float:
        gather_grad_shards(self.model)
        for param in self.params:
            param.grad = param.main_grad.to(param.dtype)
        norm = global_grad_norm(self.params)
        clip = self.settings.clip_grad
        if clip > 0 and norm > clip:
            for param in self.params:
                param.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        return norm


def gather_grad_shards(model: Sequence[Any]) -> None:
    """Under the distributed optimizer's layout, all-gather each bucket's reduced shards so every
    data-parallel rank holds the whole reduced gradient."""
    for chunk in model:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[rank].clone()
                dist.all_gather_into_tensor(
                    bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group
                )


def global_grad_norm(params: Sequence[torch.Tensor]) -> float:
    """L2 norm of every gradient of the model: squares summed over the tensor- and pipeline-
    parallel ranks, each tensor-parallel duplicate (norm weights) counted once."""
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        if param.grad is not None and param_is_not_tensor_parallel_duplicate(param):
            total += param.grad.double().pow(2).sum()
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return float(total.sqrt())


def build_optimizer(model: Sequence[Any], settings: OptimizerSettings, bf16: bool = False) -> Any:
    """Megatron's optimizer on GPU, :class:`MainGradOptimizer` on CPU (see the module docstring).
    Both have ``param_groups`` and a ``step()``; Megatron's returns (ok, grad norm, zeros)."""
    if not torch.cuda.is_available():
        return MainGradOptimizer(model, settings)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=model[0].ddp_config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, list(model))


def optimizer_step(optimizer: Any) -> float:
    """One step; the gradient norm whichever optimizer it is."""
    result = optimizer.step()
    if isinstance(result, tuple):
        return float(result[1])
    return float(result)
