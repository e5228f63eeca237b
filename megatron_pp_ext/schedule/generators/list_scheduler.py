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
    peak_in_flight: list[int] = field(default_factory=list)  # per rank, stage-units from F to W
    peak_activations: list[int] = field(default_factory=list)  # per rank, stage-units from F to B
    first_start: list[float] = field(default_factory=list)  # per rank, when its first op starts
    last_end: list[float] = field(default_factory=list)  # per rank, when its last op ends
    busy: list[float] = field(default_factory=list)  # per rank, time spent computing

    @property
    def span_idle(self) -> list[float]:
        """Per rank, idle time between its first op's start and its last op's end (the
        zero-bubble papers' in-span bubble)."""
        return [end - start - busy for start, end, busy in zip(self.first_start, self.last_end, self.busy)]


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
        self.num_stages = stages = placement.num_stages
        self.microbatches = microbatches
        self.slices = slices
        self.policy = policy
        self.split = split_backward
        forward_order = units(microbatches, slices)
        backward_order = backward_units(microbatches, slices)
        self.units = n = len(forward_order)
        forward_index = {unit: index for index, unit in enumerate(forward_order)}
        # the forward index of the unit at each backward position
        self.forward_of_backward = [forward_index[unit] for unit in backward_order]
        back_kind = OpKind.B if split_backward else OpKind.BW
        self.forward_ops = [[Op(OpKind.F, s, mb, j) for mb, j in forward_order] for s in range(stages)]
        self.backward_ops = [[Op(back_kind, s, mb, j) for mb, j in backward_order] for s in range(stages)]
        self.weight_ops = [[Op(OpKind.W, s, mb, j) for mb, j in backward_order] for s in range(stages)]
        self.owner = [placement.rank_of(s) for s in range(stages)]
        self.forward_done_at = [[_INF] * n for _ in range(stages)]
        self.backward_done_at = [[_INF] * n for _ in range(stages)]
        self.duration = {
            OpKind.F: costs.forward,
            OpKind.B: costs.backward,
            OpKind.W: costs.weight,
            OpKind.BW: costs.backward + costs.weight,
        }
        self.comm = costs.comm
        self.views = [RankView(rank, tuple(placement.stages_of(rank))) for rank in range(placement.pp)]
        for view in self.views:
            for stage in view.stages:
                view.forwards_done[stage] = 0
                view.backwards_done[stage] = 0
        self.free_at = [0.0] * placement.pp
        self.peak = [0.0] * placement.pp
        self.peak_in_flight = [0] * placement.pp
        self.peak_activations = [0] * placement.pp
        self.first_start = [_INF] * placement.pp
        self.last_end = [0.0] * placement.pp
        self.busy = [0.0] * placement.pp
        self.ops: list[list[Op]] = [[] for _ in range(placement.pp)]
        # channel (sender, receiver, "F"|"B") -> messages in send order: (consumer stage, index)
        self.channels: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
        self.read: dict[tuple[int, int, str], int] = {}
        self.total = stages * n * (3 if split_backward else 2)
        self.placed = 0

    # ---- readiness ------------------------------------------------------------------------

    def _input_time(self, rank: int, what: str, producer: int, consumer: int, index: int) -> float:
        """When the output of stage ``producer`` for position ``index`` (in the forward order for
        "F", the backward order for "B") is usable on ``rank`` by stage ``consumer``."""
        done = (self.forward_done_at if what == "F" else self.backward_done_at)[producer][index]
        owner = self.owner[producer]
        if done == _INF or owner == rank:
            return done
        key = (owner, rank, what)
        position = self.read.get(key, 0)
        messages = self.channels[key]
        if position >= len(messages) or messages[position] != (consumer, index):
            return _INF  # not the next message on its channel: wait for the ones before it
        return done + self.comm

    def _candidates(self, rank: int) -> list[tuple[Op, float]]:
        view = self.views[rank]
        found: list[tuple[Op, float]] = []
        n, last = self.units, self.num_stages - 1
        for stage in view.stages:
            index = view.forwards_done[stage]
            if index < n:
                ready = 0.0 if stage == 0 else self._input_time(rank, "F", stage - 1, stage, index)
                found.append((self.forward_ops[stage][index], ready))
            index = view.backwards_done[stage]
            if index < n:
                if self.forward_of_backward[index] >= view.forwards_done[stage]:
                    ready = _INF  # its own forward has not run yet
                else:
                    ready = self.forward_done_at[stage][self.forward_of_backward[index]]
                    if stage < last:
                        ready = max(ready, self._input_time(rank, "B", stage + 1, stage, index))
                found.append((self.backward_ops[stage][index], ready))
        if view.pending_weights:
            found.append((view.pending_weights[0], self.free_at[rank]))
        return found

    # ---- placing an op --------------------------------------------------------------------

    def _message(self, rank: int, what: str, producer: int, consumer: int, index: int, send: bool) -> None:
        other = self.owner[consumer if send else producer]
        if other == rank:
            return
        if send:
            self.channels.setdefault((rank, other, what), []).append((consumer, index))
        else:
            key = (other, rank, what)
            self.read[key] = self.read.get(key, 0) + 1

    def _place(self, rank: int, op: Op, start: float) -> None:
        view = self.views[rank]
        finish = start + self.duration[op.kind]
        stage, last = op.stage, self.num_stages - 1
        if op.kind == OpKind.F:
            index = view.forwards_done[stage]
            if stage > 0:
                self._message(rank, "F", stage - 1, stage, index, send=False)
            self.forward_done_at[stage][index] = finish
            if stage < last:
                self._message(rank, "F", stage, stage + 1, index, send=True)
            view.forwards_done[stage] += 1
            view.activations += 1
            self.peak[rank] = max(self.peak[rank], view.memory)
            self.peak_in_flight[rank] = max(self.peak_in_flight[rank], view.in_flight)
            self.peak_activations[rank] = max(self.peak_activations[rank], view.activations)
        elif op.kind in (OpKind.B, OpKind.BW):
            index = view.backwards_done[stage]
            if stage < last:
                self._message(rank, "B", stage + 1, stage, index, send=False)
            self.backward_done_at[stage][index] = finish
            if stage > 0:
                self._message(rank, "B", stage, stage - 1, index, send=True)
            view.backwards_done[stage] += 1
            view.activations -= 1
            if op.kind == OpKind.B:
                view.pending_weights.append(self.weight_ops[stage][index])
        else:
            view.pending_weights.remove(op)
        self.ops[rank].append(op)
        self.free_at[rank] = finish
        self.first_start[rank] = min(self.first_start[rank], start)
        self.last_end[rank] = finish
        self.busy[rank] += finish - start
        self.placed += 1

    # ---- the event loop -------------------------------------------------------------------

    def run(self, name: str, meta: dict) -> ListResult:
        pp = self.place.pp
        remaining = [len(view.stages) * self.units * (3 if self.split else 2) for view in self.views]
        active = [r for r in range(pp) if remaining[r]]
        while active:
            now = min(self.free_at[r] for r in active)
            waiting: list[tuple[int, list[tuple[Op, float]]]] = []
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
                    waiting.append((rank, candidates))
                else:
                    self._place(rank, choice, now)
                    remaining[rank] -= 1
            active = [r for r in active if remaining[r]]
            if not waiting:
                continue
            future = [self.free_at[r] for r in active if self.free_at[r] > now]
            for rank, _ in waiting:
                # inputs that land later than now, now that this round's ops are placed
                future.extend(at for _, at in self._candidates(rank) if now + 1e-9 < at < _INF)
            if not future:
                stuck = ", ".join(f"rank {r} ({len(self.ops[r])} ops placed)" for r, _ in waiting)
                raise RuntimeError(f"list scheduler for {name} is stuck: {stuck}")
            wake = min(future)
            for rank, _ in waiting:
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
        return ListResult(
            schedule,
            makespan,
            list(self.peak),
            peak_in_flight=list(self.peak_in_flight),
            peak_activations=list(self.peak_activations),
            first_start=[0.0 if start == _INF else start for start in self.first_start],
            busy=list(self.busy),
            last_end=list(self.last_end),
        )
