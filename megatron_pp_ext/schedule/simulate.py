"""Event-driven replay of a lowered schedule: time, bubbles and activation memory per rank.

Each rank runs its ops in order. A compute op starts when the rank is free; a RECV completes
when the matching SEND's data has arrived (the SEND is issued when the producing op ends and
the message takes the cost model's latency); sends never block. Memory: F adds the op's
activation when it starts, B frees all but the weight-gradient share (at its end), W frees that
share, BW frees everything.

Bubble rate of a rank = idle time / makespan; the overall rate is the mean over ranks. The
"in span" rate counts each rank only between its own first and last op, as the zero-bubble
papers do.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from .costs import CostModel, UniformCosts
from .ir import Op, OpKind, Schedule, format_op
from .lowering import lower
from .validate import ScheduleError


@dataclass(frozen=True)
class Event:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    makespan: float
    busy_per_rank: list[float]
    peak_memory_per_rank: list[float]  # in the cost model's memory unit (bytes for FLOP models)
    microbatch_activation: float
    events: list[Event] = field(default_factory=list)
    memory_curves: list[list[tuple[float, float]]] = field(default_factory=list)

    @property
    def bubble_rate_per_rank(self) -> list[float]:
        if self.makespan <= 0:
            return [0.0 for _ in self.busy_per_rank]
        return [(self.makespan - busy) / self.makespan for busy in self.busy_per_rank]

    @property
    def bubble_rate(self) -> float:
        rates = self.bubble_rate_per_rank
        return sum(rates) / len(rates)

    @property
    def bubble_rate_in_span_per_rank(self) -> list[float]:
        """Idle share of each rank between its own first op's start and last op's end: the
        zero-bubble papers' convention (a rank's staggered start is not counted)."""
        first = [math.inf] * len(self.busy_per_rank)
        last = [0.0] * len(self.busy_per_rank)
        for event in self.events:
            first[event.rank] = min(first[event.rank], event.start)
            last[event.rank] = max(last[event.rank], event.end)
        return [
            (end - start - busy) / (end - start) if end > start else 0.0
            for start, end, busy in zip(first, last, self.busy_per_rank)
        ]

    @property
    def bubble_rate_in_span(self) -> float:
        rates = self.bubble_rate_in_span_per_rank
        return sum(rates) / len(rates)

    @property
    def peak_memory_m(self) -> list[float]:
        """Peak activation per rank in units of M (one whole microbatch over all layers)."""
        return [peak / self.microbatch_activation for peak in self.peak_memory_per_rank]

    def to_dict(self) -> dict[str, Any]:
        s = self.schedule
        return {
            "schedule": s.name,
            "pp": s.pp,
            "microbatches": s.microbatches,
            "vpp": s.vpp,
            "slices": s.slices,
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_per_rank": self.bubble_rate_per_rank,
            "bubble_rate_in_span": self.bubble_rate_in_span,
            "peak_memory_m": self.peak_memory_m,
            "peak_memory_bytes": self.peak_memory_per_rank,
        }


def message_key(op: Op) -> tuple[str, int, int, int]:
    """The same key for a SEND and its matching RECV: (direction, receiving stage, mb, slice)."""
    if op.kind == OpKind.SEND_F:
        return ("F", op.stage + 1, op.microbatch, op.slice)
    if op.kind == OpKind.SEND_B:
        return ("B", op.stage - 1, op.microbatch, op.slice)
    return ("F" if op.kind == OpKind.RECV_F else "B", op.stage, op.microbatch, op.slice)


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Replay ``schedule`` (lowered first if needed) under ``costs`` (unit costs by default)."""
    if costs is None:
        costs = UniformCosts(
            num_stages=schedule.num_stages, num_slices=schedule.slices, chunks_per_rank=schedule.vpp
        )
    lowered = lower(schedule)
    arrival: dict[tuple[str, int, int, int], float] = {}  # message_key -> arrival time
    clock = [0.0] * lowered.pp
    busy = [0.0] * lowered.pp
    memory = [0.0] * lowered.pp
    peak = [0.0] * lowered.pp
    curves: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(lowered.pp)]
    held_for_w: dict[tuple[int, tuple[int, int, int]], float] = {}
    events: list[Event] = []
    pointers = [0] * lowered.pp
    last_compute_end = [0.0] * lowered.pp

    def step(rank: int, op: Op) -> bool:
        """Run ``op`` on ``rank`` if it can run now; return whether it ran."""
        now = clock[rank]
        if op.kind in (OpKind.RECV_F, OpKind.RECV_B):
            key = message_key(op)
            if key not in arrival:
                return False
            clock[rank] = max(now, arrival[key])
            return True
        if op.kind in (OpKind.SEND_F, OpKind.SEND_B):
            arrival[message_key(op)] = last_compute_end[rank] + costs.comm_latency(op)
            return True
        duration = costs.duration(op)
        start, end = now, now + duration
        events.append(Event(rank, op, start, end))
        busy[rank] += duration
        clock[rank] = end
        last_compute_end[rank] = end
        if op.kind == OpKind.F:
            _change(rank, start, costs.activation(op))
        elif op.kind == OpKind.B:
            share = costs.weight_share(op)
            held_for_w[(rank, op.unit)] = share
            _change(rank, end, share - costs.activation(op))
        elif op.kind == OpKind.W:
            _change(rank, end, -held_for_w.pop((rank, op.unit)))
        elif op.kind == OpKind.BW:
            _change(rank, end, -costs.activation(op))
        return True

    def _change(rank: int, time: float, delta: float) -> None:
        memory[rank] += delta
        peak[rank] = max(peak[rank], memory[rank])
        curves[rank].append((time, memory[rank]))

    # A rank runs until a RECV waits for a message not yet sent; the SEND wakes it.
    waiting: dict[tuple[str, int, int, int], list[int]] = defaultdict(list)
    ready = deque(range(lowered.pp))
    while ready:
        rank = ready.popleft()
        ops = lowered.ranks[rank]
        while pointers[rank] < len(ops):
            op = ops[pointers[rank]]
            if not step(rank, op):
                waiting[message_key(op)].append(rank)
                break
            if op.kind in (OpKind.SEND_F, OpKind.SEND_B):
                ready.extend(waiting.pop(message_key(op), ()))
            pointers[rank] += 1
    stuck = [r for r in range(lowered.pp) if pointers[r] < len(lowered.ranks[r])]
    if stuck:
        detail = "; ".join(f"rank {r} waits at {format_op(lowered.ranks[r][pointers[r]])}" for r in stuck)
        raise ScheduleError(f"deadlock in simulation: {detail}")
    makespan = max((e.end for e in events), default=0.0)
    return SimResult(
        schedule=schedule,
        makespan=makespan,
        busy_per_rank=busy,
        peak_memory_per_rank=peak,
        microbatch_activation=costs.microbatch_activation,
        events=events,
        memory_curves=curves,
    )
