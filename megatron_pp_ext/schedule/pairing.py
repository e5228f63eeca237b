"""Overlapped pairs: the forward of one microbatch and the backward of another run as one unit.

DualPipe exists for mixture-of-experts training: each F&B pair of two microbatches runs as one
unit so that the expert all-to-all (dispatch and combine) of one hides behind the attention and
expert GEMMs of the other. A pair is two compute ops adjacent on a rank, an F and a B (or BW) of
different microbatches, neither feeding the other; :func:`pair` marks such pairs of any
generator's schedule in ``meta["pairs"]`` (left to right, each op in at most one pair), where the
pair neither closes a cycle of waits nor makes the step longer: DualPipeV's two directions and
interleaved 1F1B's chunks pair well, plain 1F1B barely (``docs/schedules.md``).

What pairing changes:

- lowering (``lowering.insert_p2p``): the pair's receives are posted before its first op and its
  sends go after its second, so the two run back to back as one unit (the validator's execution
  check then shows the step cannot deadlock with the pair's order);
- time (``replay``): the first op of a pair also waits for its partner's input; the pair's
  computes run serialised, each op's all-to-all hidden behind the other's compute
  (``hidden_seconds``), the rest exposed;
- memory: the two ops' own, in their order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .costs import UniformCosts
from .ir import Op, OpKind, Schedule
from .lowering import lower
from .pairs import PairKey, key_of
from .replay import replay
from .validate import ScheduleError

BACKWARD = (OpKind.B, OpKind.BW)


def _pairable(first: Op, second: Op) -> bool:
    """An F and a B (or BW) of different microbatches: neither needs the other (within one
    microbatch every backward needs every forward, through the stages or the later slices)."""
    kinds = {first.kind, second.kind}
    return OpKind.F in kinds and bool(kinds & set(BACKWARD)) and first.microbatch != second.microbatch


def pair(schedule: Schedule, costs: Any = None, max_replays: int | None = None) -> Schedule:
    """``schedule`` with ``meta["pairs"]``: per rank, the [first, second] op keys of each pair:
    two compute ops with no other compute op (a W, a vocabulary pass) between them, taken left to
    right where the pair cannot deadlock the step (:class:`_Dependencies`) and does not make it
    longer at ``costs`` (default: unit costs). A pair waits for both its inputs and sends after
    both ops: next to each other in 1F1B's steady state, the forward of one microbatch and the
    backward of another wait on each other's neighbours, which DualPipeV's two directions avoid.

    Each check replays the step, so a rank's pairs are first tried all at once (one replay) and
    kept when together they do not lengthen the step (DualPipeV's); only a rank whose pairs
    together do is walked pair by pair (a replay each). ``max_replays`` caps the replays (the
    planner's search): past it, the ops left are not paired."""
    if schedule.vocab_parallel != "none":
        raise ValueError(
            "overlapped pairs with vocabulary passes: their collectives are not in the pair's order"
        )
    if costs is None:
        costs = UniformCosts(
            num_stages=schedule.num_stages, num_slices=schedule.slices, chunks_per_rank=schedule.vpp
        )

    replays = 0

    def makespan(pairs: list[list[list[PairKey]]]) -> float:
        nonlocal replays
        replays += 1
        try:
            return replay(lower(schedule.with_ranks(list(schedule.ranks), pairs=pairs)), costs).makespan
        except ScheduleError:
            return math.inf

    def no_longer(span: float, best: float) -> bool:
        return span <= best + 1e-9 * max(1.0, best)

    graph = _Dependencies(schedule)
    pairs: list[list[list[PairKey]]] = [[] for _ in schedule.ranks]
    best = makespan(pairs)

    for rank, ops in enumerate(schedule.ranks):
        compute = [op for op in ops if op.is_compute]
        walked = _walk(graph, rank, compute)
        if not walked or (max_replays is not None and replays >= max_replays):
            for _, added in walked:
                graph.remove(added)
            continue
        pairs[rank] = [keys for keys, _ in walked]
        span = makespan(pairs)
        if no_longer(span, best):  # all of the rank's pairs at once: one replay
            best = span
            continue
        for _, added in reversed(walked):
            graph.remove(added)
        pairs[rank] = []

        def keep(keys: list[PairKey], rank: int = rank) -> bool:
            """One more pair on this rank, kept where the step is no longer with it."""
            nonlocal best
            pairs[rank].append(keys)
            span = makespan(pairs)
            if no_longer(span, best):
                best = span
                return True
            pairs[rank].pop()
            return False

        _walk(graph, rank, compute, keep, lambda: max_replays is None or replays < max_replays)
    return schedule.with_ranks([list(ops) for ops in schedule.ranks], pairs=pairs)


def _walk(
    graph: _Dependencies,
    rank: int,
    compute: list[Op],
    keep: Callable[[list[PairKey]], bool] = lambda keys: True,
    more: Callable[[], bool] = lambda: True,
) -> list[tuple[list[PairKey], list[tuple[PairKey, PairKey]]]]:
    """The pairs the left-to-right walk of ``rank``'s compute ops takes (each added to ``graph``),
    with the waits each added: a pair where it cannot deadlock and ``keep`` takes it, while
    ``more`` says go on."""
    walked = []
    position = 0
    while position + 1 < len(compute) and more():
        first, second = compute[position], compute[position + 1]
        added = graph.add_pair(rank, first, second) if _pairable(first, second) else None
        if added is not None:
            keys = [key_of(first), key_of(second)]
            if keep(keys):
                walked.append((keys, added))
                position += 2
                continue
            graph.remove(added)
        position += 1
    return walked


class _Dependencies:
    """What waits for what in a step: each rank's compute ops in order, and each op's input from
    the op that produces it (the previous stage's F, the next stage's B). A pair adds two kinds of
    wait: its first op waits for its second op's input, and the consumers of the first op's output
    wait for the second op (the pair sends after it). A pair is taken only if neither closes a
    cycle: a cycle is a step that never finishes."""

    def __init__(self, schedule: Schedule) -> None:
        self.rank_of: dict[PairKey, int] = {}
        self.after: dict[PairKey, list[PairKey]] = {}
        self.last_stage = schedule.num_stages - 1
        for rank, ops in enumerate(schedule.ranks):
            compute = [key_of(op) for op in ops if op.is_compute]
            for key in compute:
                self.rank_of[key] = rank
                self.after.setdefault(key, [])
            for earlier, later in zip(compute, compute[1:]):
                self.after[earlier].append(later)
        for key in list(self.after):
            producer = self.producer(key)
            if producer is not None:
                self.after[producer].append(key)

    def producer(self, key: PairKey) -> PairKey | None:
        """The op whose output ``key`` takes in (None: none, or the model's input or loss)."""
        kind, stage, microbatch, slice_index = key
        if kind == OpKind.F.value:
            return (kind, stage - 1, microbatch, slice_index) if stage > 0 else None
        if kind in (OpKind.B.value, OpKind.BW.value) and stage < self.last_stage:
            for backward in (OpKind.B.value, OpKind.BW.value):
                if (backward, stage + 1, microbatch, slice_index) in self.rank_of:
                    return (backward, stage + 1, microbatch, slice_index)
        return None

    def consumers(self, key: PairKey) -> list[PairKey]:
        """The ops on other ranks that take ``key``'s output."""
        rank = self.rank_of[key]
        return [k for k in self.after[key] if self.rank_of[k] != rank and self.producer(k) == key]

    def reaches(self, start: PairKey, goal: PairKey) -> bool:
        seen, stack = {start}, [start]
        while stack:
            key = stack.pop()
            if key == goal:
                return True
            for nxt in self.after[key]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def add_pair(self, rank: int, first: Op, second: Op) -> list[tuple[PairKey, PairKey]] | None:
        """Add the pair's waits and return them, or None (nothing added) if one closes a cycle."""
        a, b = key_of(first), key_of(second)
        edges = []
        producer = self.producer(b)
        if producer is not None and self.rank_of[producer] != rank:
            edges.append((producer, a))
        edges += [(b, consumer) for consumer in self.consumers(a)]
        added: list[tuple[PairKey, PairKey]] = []
        for source, target in edges:
            if self.reaches(target, source):
                self.remove(added)
                return None
            self.after[source].append(target)
            added.append((source, target))
        return added

    def remove(self, edges: list[tuple[PairKey, PairKey]]) -> None:
        for source, target in edges:
            self.after[source].remove(target)
