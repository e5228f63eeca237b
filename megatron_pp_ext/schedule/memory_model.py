"""Per-rank memory under Megatron's tensor, sequence, context and data parallelism.

Two things the simulator needs to report a rank's memory in bytes the way Megatron lays it out:

* how TP/SP/CP shard a rank's *activations* (:class:`Parallelism`), after Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", sec. 4): tensors inside the
  tensor-parallel region (Q/K/V, attention output, MLP intermediates, vocab-parallel logits) are
  split over the t TP ranks; the ones outside it (norm inputs and outputs, the residual stream)
  are replicated unless sequence parallelism splits them along the sequence. Context
  parallelism gives each rank S/c tokens, so it divides every term.
* the *static* bytes a rank holds for the whole step (:func:`static_memory`): weights, gradient
  buffers and Adam state of the layers, embedding and output layer its virtual stages own.

Layers are split over virtual stages as the runtime does (:func:`stage_layers`). Pure Python: the
schedule core imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .ir import Placement
from .models import ModelShape

FP32 = 4
VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


class ParallelError(ValueError):
    """A parallel layout Megatron would refuse. ``flag`` names the command-line flag to change."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


class TokenBytes(NamedTuple):
    """Activation bytes per token, split by where Megatron keeps them: ``inside`` the TP region
    (sharded over TP ranks) or ``outside`` it (replicated unless sequence parallel)."""

    inside: int
    outside: int

    @property
    def total(self) -> int:
        return self.inside + self.outside


@dataclass(frozen=True)
class Parallelism:
    """Megatron's sizes besides PP: TP ``tp``, sequence parallel ``sp``, CP ``cp``, DP ``dp``,
    and whether the distributed optimizer shards Adam's state."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False

    @property
    def sequence_split(self) -> int:
        """Ranks one sequence's replicated-by-TP tensors are cut over: t with SP, times c."""
        return (self.tp if self.sp else 1) * self.cp

    @property
    def sequence_multiple(self) -> int:
        """What the sequence length must be a multiple of: t with SP (sequence shards), and 2c
        with CP (Megatron cuts each sequence into 2c chunks to balance causal attention)."""
        return (self.tp if self.sp else 1) * (2 * self.cp if self.cp > 1 else 1)

    @property
    def optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards over: megatron-core builds it on the DP x CP
        group (CP ranks hold the same weights), so CP shards it too."""
        return self.dp * self.cp if self.distributed_optimizer else 1

    def activation(self, per_token: TokenBytes) -> float:
        """Bytes per token on one rank: inside / t + outside / (t if SP else 1), all / c."""
        return (per_token.inside / self.tp + per_token.outside / (self.tp if self.sp else 1)) / self.cp


def tp_indivisible(shape: ModelShape, tp: int) -> str | None:
    """What of ``shape`` TP ``tp`` does not split evenly ("64 attention heads"), or None: Megatron
    splits heads, KV heads and the FFN width over the tensor-parallel ranks."""
    for what, count in (
        ("attention heads", shape.heads),
        ("KV heads", shape.kv_heads),
        ("FFN width", shape.ffn),
    ):
        if count % tp:
            return f"{count} {what}"
    return None


def check_parallel(shape: ModelShape, seq_length: int, parallel: Parallelism) -> None:
    """Raise :class:`ParallelError` for a layout megatron-core would refuse (its ``divide``
    asserts), naming the flag to change."""
    for flag, size in (
        ("--tensor-model-parallel-size", parallel.tp),
        ("--context-parallel-size", parallel.cp),
        ("--data-parallel-size", parallel.dp),
    ):
        if size < 1:
            raise ParallelError(f"{flag} must be at least 1, got {size}", flag)
    if parallel.sp and parallel.tp == 1:
        raise ParallelError(
            "--sequence-parallel needs --tensor-model-parallel-size > 1", "--sequence-parallel"
        )
    indivisible = tp_indivisible(shape, parallel.tp)
    if indivisible:
        raise ParallelError(
            f"--tensor-model-parallel-size {parallel.tp} does not divide the {indivisible} of {shape.name}",
            "--tensor-model-parallel-size",
        )
    multiple = parallel.sequence_multiple
    if seq_length % multiple:
        parts = (
            [f"--tensor-model-parallel-size {parallel.tp} with --sequence-parallel"] if parallel.sp else []
        )
        parts += [f"2 x --context-parallel-size {parallel.cp}"] if parallel.cp > 1 else []
        low = seq_length // multiple * multiple
        near = ", ".join(str(v) for v in (low, low + multiple) if v > 0)
        raise ParallelError(
            f"--seq-length {seq_length} must be a multiple of {multiple} ({' x '.join(parts)}); "
            f"nearest valid: {near}",
            "--seq-length",
        )


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per virtual stage as the runtime builds them: an even split whose remainder goes to
    the middle stages, since the first and last stages also carry the embedding and the loss."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages (at least one layer each)")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = (
        list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    )
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def padded_vocab(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron-LM pads the vocabulary to a multiple of ``divisible_by`` x t so every TP rank
    gets an equal vocab-parallel shard."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def rank_params(
    shape: ModelShape,
    placement: Placement,
    layers_per_stage: list[int],
    tp: int = 1,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
) -> list[int]:
    """Parameters each pipeline rank holds on one TP rank: a layer's GEMM weights / t plus its two
    norm weights (replicated over TP), the untied embedding and output layer (V x h each,
    vocab-parallel: / t) on the ranks of the first and last stage, and the final norm."""
    if len(layers_per_stage) != placement.num_stages:
        raise ValueError(f"{len(layers_per_stage)} layer counts for {placement.num_stages} stages")
    layer = shape.layer_params() // tp + 2 * shape.hidden
    vocab_shard = padded_vocab(shape.vocab, tp, vocab_divisible_by) // tp * shape.hidden
    params = [0] * placement.pp
    for stage, layers in enumerate(layers_per_stage):
        rank = placement.rank_of(stage)
        params[rank] += layers * layer
        if stage == 0:
            params[rank] += vocab_shard
        if stage == placement.num_stages - 1:
            params[rank] += vocab_shard + shape.hidden
    return params


def optimizer_bytes_per_param(param_bytes: int) -> int:
    """Adam: exp_avg and exp_avg_sq in fp32, plus an fp32 master copy when the weights are
    16-bit (mixed precision): 12 bytes, or 8 in pure fp32."""
    return 2 * FP32 + (FP32 if param_bytes < FP32 else 0)


@dataclass(frozen=True)
class MemoryParts:
    """One rank's memory in bytes: peak activations and what the step holds throughout."""

    activations: float
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.activations + self.weights + self.gradients + self.optimizer

    def with_activations(self, activations: float) -> MemoryParts:
        return MemoryParts(activations, self.weights, self.gradients, self.optimizer)

    def to_dict(self) -> dict[str, float]:
        return {
            "activations": self.activations,
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "total": self.total,
        }


def static_memory(
    shape: ModelShape,
    placement: Placement,
    parallel: Parallelism | None = None,
    layers_per_stage: list[int] | None = None,
    param_bytes: int | None = None,
    grad_bytes: int = FP32,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    count_params: Callable[..., list[int]] | None = None,
) -> list[MemoryParts]:
    """Weights, gradients and optimizer state of each pipeline rank (activations 0).

    ``count_params``: parameters per rank, ``rank_params``'s signature (default ``rank_params``;
    vocabulary parallelism passes its own count).

    ``param_bytes`` defaults to the shape's element size; ``grad_bytes`` to fp32, Megatron's
    main_grad buffers for bf16 training (DDP accumulates and reduces in fp32). Gradients stay
    whole on every DP rank; the distributed optimizer shards Adam's state (and master weights)
    over DP x CP."""
    parallel = parallel or Parallelism()
    if layers_per_stage is None:
        layers_per_stage = stage_layers(shape.layers, placement.num_stages)
    param_bytes = shape.bytes_per_element if param_bytes is None else param_bytes
    state = optimizer_bytes_per_param(param_bytes) / parallel.optimizer_shards
    return [
        MemoryParts(0.0, float(count * param_bytes), float(count * grad_bytes), count * state)
        for count in (count_params or rank_params)(
            shape, placement, layers_per_stage, parallel.tp, vocab_divisible_by
        )
    ]
