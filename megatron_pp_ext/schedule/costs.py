"""Cost models: how long each op takes and how much activation memory it holds.

The simulator asks a cost model four things about a compute op's unit (stage, microbatch, slice):
its duration per kind, the activation an F allocates, the share of it that survives B until W
(the inputs the weight-gradient GEMMs still need), and the latency of one p2p message.
Memory is in bytes; ``microbatch_activation`` (M: one whole unsliced microbatch over all
transformer layers) converts it to units of M.

For activation offload (PipeOffload) it also asks how many bytes an OFFLOAD of the unit copies
(what is left stays on the device: tiny tensors, parameters) and how long that copy takes over
the host link (``host_bandwidth``; ``ranks_per_host`` ranks share one link).
:func:`offload_ratio` is PipeOffload's k, the copy time over the compute time of a layer.

For vocabulary parallelism (``vocab.py``) a model may also say how much an S holds until its T
(``vocab_activation``) and how long a collective takes once every rank issued it
(``collective_time``); the simulator reads both with ``getattr`` and takes 0 when a model lacks
them, so older cost models keep working. S and T durations come from ``duration`` like F's.

Three models: :class:`UniformCosts` (the papers' unit analysis), :class:`TableCosts` (measured
times per stage and kind) and the transformer FLOP model in ``flops.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from .ir import Op, OpKind


class CostModel(Protocol):
    microbatch_activation: float

    def duration(self, op: Op) -> float: ...

    def activation(self, op: Op) -> float: ...

    def weight_share(self, op: Op) -> float: ...

    def comm_latency(self, op: Op) -> float: ...

    ranks_per_host: int

    def offload_bytes(self, op: Op) -> float: ...

    def copy_time(self, op: Op) -> float: ...


class VocabCostModel(CostModel, Protocol):
    """A cost model that also prices the vocabulary passes' memory and collectives."""

    def vocab_activation(self, op: Op) -> float: ...

    def collective_time(self, op: Op) -> float: ...


def offload_ratio(hidden: int, seq_length: int, compute_throughput: float, host_bandwidth: float) -> float:
    """PipeOffload's k = T_offload / T_compute of one layer = 10 / (3(6h + s)) * (B_c / B_o).

    ``compute_throughput`` B_c is the delivered FLOP/s of one device, ``host_bandwidth`` B_o the
    bytes/s of its host link in one direction. k < 1: every activation can be copied out and back
    behind compute; otherwise about 1/k of them. k falls as h and s grow."""
    if min(hidden, seq_length) < 1 or compute_throughput <= 0 or host_bandwidth <= 0:
        raise ValueError("hidden, seq_length, compute throughput and host bandwidth must be positive")
    return 10.0 / (3.0 * (6 * hidden + seq_length)) * (compute_throughput / host_bandwidth)


def offload_fraction(k: float) -> float:
    """Share of the activations that can be offloaded with the copies hidden: all when k <= 1."""
    return 1.0 if k <= 1.0 else 1.0 / k


def _copy_seconds(size: float, bandwidth: float) -> float:
    return 0.0 if math.isinf(bandwidth) else size / bandwidth


@dataclass
class UniformCosts:
    """A whole microbatch through one rank's share of the model (1/p of the layers) costs
    ``forward``/``backward``/``weight`` (BW costs backward + weight). A stage is 1/v of a rank's
    share, so its ops cost 1/v of that (makespans compare across v), and a slice op costs 1/k.

    Activation: one microbatch over all stages is 1.0 (so peaks read directly in units of M),
    spread evenly over stages and slices. ``weight_fraction`` of an F's activation stays after B
    until W (0 would free everything at B). ``host_bandwidth`` is in M per time unit (infinite:
    copies take no time); ``offload_fraction`` of an activation is copied by an OFFLOAD.

    Vocabulary parallelism: an S of a whole microbatch costs ``vocab_forward``, a T
    ``vocab_backward`` (1/k per slice; they run per rank, not per stage), an S holds
    ``vocab_memory`` (in M) until its T, and every collective takes ``collective`` once all ranks
    issued it. All 0 by default.

    Mixture-of-experts: ``expert_comm`` is the expert all-to-all time of a whole microbatch's F
    (and of its B), part of the op's duration unless an overlapped pair hides it; 0 by default.
    """

    num_stages: int
    num_slices: int = 1
    chunks_per_rank: int = 1
    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0
    comm: float = 0.0
    weight_fraction: float = 0.5
    microbatch_activation: float = 1.0
    host_bandwidth: float = math.inf
    ranks_per_host: int = 1
    offload_fraction: float = 1.0
    vocab_forward: float = 0.0
    vocab_backward: float = 0.0
    vocab_memory: float = 0.0
    collective: float = 0.0
    expert_comm: float = 0.0  # a whole microbatch's expert all-to-all per F and per B (in its time)

    def _slice_share(self) -> float:
        return 1.0 / (self.num_slices * self.chunks_per_rank)

    def duration(self, op: Op) -> float:
        if op.kind in (OpKind.S, OpKind.T):
            return (self.vocab_forward if op.kind == OpKind.S else self.vocab_backward) / self.num_slices
        base = {
            OpKind.F: self.forward,
            OpKind.B: self.backward,
            OpKind.W: self.weight,
            OpKind.BW: self.backward + self.weight,
        }.get(op.kind, 0.0)
        return base * self._slice_share() + self.expert_comm_time(op)

    def expert_comm_time(self, op: Op) -> float:
        """The expert all-to-alls (dispatch and combine) inside an F, B or BW: exposed in its
        duration unless an overlapped pair hides them (``pairing.hidden_seconds``)."""
        if op.kind not in (OpKind.F, OpKind.B, OpKind.BW):
            return 0.0
        return self.expert_comm * self._slice_share()

    def vocab_activation(self, op: Op) -> float:
        return self.vocab_memory * self.microbatch_activation / self.num_slices

    def collective_time(self, op: Op) -> float:
        return self.collective

    def activation(self, op: Op) -> float:
        return self.microbatch_activation / (self.num_stages * self.num_slices)

    def weight_share(self, op: Op) -> float:
        return self.activation(op) * self.weight_fraction

    def comm_latency(self, op: Op) -> float:
        return self.comm

    def offload_bytes(self, op: Op) -> float:
        return self.activation(op) * self.offload_fraction

    def copy_time(self, op: Op) -> float:
        return _copy_seconds(self.offload_bytes(op), self.host_bandwidth)


@dataclass
class TableCosts:
    """Measured durations keyed by (kind, stage) or (kind, stage, slice); missing keys fall back
    to ``default`` (a uniform model), so a partial table works."""

    default: UniformCosts
    durations: dict[tuple, float] = field(default_factory=dict)
    activations: dict[tuple, float] = field(default_factory=dict)  # keyed (stage,) or (stage, slice)
    weight_shares: dict[tuple, float] = field(default_factory=dict)
    offloads: dict[tuple, float] = field(default_factory=dict)  # bytes an OFFLOAD copies, same keys
    comm: float | None = None

    @property
    def microbatch_activation(self) -> float:
        return self.default.microbatch_activation

    @property
    def ranks_per_host(self) -> int:
        return self.default.ranks_per_host

    def duration(self, op: Op) -> float:
        for key in ((op.kind.value, op.stage, op.slice), (op.kind.value, op.stage)):
            if key in self.durations:
                return self.durations[key]
        if op.kind == OpKind.BW and ("B", op.stage) in self.durations and ("W", op.stage) in self.durations:
            return self.durations[("B", op.stage)] + self.durations[("W", op.stage)]
        return self.default.duration(op)

    def activation(self, op: Op) -> float:
        for key in ((op.stage, op.slice), (op.stage,)):
            if key in self.activations:
                return self.activations[key]
        return self.default.activation(op)

    def weight_share(self, op: Op) -> float:
        for key in ((op.stage, op.slice), (op.stage,)):
            if key in self.weight_shares:
                return self.weight_shares[key]
        return self.default.weight_share(op)

    def comm_latency(self, op: Op) -> float:
        return self.default.comm_latency(op) if self.comm is None else self.comm

    def offload_bytes(self, op: Op) -> float:
        """From the table, else the activation times the default's ``offload_fraction``."""
        for key in ((op.stage, op.slice), (op.stage,)):
            if key in self.offloads:
                return self.offloads[key]
        return self.activation(op) * self.default.offload_fraction

    def copy_time(self, op: Op) -> float:
        return _copy_seconds(self.offload_bytes(op), self.default.host_bandwidth)

    def vocab_activation(self, op: Op) -> float:
        return self.default.vocab_activation(op)

    def collective_time(self, op: Op) -> float:
        return self.default.collective_time(op)
