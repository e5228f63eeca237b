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

Mixture-of-experts layers add expert parallelism (EP, and expert TP, ETP, Megatron's default the
TP size): a rank holds E/EP routed experts, each cut over ETP ranks, and the distributed optimizer
shards their state over the expert data-parallel group, TP x CP x DP / (EP x ETP) ranks.

Layers are split over virtual stages as the runtime does (:func:`stage_layers`). Pure Python: the
schedule core imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
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
    (sharded over TP ranks) or ``outside`` it (replicated unless sequence parallel). The routed
    experts' tensors (their k copies of each token) are apart: ``routed_outside`` (each copy's
    input, whole on every expert-TP rank) and ``routed_inside`` (FFN intermediates, split over
    the expert-TP ranks)."""

    inside: float
    outside: float
    routed_outside: float = 0
    routed_inside: float = 0

    @property
    def total(self) -> float:
        return self.inside + self.outside + self.routed_outside + self.routed_inside


@dataclass(frozen=True)
class Parallelism:
    """Megatron's sizes besides PP: TP ``tp``, sequence parallel ``sp``, CP ``cp``, DP ``dp``,
    and whether the distributed optimizer shards Adam's state."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False
    ep: int = 1  # expert parallel: the routed experts of a layer are split over EP ranks
    etp: int | None = None  # expert TP; None: the TP size, as Megatron defaults it

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Megatron's expert data-parallel size: a stage's TP x CP x DP ranks over EP x ETP."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

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

    @property
    def expert_optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards the experts' state over: the expert DP group."""
        return self.expert_dp if self.distributed_optimizer else 1

    def activation(self, per_token: TokenBytes) -> float:
        """Bytes per token on one rank: inside / t + outside / (t if SP else 1), all / c. With
        balanced routing, the ETP ranks of an expert together take the routed copies of t / ETP
        ranks' tokens (the EP ranks swap tokens, not change their number): each holds the
        inputs of ETP / t of its TP group's copies and 1 / t of their intermediates."""
        dense = per_token.inside / self.tp + per_token.outside / (self.tp if self.sp else 1)
        routed = (per_token.routed_outside * self.expert_tp + per_token.routed_inside) / self.tp
        return (dense + routed) / self.cp


def tp_indivisible(shape: ModelShape, tp: int) -> str | None:
    """What of ``shape`` TP ``tp`` does not split evenly ("64 attention heads"), or None: Megatron
    splits heads, KV heads, the FFN width (of the dense layers) and the shared expert's over the
    tensor-parallel ranks."""
    for what, count in (
        ("attention heads", shape.heads),
        ("KV heads", shape.kv_heads),
        ("FFN width", shape.ffn if not all(shape.moe_layers()) else 0),
        ("shared-expert width", shape.shared_expert_ffn),
    ):
        if count % tp:
            return f"{count} {what}"
    return None


EP_FLAG = "--expert-model-parallel-size"
ETP_FLAG = "--expert-tensor-parallel-size"


def check_experts(shape: ModelShape, parallel: Parallelism) -> None:
    """Raise :class:`ParallelError` for expert parallelism megatron-core would refuse: EP must
    divide the experts, EP x ETP a stage's TP x CP x DP ranks (its expert groups), ETP the
    experts' FFN width; MoE with TP needs sequence parallelism (its MoE layer raises)."""
    for flag, size in ((EP_FLAG, parallel.ep), (ETP_FLAG, parallel.expert_tp)):
        if size < 1:
            raise ParallelError(f"{flag} must be at least 1, got {size}", flag)
    if not shape.experts:
        for flag, given in ((EP_FLAG, parallel.ep != 1), (ETP_FLAG, parallel.etp is not None)):
            if given:
                raise ParallelError(f"{flag} needs a mixture-of-experts model; {shape.name} is dense", flag)
        return
    if shape.experts % parallel.ep:
        raise ParallelError(
            f"{EP_FLAG} {parallel.ep} does not divide the {shape.experts} experts of {shape.name}", EP_FLAG
        )
    stage = parallel.tp * parallel.cp * parallel.dp
    if stage % (parallel.ep * parallel.expert_tp):
        raise ParallelError(
            f"{EP_FLAG} {parallel.ep} x {ETP_FLAG} {parallel.expert_tp} must divide the {stage} ranks "
            "of a pipeline stage (tensor x context x data parallel sizes)",
            EP_FLAG,
        )
    if shape.moe_ffn % parallel.expert_tp:
        raise ParallelError(
            f"{ETP_FLAG} {parallel.expert_tp} (default: the TP size) does not divide the expert FFN "
            f"width {shape.moe_ffn} of {shape.name}",
            ETP_FLAG,
        )
    if parallel.tp > 1 and not parallel.sp:
        raise ParallelError(
            "--sequence-parallel: megatron-core's MoE layers with tensor parallelism need it",
            "--sequence-parallel",
        )


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
    check_experts(shape, parallel)
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


def stage_moe_layers(shape: ModelShape, layers_per_stage: list[int]) -> list[int]:
    """MoE layers of each virtual stage: stage i holds the next ``layers_per_stage[i]`` layers in
    model order (as the runtime builds them), so ``moe_layer_freq`` decides the mix. Zeros for a
    dense model."""
    if not shape.experts:
        return [0] * len(layers_per_stage)
    pattern = shape.moe_layers()
    if sum(layers_per_stage) != len(pattern):
        raise ValueError(f"layers per stage {layers_per_stage} do not add up to the {len(pattern)} layers")
    starts = [sum(layers_per_stage[:stage]) for stage in range(len(layers_per_stage))]
    return [sum(pattern[start : start + count]) for start, count in zip(starts, layers_per_stage)]


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
    vocab-parallel: / t) on the ranks of the first and last stage, and the final norm. An MoE
    layer counts its attention and shared expert / t and its router (replicated); its routed
    experts are :func:`rank_expert_params`'s, since EP, not TP, splits them."""
    if len(layers_per_stage) != placement.num_stages:
        raise ValueError(f"{len(layers_per_stage)} layer counts for {placement.num_stages} stages")
    norms = 2 * shape.hidden
    layer = shape.layer_params() // tp + norms
    moe_layer = (
        (shape.attention_params() + shape.shared_expert_params()) // tp + shape.router_params() + norms
    )
    vocab_shard = padded_vocab(shape.vocab, tp, vocab_divisible_by) // tp * shape.hidden
    params = [0] * placement.pp
    for stage, (layers, moe) in enumerate(zip(layers_per_stage, stage_moe_layers(shape, layers_per_stage))):
        rank = placement.rank_of(stage)
        params[rank] += (layers - moe) * layer + moe * moe_layer
        if stage == 0:
            params[rank] += vocab_shard
        if stage == placement.num_stages - 1:
            params[rank] += vocab_shard + shape.hidden
    return params


def rank_expert_params(
    shape: ModelShape, placement: Placement, layers_per_stage: list[int], parallel: Parallelism
) -> list[int]:
    """Routed-expert parameters each pipeline rank holds: per MoE layer, E / EP experts, each's
    weights / ETP (0 for a dense model)."""
    per_layer = shape.experts // parallel.ep * (shape.expert_params() // parallel.expert_tp)
    params = [0] * placement.pp
    for stage, moe in enumerate(stage_moe_layers(shape, layers_per_stage)):
        params[placement.rank_of(stage)] += moe * per_layer
    return params


def optimizer_bytes_per_param(param_bytes: int) -> int:
    """Adam: exp_avg and exp_avg_sq in fp32, plus an fp32 master copy when the weights are
    16-bit (mixed precision): 12 bytes, or 8 in pure fp32."""
    return 2 * FP32 + (FP32 if param_bytes < FP32 else 0)


@dataclass(frozen=True)
class MemoryParts:
    """One rank's memory in bytes: peak activations and what the step holds throughout;
    ``experts``: the routed experts' share of weights, gradients and optimizer (in them)."""

    activations: float
    weights: float
    gradients: float
    optimizer: float
    experts: float = 0.0

    @property
    def total(self) -> float:
        return self.activations + self.weights + self.gradients + self.optimizer

    def with_activations(self, activations: float) -> MemoryParts:
        return replace(self, activations=activations)

    def to_dict(self) -> dict[str, float]:
        """The parts and total; ``experts`` only for a rank that holds experts."""
        parts = {
            "activations": self.activations,
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "total": self.total,
        }
        return {**parts, "experts": self.experts} if self.experts else parts


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
    over DP x CP, and the routed experts' over the expert DP group."""
    parallel = parallel or Parallelism()
    if layers_per_stage is None:
        layers_per_stage = stage_layers(shape.layers, placement.num_stages)
    param_bytes = shape.bytes_per_element if param_bytes is None else param_bytes
    adam = optimizer_bytes_per_param(param_bytes)
    state, expert_state = adam / parallel.optimizer_shards, adam / parallel.expert_optimizer_shards
    counts = (count_params or rank_params)(
        shape, placement, layers_per_stage, parallel.tp, vocab_divisible_by
    )
    experts = rank_expert_params(shape, placement, layers_per_stage, parallel)
    return [
        MemoryParts(
            0.0,
            float((count + expert) * param_bytes),
            float((count + expert) * grad_bytes),
            count * state + expert * expert_state,
            expert * (param_bytes + grad_bytes + expert_state),
        )
        for count, expert in zip(counts, experts)
    ]
