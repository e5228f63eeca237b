"""Vocabulary parallelism (Yeung et al., MLSys'25, arXiv 2411.05288) as a pass over any schedule.

The input embedding and the output layer with its cross-entropy are split evenly over the p
pipeline ranks, so the first and last stages no longer carry them. The output layer becomes two
passes per unit (microbatch, slice) that EVERY rank runs on its vocabulary shard, and a few
collectives over the pipeline group feed them (op semantics: ``docs/vocab_parallel.md``):

* ``BCAST_X``: the last stage's output (the output layer's input X, with labels and loss
  gradient) from the loss rank to every rank, after the last stage's F.
* ``S``: this shard's logits, local max and sum-exp (online softmax). Variant ``vocab-2`` also
  computes the shard's two input-gradient partials (softmax' W and W[target]).
* ``REDUCE_S``: the barrier after S: global max and sum (``vocab-2``: then the rescaled
  input-gradient partials summed to the loss rank).
* ``T``: softmax gradient and weight gradient (``vocab-1``: also the input-gradient partial).
* ``REDUCE_T`` (``vocab-1`` only): the input-gradient partials summed to the loss rank.
* The last stage's B (or BW) of the unit waits for the input gradient: ``REDUCE_T`` (vocab-1) or
  ``REDUCE_S`` (vocab-2).
* Embedding: ``BCAST_IDS`` (token ids from the first stage's rank), ``REDUCE_EMB`` (every rank's
  lookup of its rows, summed to the first stage's rank before the first stage's F) and
  ``BCAST_DEMB`` (the embedding output's gradient back to every rank after the first stage's B).

The paper's names: ``vocab-1`` is its Algorithm 1 (two barriers between the last stage's F and B:
after S and after T), ``vocab-2`` its Algorithm 2 (one barrier; the input gradient is formed in S
and reduced with the statistics, T only computes the weight gradient). The public code runs them
as ``--disable-backward-fusion`` and the default; the paper reports p+2 and p+1 microbatches of
activation on the busiest rank of 1F1B.

Collectives are issued asynchronously (they never stop the issuing rank); the op that needs one's
result waits for it. They form three channels (one process group each), and every rank issues a
channel's collectives in the same order: ``x`` (BCAST_X), ``out`` (REDUCE_S, REDUCE_T) and
``emb`` (BCAST_IDS, REDUCE_EMB, BCAST_DEMB).

Placement (:func:`add_vocab_passes`) replays the generator's schedule with a cost model and
inserts the passes where time says: a rank runs S (or T) at its first free moment after the
collective that feeds it completed, before its next F/B/W. While the last stage waits for the
barriers the pipeline would idle, so every rank gets up to ``d`` more forwards in flight (d = the
number of barriers: 2 for vocab-1, 1 for vocab-2), the paper's extra warm-up microbatches: each
rank's B/BW ops move ``shift`` forwards later in its order (for 1F1B: d more warm-up forwards,
exactly the paper's schedules, p+2 / p+1 microbatches on rank 0), and a rank whose next op is a
backward that cannot start yet may run up to ``d - shift`` later forwards ahead of it. The pass
tries shift = d, d-1, ..., 0 (a reorder that would deadlock this schedule is skipped) and keeps the
placement with the shortest replayed makespan. Either way a rank holds at most d more units than
the generator's schedule, and keeps its order otherwise.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .costs import TableCosts, UniformCosts
from .deps import Unit, compute_dependencies
from .ir import BACKWARD_KINDS, Op, OpKind, Placement, Schedule
from .memory_model import (
    FP32,
    VOCAB_DIVISIBLE_BY,
    MemoryParts,
    Parallelism,
    padded_vocab,
    rank_params,
    static_memory,
)
from .models import ModelShape

VARIANTS = ("none", "vocab-1", "vocab-2")
BARRIERS = {"vocab-1": 2, "vocab-2": 1}  # collectives between the last stage's F and its B

OUTPUT_KINDS = frozenset({OpKind.S, OpKind.T, OpKind.BCAST_X, OpKind.REDUCE_S, OpKind.REDUCE_T})
EMBEDDING_KINDS = frozenset({OpKind.BCAST_IDS, OpKind.REDUCE_EMB, OpKind.BCAST_DEMB})
CHANNELS: dict[OpKind, str] = {
    OpKind.BCAST_X: "x",
    OpKind.REDUCE_S: "out",
    OpKind.REDUCE_T: "out",
    OpKind.BCAST_IDS: "emb",
    OpKind.REDUCE_EMB: "emb",
    OpKind.BCAST_DEMB: "emb",
}
# S-side and T-side default costs of the uniform model, in units of one GEMM of the output layer
# shard: S has one GEMM (vocab-1) or two (vocab-2, the input-gradient partial moves into S).
GEMMS = {"vocab-1": (1, 2), "vocab-2": (2, 1)}
UNIFORM_GEMM = 0.1  # one output-layer GEMM of a rank's shard against a unit-cost F (see docs)


class VocabError(ValueError):
    """The vocabulary pass cannot apply to this schedule as asked."""


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise VocabError(f"unknown vocabulary parallelism {variant!r}; choose from {', '.join(VARIANTS)}")
    return variant


@dataclass(frozen=True)
class Layout:
    """Where the vocabulary work of a schedule lives: the last stage (whose output S reads), the
    loss rank that holds it, the first stage's rank (embedding) and the variant."""

    num_stages: int
    loss_rank: int
    first_rank: int
    variant: str

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1

    @classmethod
    def of(cls, schedule: Schedule, variant: str | None = None) -> Layout:
        place = schedule.placement
        return cls(
            num_stages=schedule.num_stages,
            loss_rank=place.rank_of(schedule.num_stages - 1),
            first_rank=place.rank_of(0),
            variant=variant or schedule.vocab_parallel,
        )

    def stage_of(self, kind: OpKind) -> int:
        """The stage field of a vocabulary op: the last stage for the output layer, 0 for the
        embedding."""
        return self.last_stage if kind in OUTPUT_KINDS else 0

    def root(self, kind: OpKind) -> int | None:
        """The rank a collective starts from or ends at (None: every rank contributes)."""
        if kind in (OpKind.BCAST_X, OpKind.REDUCE_T):
            return self.loss_rank
        if kind in EMBEDDING_KINDS:
            return self.first_rank
        return None

    def input_gradient(self) -> OpKind:
        """The collective that delivers the output layer's input gradient to the loss rank."""
        return OpKind.REDUCE_T if self.variant == "vocab-1" else OpKind.REDUCE_S

    def kinds(self) -> list[OpKind]:
        """The vocabulary ops every rank runs for each unit."""
        kinds = [OpKind.BCAST_X, OpKind.S, OpKind.REDUCE_S, OpKind.T]
        if self.variant == "vocab-1":
            kinds.append(OpKind.REDUCE_T)
        return kinds + [OpKind.BCAST_IDS, OpKind.REDUCE_EMB, OpKind.BCAST_DEMB]

    def waits_for(self, op: Op, rank: int) -> Op | None:
        """The collective whose completion ``op`` (on ``rank``) needs before it can start."""
        unit = (op.microbatch, op.slice)
        if op.kind == OpKind.S:
            return Op(OpKind.BCAST_X, self.last_stage, *unit)
        if op.kind == OpKind.T:
            return Op(OpKind.REDUCE_S, self.last_stage, *unit)
        if op.kind == OpKind.REDUCE_EMB and rank != self.first_rank:
            return Op(OpKind.BCAST_IDS, 0, *unit)  # the lookup needs the token ids
        if self.variant == "none":
            return None
        if op.kind == OpKind.F and op.stage == 0:
            return Op(OpKind.REDUCE_EMB, 0, *unit)
        if op.kind in BACKWARD_KINDS and op.stage == self.last_stage:
            return Op(self.input_gradient(), self.last_stage, *unit)
        return None

    def issue_needs(self, op: Op, rank: int) -> tuple[str, Unit] | None:
        """What must have run on ``rank`` (earlier in its list) before it issues collective ``op``:
        ("F" | "BACKWARD", unit) of a stage op, or ("S" | "T", unit) of a vocabulary pass."""
        unit = op.unit
        if op.kind == OpKind.BCAST_X and rank == self.loss_rank:
            return ("F", unit)
        if op.kind == OpKind.REDUCE_S:
            return ("S", unit)
        if op.kind == OpKind.REDUCE_T:
            return ("T", unit)
        if op.kind == OpKind.BCAST_DEMB and rank == self.first_rank:
            return ("BACKWARD", unit)
        return None


# ---- placement --------------------------------------------------------------------------------


class _Channel:
    """One process group's collectives: issued by every rank in the same order, completed in that
    order (one stream), each when every rank has issued it."""

    def __init__(self, pp: int, duration: Callable[[Op], float]) -> None:
        self.pp = pp
        self.duration = duration
        self.seq: list[Op] = []
        self.posted: list[float] = []  # when the element joined the sequence (root's issue)
        self.issues: list[list[float]] = []
        self.next = [0] * pp  # the element each rank issues next
        self.completed: list[float] = []

    def append(self, op: Op, time: float) -> None:
        self.seq.append(op)
        self.posted.append(time)
        self.issues.append([])

    def issue(self, rank: int, time: float) -> list[tuple[Op, float]]:
        """``rank`` issues its next element at ``time``; returns the collectives now complete."""
        index = self.next[rank]
        self.next[rank] += 1
        self.issues[index].append(time)
        done = []
        while len(self.completed) < len(self.seq) and len(self.issues[len(self.completed)]) == self.pp:
            k = len(self.completed)
            start = max([*self.issues[k], self.completed[-1] if self.completed else 0.0])
            self.completed.append(start + self.duration(self.seq[k]))
            done.append((self.seq[k], self.completed[k]))
        return done


@dataclass
class _Rank:
    """One rank during placement: its generator ops (``base``, which have run), the ops placed so
    far (``out``) and where its vocabulary passes stand."""

    base: list[Op]
    executed: list[bool]
    out: list[Op] = field(default_factory=list)
    head: int = 0
    pulled: int = 0  # base ops run ahead of the head
    clock: float = 0.0
    next_s: int = 0  # index into the output units of the next S (and T) this rank runs
    next_t: int = 0

    def skip_executed(self) -> None:
        """Move the head past ops that ran ahead of it (pulled forwards)."""
        while self.head < len(self.base) and self.executed[self.head]:
            self.head += 1
            self.pulled -= 1


class _Placer:
    """Greedy list scheduling of the generator's ops plus the vocabulary passes; see the module
    docstring for the rules."""

    def __init__(self, schedule: Schedule, variant: str, costs: Any, extra: int, lookahead: int) -> None:
        self.schedule = schedule
        self.layout = Layout.of(schedule, variant)
        self.costs = costs
        self.extra = extra
        self.lookahead = lookahead
        pp = schedule.pp
        self.ranks = [_Rank(list(ops), [False] * len(ops)) for ops in schedule.ranks]
        lay = self.layout
        self.out_units = [
            op.unit[1:]
            for op in schedule.ranks[lay.loss_rank]
            if op.kind == OpKind.F and op.stage == lay.last_stage
        ]
        self.in_units = [
            op.unit[1:] for op in schedule.ranks[lay.first_rank] if op.kind == OpKind.F and op.stage == 0
        ]
        self.in_index = {unit: k for k, unit in enumerate(self.in_units)}
        self.out_index = {unit: k for k, unit in enumerate(self.out_units)}
        collective_time = getattr(costs, "collective_time", None) or (lambda op: 0.0)
        self.channels = {name: _Channel(pp, collective_time) for name in ("x", "out", "emb")}
        self.completion: dict[tuple[OpKind, int, int], float] = {}  # (kind, mb, slice) -> time
        self.ends: dict[tuple[str, Unit], tuple[float, int, Op]] = {}
        self.events: list[float] = [0.0]
        self.makespan = 0.0
        last = lay.last_stage
        for unit in self.out_units:
            self.channels["x"].append(Op(OpKind.BCAST_X, last, *unit), 0.0)
            self.channels["out"].append(Op(OpKind.REDUCE_S, last, *unit), 0.0)
            if variant == "vocab-1":
                self.channels["out"].append(Op(OpKind.REDUCE_T, last, *unit), 0.0)
        for rank in range(pp):
            if rank != lay.loss_rank and self.out_units:
                self._issue(rank, "x", 0.0)
        # The first stage's rank issues the ids (and embedding reduces) of the first units up front.
        for k in range(min(lookahead + 1, len(self.in_units))):
            self._root_emb(OpKind.BCAST_IDS, self.in_units[k], 0.0)
        for k in range(min(lookahead, len(self.in_units))):
            self._root_emb(OpKind.REDUCE_EMB, self.in_units[k], 0.0)

    # ---- collectives ------------------------------------------------------------------------

    def _issue(self, rank: int, channel: str, time: float) -> None:
        chan = self.channels[channel]
        self.ranks[rank].out.append(chan.seq[chan.next[rank]])
        for op, done in chan.issue(rank, time):
            self.completion[(op.kind, op.microbatch, op.slice)] = done
            heapq.heappush(self.events, done)

    def _root_emb(self, kind: OpKind, unit: tuple[int, int], time: float) -> None:
        """The first stage's rank puts an embedding collective into its channel and issues it."""
        chan = self.channels["emb"]
        chan.append(Op(kind, 0, *unit), time)
        heapq.heappush(self.events, time)
        self._issue(self.layout.first_rank, "emb", time)

    def _done(self, kind: OpKind, unit: tuple[int, int], time: float) -> bool:
        when = self.completion.get((kind, *unit))
        return when is not None and when <= time

    def _flush_out(self, rank: int, time: float) -> None:
        """Issue the ``out`` collectives whose pass has run on ``rank``, in channel order."""
        chan = self.channels["out"]
        state = self.ranks[rank]
        while chan.next[rank] < len(chan.seq):
            op = chan.seq[chan.next[rank]]
            ran = state.next_s if op.kind == OpKind.REDUCE_S else state.next_t
            if self.out_index[(op.microbatch, op.slice)] >= ran:
                return
            self._issue(rank, "out", time)

    def _follow_emb(self, rank: int, time: float) -> bool:
        """A rank other than the first stage's issues the embedding collectives the first stage's
        rank has issued by ``time`` (a reduce only once its token ids are in)."""
        if rank == self.layout.first_rank:
            return False
        chan = self.channels["emb"]
        issued = False
        while chan.next[rank] < len(chan.seq) and chan.posted[chan.next[rank]] <= time:
            op = chan.seq[chan.next[rank]]
            if op.kind == OpKind.REDUCE_EMB and not self._done(OpKind.BCAST_IDS, op.unit[1:], time):
                break
            self._issue(rank, "emb", time)
            issued = True
        return issued

    # ---- compute ----------------------------------------------------------------------------

    def _available(self, what: str, unit: Unit, rank: int) -> float | None:
        """When the result of ``what`` for ``unit`` can be used on ``rank`` (None: not yet run)."""
        found = self.ends.get((what, unit))
        if found is None:
            return None
        end, producer, op = found
        if producer == rank:
            return end
        send = OpKind.SEND_F if op.kind == OpKind.F else OpKind.SEND_B
        return end + self.costs.comm_latency(Op(send, op.stage, op.microbatch, op.slice, rank))

    def _runnable(self, op: Op, rank: int, time: float) -> bool:
        for what, unit in compute_dependencies(op, self.schedule.num_stages, self.schedule.slices):
            when = self._available(what, unit, rank)
            if when is None or when > time:
                return False
        needed = self.layout.waits_for(op, rank)
        return needed is None or self._done(needed.kind, needed.unit[1:], time)

    def _choose(self, rank: int, time: float) -> tuple[Op, int | None] | None:
        """The op ``rank`` runs at ``time``: a ready vocabulary pass, else its next op, else a
        later forward pulled ahead of a waiting backward (at most ``extra`` of them)."""
        state = self.ranks[rank]
        last = self.layout.last_stage
        if state.next_t < state.next_s:
            unit = self.out_units[state.next_t]
            if self._done(OpKind.REDUCE_S, unit, time):
                return Op(OpKind.T, last, *unit), None
        if state.next_s < len(self.out_units):
            unit = self.out_units[state.next_s]
            if self._done(OpKind.BCAST_X, unit, time):
                return Op(OpKind.S, last, *unit), None
        state.skip_executed()
        if state.head >= len(state.base):
            return None
        head = state.base[state.head]
        if self._runnable(head, rank, time):
            return head, state.head
        if head.kind in BACKWARD_KINDS and state.pulled < self.extra:
            for index in range(state.head + 1, len(state.base)):
                if not state.executed[index] and state.base[index].kind == OpKind.F:
                    if self._runnable(state.base[index], rank, time):
                        return state.base[index], index
                    break
        return None

    def _run(self, rank: int, op: Op, index: int | None, time: float) -> None:
        state = self.ranks[rank]
        lay = self.layout
        unit = (op.microbatch, op.slice)
        if op.kind == OpKind.F and op.stage == 0 and rank == lay.first_rank:
            k = self.in_index[unit]
            for kind, ahead in (
                (OpKind.BCAST_IDS, k + self.lookahead + 1),
                (OpKind.REDUCE_EMB, k + self.lookahead),
            ):
                if ahead < len(self.in_units):
                    self._root_emb(kind, self.in_units[ahead], time)
        end = time + self.costs.duration(op)
        state.out.append(op)
        state.clock = end
        heapq.heappush(self.events, end)
        if index is not None:
            state.executed[index] = True
            if index > state.head:
                state.pulled += 1
            else:
                state.head += 1
                state.skip_executed()
            facts = {OpKind.F: ("F",), OpKind.B: ("B", "BACKWARD"), OpKind.BW: ("BACKWARD",), OpKind.W: ()}
            for what in facts[op.kind]:
                self.ends[(what, op.unit)] = (end, rank, op)
            if op.kind in (OpKind.F, OpKind.B, OpKind.BW):
                heapq.heappush(self.events, end + self.costs.comm_latency(op))
            if op.kind == OpKind.F and op.stage == lay.last_stage:
                self._issue(rank, "x", end)  # the loss rank is the root of BCAST_X
            if op.kind in BACKWARD_KINDS and op.stage == 0:
                self._root_emb(OpKind.BCAST_DEMB, unit, end)
            return
        if op.kind == OpKind.S:
            state.next_s += 1
            if rank != lay.loss_rank and state.next_s < len(self.out_units):
                self._issue(rank, "x", end)  # post the next broadcast's receive
        else:
            state.next_t += 1
        self._flush_out(rank, end)

    def _finished(self, rank: int) -> bool:
        state = self.ranks[rank]
        state.skip_executed()
        return (
            state.head >= len(state.base)
            and state.next_t == len(self.out_units)
            and all(chan.next[rank] == len(chan.seq) for chan in self.channels.values())
            and len(self.channels["emb"].seq) == 3 * len(self.in_units)
        )

    def run(self) -> list[list[Op]]:
        pp = self.schedule.pp
        time = -1.0
        while self.events:
            time = max(time, heapq.heappop(self.events))
            progress = True
            while progress:
                progress = False
                for rank in range(pp):
                    state = self.ranks[rank]
                    if state.clock > time:
                        continue
                    progress |= self._follow_emb(rank, time)
                    chosen = self._choose(rank, time)
                    if chosen is not None:
                        self._run(rank, chosen[0], chosen[1], time)
                        progress = True
            if all(self._finished(rank) for rank in range(pp)):
                ends = [state.clock for state in self.ranks]
                ends += [t for chan in self.channels.values() for t in chan.completed]
                self.makespan = max(ends, default=0.0)
                return [state.out for state in self.ranks]
        stuck = [
            f"rank {r} at {self.ranks[r].base[self.ranks[r].head]}"
            for r in range(pp)
            if self.ranks[r].head < len(self.ranks[r].base)
        ]
        raise VocabError(
            "the vocabulary passes could not be placed: the schedule stops with "
            + (", ".join(stuck) or "every stage op run but a collective never completes")
            + "; validate the schedule without them first"
        )


def delay_backwards(ops: list[Op], shift: int) -> list[Op]:
    """``ops`` with every B/BW moved ``shift`` forwards later (and the ops after it that are not
    forwards kept behind it, so a W stays after its B): ``shift`` more forwards in flight."""
    if shift <= 0:
        return list(ops)
    out: list[Op] = []
    held: deque[list[Any]] = deque()  # [op, forwards it still lets pass]
    for op in ops:
        if op.kind != OpKind.F:
            if held or op.kind in BACKWARD_KINDS:
                held.append([op, shift if op.kind in BACKWARD_KINDS else 0])
            else:
                out.append(op)
            continue
        out.append(op)
        for item in held:
            item[1] -= 1
        while held and held[0][1] <= 0:
            out.append(held.popleft()[0])
    out.extend(op for op, _ in held)
    return out


def default_costs(schedule: Schedule, variant: str) -> UniformCosts:
    """The uniform model with the output layer's share on every rank: S and T cost their GEMMs
    (``GEMMS``) at ``UNIFORM_GEMM`` each, collectives and vocabulary memory nothing."""
    s_gemms, t_gemms = GEMMS.get(variant, (1, 2))
    return UniformCosts(
        num_stages=schedule.num_stages,
        num_slices=schedule.slices,
        chunks_per_rank=schedule.vpp,
        vocab_forward=s_gemms * UNIFORM_GEMM,
        vocab_backward=t_gemms * UNIFORM_GEMM,
    )


def unsplit_costs(costs: UniformCosts, schedule: Schedule) -> TableCosts:
    """The uniform model without vocabulary parallelism, for a fair comparison: the last stage
    carries the whole output layer, p times one rank's S + T, a third each in its F, B and W (one
    GEMM each: logits, input gradient, weight gradient)."""
    last = schedule.num_stages - 1
    head = schedule.pp * (costs.vocab_forward + costs.vocab_backward) / 3 / schedule.slices
    probe = {kind: costs.duration(Op(kind, last, 0)) for kind in (OpKind.F, OpKind.B, OpKind.W)}
    durations: dict[tuple, float] = {(kind.value, last): value + head for kind, value in probe.items()}
    durations[("BW", last)] = durations[("B", last)] + durations[("W", last)]
    return TableCosts(default=costs, durations=durations)


def add_vocab_passes(
    schedule: Schedule,
    variant: str,
    costs: Any = None,
    extra_in_flight: int | None = None,
    lookahead: int = 2,
) -> Schedule:
    """``schedule`` with S, T and the collectives of vocabulary parallelism on every rank, per unit
    (microbatch, slice), placed by replaying it under ``costs`` (see the module docstring).

    ``extra_in_flight``: how many forwards a rank may run ahead of a backward that waits (default:
    the variant's barrier count, as in the paper). ``lookahead``: how many forwards ahead of the
    first stage's F the embedding reduce is issued. Apply it to a generator's schedule, before
    lowering and offload; ``variant`` ``none`` returns the schedule unchanged."""
    check_variant(variant)
    if variant == "none":
        return schedule
    if schedule.vocab_parallel != "none":
        raise VocabError("the schedule already has vocabulary passes")
    if any(op.is_comm or op.is_copy for _, _, op in schedule.all_ops()):
        raise VocabError(
            "add the vocabulary passes to the generator's schedule, before p2p lowering and offload"
        )
    declared = getattr(costs, "vocab_parallel", variant)
    if declared != variant:
        raise VocabError(
            f"the cost model is for vocabulary parallelism {declared!r}, the pass for {variant!r}: "
            "the last stage would be charged for the output layer twice (or not at all)"
        )
    extra = BARRIERS[variant] if extra_in_flight is None else extra_in_flight
    if extra < 0 or lookahead < 0:
        raise VocabError("extra_in_flight and lookahead must be at least 0")
    costs = costs or default_costs(schedule, variant)
    best: tuple[float, int, list[list[Op]]] | None = None
    for shift in range(extra, -1, -1):
        reordered = schedule.with_ranks([delay_backwards(ops, shift) for ops in schedule.ranks])
        placer = _Placer(reordered, variant, costs, extra - shift, lookahead)
        try:
            ranks = placer.run()
        except VocabError:
            if shift == 0:
                raise
            continue  # this reorder deadlocks the schedule
        if best is None or placer.makespan < best[0] - 1e-12:
            best = (placer.makespan, shift, ranks)
    assert best is not None
    return schedule.with_ranks(
        best[2], vocab_parallel=variant, vocab_extra_in_flight=extra, vocab_backward_shift=best[1]
    )


# ---- static memory ----------------------------------------------------------------------------


def vocab_rank_params(
    shape: ModelShape,
    placement: Placement,
    layers_per_stage: list[int],
    tp: int = 1,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
) -> list[int]:
    """Parameters per pipeline rank (one TP rank) with the vocabulary spread: the layers as
    ``memory_model.rank_params`` counts them, and on every rank 1/p of the (untied) embedding and
    output layer, the vocabulary padded to a multiple of ``vocab_divisible_by`` x t x p."""
    params = rank_params(shape, placement, layers_per_stage, tp, vocab_divisible_by)
    whole = padded_vocab(shape.vocab, tp, vocab_divisible_by) // tp * shape.hidden
    params[placement.rank_of(0)] -= whole
    params[placement.rank_of(placement.num_stages - 1)] -= whole
    shards = tp * placement.pp
    shard = padded_vocab(shape.vocab, shards, vocab_divisible_by) // shards * shape.hidden
    return [count + 2 * shard for count in params]


def vocab_static_memory(
    shape: ModelShape,
    placement: Placement,
    parallel: Parallelism | None = None,
    layers_per_stage: list[int] | None = None,
    param_bytes: int | None = None,
    grad_bytes: int = FP32,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
) -> list[MemoryParts]:
    """``memory_model.static_memory`` with the vocabulary spread over the pipeline ranks (same
    bytes per parameter: weights, fp32 main grads, Adam state sharded by the distributed optimizer)."""
    return static_memory(
        shape,
        placement,
        parallel,
        layers_per_stage,
        param_bytes,
        grad_bytes,
        vocab_divisible_by,
        count_params=vocab_rank_params,
    )
