"""Shared pieces of the runtime tests: a tiny model, its data, forward_step_func and loss_func
in Megatron's contract, and the comparison against the single-process reference."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from megatron_pp_ext.megatron.model import ModelConfig

MICRO_BATCH = 2


def tiny_model(num_layers: int, dtype: str = "float32") -> ModelConfig:
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,  # GQA
        ffn_hidden_size=64,
        vocab_size=64,
        seq_length=16,
        dtype=dtype,
    )


def make_batches(model: ModelConfig, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, model.vocab_size, (MICRO_BATCH, model.seq_length), generator=generator)
        labels = torch.randint(0, model.vocab_size, (MICRO_BATCH, model.seq_length), generator=generator)
        loss_mask = (torch.rand(MICRO_BATCH, model.seq_length, generator=generator) > 0.2).to(torch.float32)
        position_ids = torch.arange(model.seq_length).unsqueeze(0).expand(MICRO_BATCH, -1)
        batches.append(
            {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        )
    return batches


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron's pretrain_gpt shape: (sum of masked token losses, token count, report)."""
    losses = output.reshape(-1)
    mask = loss_mask.reshape(-1).to(losses.dtype)
    loss = torch.sum(losses * mask)
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.to(loss.dtype)])}


def loss_func_legacy(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The two-value form: an already averaged loss and a report."""
    losses = output.reshape(-1)
    mask = loss_mask.reshape(-1).to(losses.dtype)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: torch.nn.Module,
    legacy: bool = False,
    return_schedule_plan: bool = False,
):
    """Megatron-LM's ``forward_step`` in small: the model's output (or, for overlapped pairs,
    its schedule plan, as pretrain_gpt.py builds it) and the loss function."""
    batch = next(data_iterator)
    inputs = (batch["tokens"], batch["position_ids"], None)
    if return_schedule_plan:
        output = model.build_schedule_plan(*inputs, labels=batch["labels"])
    else:
        output = model(*inputs, labels=batch["labels"])
    return output, functools.partial(loss_func_legacy if legacy else loss_func, batch["loss_mask"])


def rel_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in float64 (0 when both are 0)."""
    value, reference = value.double(), reference.double()
    denominator = reference.norm().item()
    difference = (value - reference).norm().item()
    if denominator == 0.0:
        return difference
    return difference / denominator


def loss_values(outputs: list[Any]) -> list[float]:
    return [float(item["lm loss"].reshape(-1)[0]) for item in outputs]


def vocab_setup_from(reference, model_cfg, chunks, placement, rank: int, variant: str, groups, **kwargs):
    """This rank's vocabulary-parallel setup (``setup_vocab_parallel``) on CPU, its shard loaded
    from the reference's embedding and output tables (this TP rank's rows)."""
    from megatron_pp_ext.runtime.vocab_ops import setup_vocab_parallel

    setup = setup_vocab_parallel(
        chunks,
        placement,
        rank,
        model_cfg.vocab_size,
        model_cfg.hidden_size,
        variant,
        dtype=model_cfg.torch_dtype,
        device="cpu",
        groups=groups,
        **kwargs,
    )
    setup.vp.load_tp_shards(
        embedding=reference.embedding.word_embeddings.weight.detach(),
        output=reference.output_layer.weight.detach(),
    )
    return setup


def megatron_reference(model_cfg, batches: list, microbatches: int) -> tuple:
    """(model, gradients by name, losses) of megatron-core's schedule without a pipeline."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_pp_ext.megatron.model import build_reference

    torch.manual_seed(1234)
    reference = build_reference(model_cfg)
    outputs = forward_backward_no_pipelining(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[reference],
        num_microbatches=microbatches,
        seq_length=model_cfg.seq_length,
        micro_batch_size=2,
    )
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    return reference, grads, loss_values(outputs)
