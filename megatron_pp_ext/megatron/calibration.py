"""Memory probes that calibrate the simulator: every virtual stage of a model built alone.

The runtime measures one chunk (``runtime/memory.py``: what a forward keeps, what its deferred W
still holds); building the chunks of a model is the adapter's job, so the probes that walk every
stage of a ``ModelConfig`` live here, next to the model builder, and the runtime never imports
the adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..runtime.memory import OpMemory, measure_op_memory, measure_slice_memory
from .model import build_stage, split_layers
from .sliced import slice_context_of


def _probe_batch(
    model: Any, micro_batch_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Random tokens, labels and positions of one microbatch, for the probes below."""
    shape = (micro_batch_size, model.seq_length)
    tokens = torch.randint(0, model.vocab_size, shape, generator=generator)
    labels = torch.randint(0, model.vocab_size, shape, generator=generator)
    positions = torch.arange(model.seq_length).unsqueeze(0).expand(micro_batch_size, -1)
    return tokens, labels, positions


def stage_op_memory(
    model: Any,
    num_stages: int,
    micro_batch_size: int = 1,
    layers_per_stage: list[int] | None = None,
    seed: int = 0,
) -> list[OpMemory]:
    """``runtime.memory.measure_op_memory`` for every virtual stage of ``model`` (a ``ModelConfig``)
    on random tokens, each stage built fresh: what one F keeps and what its W still holds after B,
    per stage, to calibrate the simulator. Needs Megatron's parallel state (one rank is enough at
    TP=1; under TP every rank of the TP group must call it, as its stages run TP collectives). Under
    sequence parallelism a stage input holds this rank's 1/TP of the sequence, as in the pipeline."""

    layers = split_layers(model.num_layers, num_stages, layers_per_stage)
    generator = torch.Generator().manual_seed(seed)
    tokens, labels, positions = _probe_batch(model, micro_batch_size, generator)
    results = []
    for stage in range(num_stages):
        chunk = build_stage(model, stage, layers)
        device = next(chunk.parameters()).device
        last = stage == num_stages - 1

        def run_forward(c: torch.nn.Module, last: bool = last, device: torch.device = device) -> Tensor:
            out = c(tokens.to(device), positions.to(device), None, labels=labels.to(device))
            return out.sum() if last else out

        stage_input = None
        if stage > 0:
            config = chunk.config
            share = config.tensor_model_parallel_size if config.sequence_parallel else 1
            stage_input = torch.randn(
                model.seq_length // share, micro_batch_size, model.hidden_size, generator=generator
            ).to(device=device, dtype=model.torch_dtype)
        results.append(measure_op_memory(chunk, run_forward, stage_input))
    return results


def stage_slice_memory(
    model: Any,
    num_stages: int,
    lengths: Sequence[int],
    micro_batch_size: int = 1,
    layers_per_stage: list[int] | None = None,
    seed: int = 0,
    measure: Callable[..., list[Any]] | None = None,
) -> list[list[Any]]:
    """:func:`stage_op_memory` per slice: for every virtual stage of ``model`` (a ``ModelConfig``,
    built with sliced attention), what each slice's F keeps and its W still needs after B, to
    calibrate the simulator for a sliced schedule (``TableCosts`` keyed (stage, slice)).
    ``measure`` (default ``runtime.memory.measure_slice_memory``, same arguments) can measure
    something else per slice, e.g. ``offload_probe.measure_slice_offload``."""

    layers = split_layers(model.num_layers, num_stages, layers_per_stage)
    generator = torch.Generator().manual_seed(seed)
    tokens, labels, positions = _probe_batch(model, micro_batch_size, generator)
    starts = [sum(lengths[:j]) for j in range(len(lengths) + 1)]
    results = []
    for stage in range(num_stages):
        chunk = build_stage(model, stage, layers, sliced=True)
        device = next(chunk.parameters()).device
        last = stage == num_stages - 1

        def run_forward(c: torch.nn.Module, j: int, last: bool = last, to: torch.device = device) -> Tensor:
            cut = slice(starts[j], starts[j + 1])
            out = c(tokens[:, cut].to(to), positions[:, cut].to(to), None, labels=labels[:, cut].to(to))
            return out.sum() if last else out

        def make_input(j: int, stage: int = stage, device: torch.device = device) -> Tensor | None:
            if stage == 0:
                return None
            size = (lengths[j], micro_batch_size, model.hidden_size)
            return torch.randn(size, generator=generator).to(device=device, dtype=model.torch_dtype)

        context = slice_context_of(chunk)
        results.append((measure or measure_slice_memory)(chunk, context, lengths, run_forward, make_input))
    return results
