"""Event-driven list scheduling: the engine under the zero-bubble and V-shape generators.

Every rank runs its ops one at a time. Whenever a rank is free, the engine collects the ops whose
inputs have arrived (the next forward and the next backward of each of its stages, and the oldest
pending W) and asks the schedule's *policy* which one to run, or whether to wait. The named
schedules differ only in their policy: which op comes first and when a new forward must wait for
memory. Time comes from :class:`~.request.Costs` (one F, B or W of one stage and one slice; BW
costs B + W; a message between ranks costs ``comm``).

Two rules keep every result executable after lowering:

* each stage runs its forwards in unit order and its backwards in backward-unit order
  (microbatches FIFO, slices last-first), the order ``deps.py`` expects;
* a receiver reads each channel (sender rank, receiver rank, direction) in the order the sender
  wrote it, so SEND/RECV pairs match when several stages share a channel.

Memory is counted in stage-units, the activation of one (stage, microbatch, slice): all of it from
F until B, :data:`WEIGHT_SHARE` of it from B until W (none after a BW).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .request import Costs

Unit = tuple[int, int, int]
_INF = float("inf")


WEIGHT_SHARE = 0.5
"""Share of a stage-unit's activation that B leaves behind for its W (the inputs of the weight
GEMMs). The simulator's uniform cost model makes the same assumption by default."""


@dataclass
class RankView:
    """What a policy sees of one rank when it picks the next op."""

    rank: int
    stages: tuple[int, ...]
    now: float = 0.0
    activations: int = 0  # stage-units whose F has run and whose B (or BW) has not
    pending_weights: deque[Op] = field(default_factory=deque)  # B has run, W has not (FIFO)
    forwards_done: dict[int, int] = field(default_factory=dict)  # per stage
    backwards_done: dict[int, int] = field(default_factory=dict)  # per stage
    next_arrival: float = float("inf")  # when the next not-yet-ready input lands, if known

    @property
    def in_flight(self) -> int:
        """Stage-units not yet released: F has run, W (or BW) has not."""
        return self.activations + len(self.pending_weights)

    @property
    def memory(self) -> float:
        """Activation held now, in stage-units (B releases all but :data:`WEIGHT_SHARE`)."""
        return self.activations + WEIGHT_SHARE * len(self.pending_weights)


Policy = Callable[[RankView, list[Op]], "Op | None"]
"""Given the ops that could start now on a rank, return the one to run, or None to wait."""


@dataclass
class ListResult:
    """The schedule plus the engine's own timing of it (what the policy planned for)."""

    schedule: Schedule
    makespan: float
    peak_units: list[float]  # per rank, in stage-units as :attr:`RankView.memory` counts them


def list_schedule(
    name: str,
    placement: Placement,
    microbatches: int,
    slices: int,
    policy: Policy,
    costs: Costs | None = None,
    split_backward: bool = True,
    meta: dict | None = None,
) -> ListResult:
    """Run ``policy`` on every rank until all ops are placed; raise RuntimeError on a deadlock."""
    return _Engine(placement, microbatches, slices, policy, costs or Costs(), split_backward).run(
        name, meta or {}
    )


class _Engine:
    def __init__(
        self,
        placement: Placement,
        microbatches: int,
        slices: int,
        policy: Policy,
        costs: Costs,
        split_backward: bool,
    ) -> None:
        self.place = placement
        self.num_stages = placement.num_stages
        self.microbatches = microbatches
        self.slices = slices
        self.policy = policy
        self.costs = costs
        self.split = split_backward
        self.forward_order = units(microbatches, slices)
        self.backward_order = backward_units(microbatches, slices)
        self.views = [RankView(rank, tuple(placement.stages_of(rank))) for rank in range(placement.pp)]
        for view in self.views:
            for stage in view.stages:
                view.forwards_done[stage] = 0
                view.backwards_done[stage] = 0
        self.free_at = [0.0] * placement.pp
        self.peak = [0.0] * placement.pp
        self.ops: list[list[Op]] = [[] for _ in range(placement.pp)]
        self.done_at: dict[tuple[str, Unit], float] = {}  # ("F"|"BACK", unit) -> finish time
        self.channels: dict[tuple[int, int, str], list[tuple[Unit, float]]] = {}
        self.read: dict[tuple[int, int, str], int] = {}
        self.total = self.num_stages * microbatches * slices * (3 if split_backward else 2)
        self.placed = 0

    # ---- readiness ------------------------------------------------------------------------

    def _input_time(self, rank: int, what: str, producer: Unit, consumer: Unit) -> float:
        """When the output of ``producer`` is usable on ``rank`` for ``consumer``; inf if not yet."""
        if (what, producer) not in self.done_at:
            return _INF
        owner = self.place.rank_of(producer[0])
        if owner == rank:
            return self.done_at[(what, producer)]
        key = (owner, rank, what)
        messages = self.channels.get(key, [])
        position = self.read.get(key, 0)
        if position >= len(messages) or messages[position][0] != consumer:
            return _INF  # not the next message on its channel: wait for the ones before it
        return messages[position][1]

    def _candidates(self, rank: int) -> list[tuple[Op, float]]:
        view = self.views[rank]
        found: list[tuple[Op, float]] = []
        total_units = len(self.forward_order)
        for stage in view.stages:
            index = view.forwards_done[stage]
            if index < total_units:
                mb, j = self.forward_order[index]
                unit = (stage, mb, j)
                ready = 0.0
                if stage > 0:
                    ready = self._input_time(rank, "F", (stage - 1, mb, j), unit)
                if j > 0:
                    ready = max(ready, self.done_at.get(("F", (stage, mb, j - 1)), _INF))
                found.append((Op(OpKind.F, stage, mb, j), ready))
            index = view.backwards_done[stage]
            if index < total_units:
                mb, j = self.backward_order[index]
                unit = (stage, mb, j)
                ready = self.done_at.get(("F", unit), _INF)
                if stage < self.num_stages - 1:
                    ready = max(ready, self._input_time(rank, "BACK", (stage + 1, mb, j), unit))
                if j < self.slices - 1:
                    ready = max(ready, self.done_at.get(("BACK", (stage, mb, j + 1)), _INF))
                found.append((Op(OpKind.B if self.split else OpKind.BW, stage, mb, j), ready))
        if view.pending_weights:
            found.append((view.pending_weights[0], self.free_at[rank]))
        return found

    # ---- placing an op --------------------------------------------------------------------

    def _duration(self, kind: OpKind) -> float:
        c = self.costs
        return {
            OpKind.F: c.forward,
            OpKind.B: c.backward,
            OpKind.W: c.weight,
            OpKind.BW: c.backward + c.weight,
        }[kind]

    def _consume(self, rank: int, what: str, producer_stage: int) -> None:
        owner = self.place.rank_of(producer_stage)
        if owner != rank:
            key = (owner, rank, what)
            self.read[key] = self.read.get(key, 0) + 1

    def _send(self, rank: int, what: str, consumer_stage: int, unit: Unit, finish: float) -> None:
        owner = self.place.rank_of(consumer_stage)
        if owner != rank:
            consumer = (consumer_stage, unit[1], unit[2])
            self.channels.setdefault((rank, owner, what), []).append((consumer, finish + self.costs.comm))

    def _place(self, rank: int, op: Op, start: float) -> None:
        view = self.views[rank]
        finish = start + self._duration(op.kind)
        stage, unit = op.stage, op.unit
        last = self.num_stages - 1
        if op.kind == OpKind.F:
            if stage > 0:
                self._consume(rank, "F", stage - 1)
            self.done_at[("F", unit)] = finish
            if stage < last:
                self._send(rank, "F", stage + 1, unit, finish)
            view.forwards_done[stage] += 1
            view.activations += 1
            self.peak[rank] = max(self.peak[rank], view.memory)
        elif op.kind in (OpKind.B, OpKind.BW):
            if stage < last:
                self._consume(rank, "BACK", stage + 1)
            self.done_at[("BACK", unit)] = finish
            if stage > 0:
                self._send(rank, "BACK", stage - 1, unit, finish)
            view.backwards_done[stage] += 1
            view.activations -= 1
            if op.kind == OpKind.B:
                view.pending_weights.append(Op(OpKind.W, stage, op.microbatch, op.slice))
        else:
            view.pending_weights.remove(op)
        self.ops[rank].append(op)
        self.free_at[rank] = finish
        self.placed += 1

    # ---- the event loop -------------------------------------------------------------------

    def run(self, name: str, meta: dict) -> ListResult:
        pp = self.place.pp
        per_rank = [
            len(view.stages) * len(self.forward_order) * (3 if self.split else 2) for view in self.views
        ]
        while self.placed < self.total:
            active = [r for r in range(pp) if len(self.ops[r]) < per_rank[r]]
            now = min(self.free_at[r] for r in active)
            waiting: list[int] = []
            for rank in active:
                if self.free_at[rank] > now:
                    continue
                candidates = self._candidates(rank)
                ready = [op for op, at in candidates if at <= now + 1e-9]
                view = self.views[rank]
                view.now = now
                view.next_arrival = min((at for _, at in candidates if at > now + 1e-9), default=_INF)
                choice = self.policy(view, ready) if ready else None
                if choice is None:
                    waiting.append(rank)
                else:
                    self._place(rank, choice, now)
            if not waiting:
                continue
            future = [self.free_at[r] for r in active if self.free_at[r] > now]
            for rank in waiting:
                future.extend(at for _, at in self._candidates(rank) if now + 1e-9 < at < _INF)
            if not future:
                stuck = ", ".join(f"rank {r} ({len(self.ops[r])}/{per_rank[r]} ops)" for r in waiting)
                raise RuntimeError(f"list scheduler for {name} is stuck: {stuck}")
            wake = min(future)
            for rank in waiting:
                self.free_at[rank] = wake
        makespan = max(self.free_at) if pp else 0.0
        schedule = Schedule(
            name=name,
            pp=pp,
            microbatches=self.microbatches,
            num_stages=self.num_stages,
            slices=self.slices,
            placement=self.place,
            ranks=self.ops,
            meta=dict(meta),
        )
        return ListResult(schedule, makespan, list(self.peak))
