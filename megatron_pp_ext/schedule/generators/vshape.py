"""V-shape schedules with controllable memory (Qi et al., NeurIPS'24): V-Min, V-Half, V-ZB.

Each rank holds two chunks placed as a V: stage s on rank s for s < p and on rank 2p-1-s after,
so rank 0 holds the first and the last stage and computes the loss. The paper builds a schedule
from a *building block*, the passes of one unit laid out in time, repeated every 6 slots (each
rank runs 2 F, 2 B and 2 W per unit, one slot each when F=B=W). A rank's activation memory is
about (lifespan of a unit on it) / 6 units, so the block's shape sets the memory:

* the forwards go down and back up the V one slot apart, each op taking the first slot that is
  free modulo 6 on its rank (so the repeated blocks never collide);
* after ``turn`` extra slots at the loss (the end of the V, back on rank 0), the backwards go
  back the same way, and each W follows its B after ``w_delay`` slots.

A short turn gives V-Min, a longer one V-Half, longer still V-ZB. Repeating the block and running
it as soon as possible (the paper's *squeezing*) leaves bubbles in the warm-up and the cool-down,
where memory is underused; the paper *reorders* those phases. Ours lets the list scheduler do it:
each rank follows the repeated block's order, lets a ready B overtake a planned W, and when its
next op is not ready fills the slot with other ready work, a new down-leg forward only while its
memory stays under ``cap``.

With k slices a unit is a (microbatch, slice) pair; the backwards of a microbatch go last slice
first, so the backward half of the block moves k-1 periods later (the last slice's forward must
be done before the first backward of its microbatch).
"""

from __future__ import annotations

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .list_scheduler import RankView, list_schedule
from .request import ScheduleRequest

PERIOD = 6  # slots per repeated block on each rank: F, F, B, B, W, W
Block = dict[tuple[OpKind, int], int]  # (kind, stage) -> slot of unit 0


def v_placement(pp: int) -> Placement:
    return Placement(pp, 2 * pp, "vshape")


def building_block(pp: int, turn: int, w_delay: int) -> Block:
    """Slots of one unit's passes: forwards down and up the V, ``turn`` slots at the loss, the
    backwards back down, each W ``w_delay`` slots after its B; every op takes the first slot at
    or after that which no other op of its rank uses modulo :data:`PERIOD`."""
    place = v_placement(pp)
    used: list[set[int]] = [set() for _ in range(pp)]
    block: Block = {}

    def put(kind: OpKind, stage: int, earliest: int) -> None:
        rank, slot = place.rank_of(stage), earliest
        while slot % PERIOD in used[rank]:
            slot += 1
        used[rank].add(slot % PERIOD)
        block[(kind, stage)] = slot

    last = 2 * pp - 1
    for stage in range(2 * pp):
        put(OpKind.F, stage, 0 if stage == 0 else block[(OpKind.F, stage - 1)] + 1)
    for stage in reversed(range(2 * pp)):
        after = block[(OpKind.F, last)] + 1 + turn if stage == last else block[(OpKind.B, stage + 1)] + 1
        put(OpKind.B, stage, after)
    for stage in sorted(range(2 * pp), key=lambda s: block[(OpKind.B, s)]):
        put(OpKind.W, stage, block[(OpKind.B, stage)] + 1 + w_delay)
    return block


def repeat_block(block: Block, pp: int, microbatches: int, slices: int) -> list[list[Op]]:
    """Each rank's ops in the order of the repeated block: unit u's forwards at their block slot
    + 6u, the backward-order unit u's B and W at their slot + 6u + 6(k-1)."""
    place = v_placement(pp)
    shift = PERIOD * (slices - 1)
    timed: list[list[tuple[int, Op]]] = [[] for _ in range(pp)]
    for stage in range(2 * pp):
        rank = place.rank_of(stage)
        for u, (mb, j) in enumerate(units(microbatches, slices)):
            timed[rank].append((block[(OpKind.F, stage)] + PERIOD * u, Op(OpKind.F, stage, mb, j)))
        for u, (mb, j) in enumerate(backward_units(microbatches, slices)):
            for kind in (OpKind.B, OpKind.W):
                slot = block[(kind, stage)] + PERIOD * u + shift
                timed[rank].append((slot, Op(kind, stage, mb, j)))
    return [[op for _, op in sorted(ops, key=lambda item: item[0])] for ops in timed]


class FollowBlock:
    """Follow the repeated block; a ready B may overtake a planned W; an idle slot takes a ready
    B or up-leg F, else a new down-leg F while memory + 1 <= ``cap`` stage-units, else a W."""

    def __init__(self, plan: list[list[Op]], pp: int, cap: float) -> None:
        self.plan = plan
        self.pp = pp
        self.cap = cap
        self.position = [0] * len(plan)
        self.index = [{op: i for i, op in enumerate(ops)} for ops in plan]
        self.done = [bytearray(len(ops)) for ops in plan]

    def _next_planned(self, rank: int) -> Op | None:
        ops, done, i = self.plan[rank], self.done[rank], self.position[rank]
        while i < len(ops) and done[i]:
            i += 1
        self.position[rank] = i
        return ops[i] if i < len(ops) else None

    def _choose(self, view: RankView, ready: list[Op]) -> Op | None:
        planned = self._next_planned(view.rank)
        if planned is not None and planned.kind == OpKind.W:
            for op in ready:
                if op.kind == OpKind.B:
                    return op
        if planned in ready:
            return planned
        for op in ready:
            if op.kind == OpKind.B or (op.kind == OpKind.F and op.stage >= self.pp):
                return op
        for op in ready:
            if op.kind == OpKind.F and view.memory + 1 <= self.cap + 1e-9:
                return op
        for op in ready:
            if op.kind == OpKind.W:
                return op
        return None

    def __call__(self, view: RankView, ready: list[Op]) -> Op | None:
        choice = self._choose(view, ready)
        if choice is not None:
            self.done[view.rank][self.index[view.rank][choice]] = 1
        return choice


def v_shape(request: ScheduleRequest, name: str, turn: int, w_delay: int, cap_units: float) -> Schedule:
    """The common V-shape generator; ``cap_units`` is per slice-free stage-unit (scaled by k)."""
    pp, slices = request.pp, request.slices
    block = building_block(pp, turn, w_delay)
    plan = repeat_block(block, pp, request.microbatches, slices)
    cap = cap_units * slices
    meta = {"turn": turn, "w_delay": w_delay, "fill_cap_units": cap}
    result = list_schedule(
        request.name or name,
        v_placement(pp),
        request.microbatches,
        slices,
        FollowBlock(plan, pp, cap),
        costs=request.costs,
        meta=meta,
    )
    return result.schedule


def v_min(request: ScheduleRequest) -> Schedule:
    """The shortest lifespan the V allows: forwards straight down and up, backwards straight
    back, W right after B. About M/3 at rank 0, bubble about 2/3 of 1F1B's. Whole microbatches
    already fill M/3, so no extra warm-up forwards; sliced units hold far less, so the warm-up
    fills up to M/3 (2p/3 stage-units). (When 3 divides p the tight block collides with itself
    modulo 6; starting the Ws half a period later untangles it.)"""
    pp = request.pp
    cap = 0.0 if request.slices == 1 else 2 * pp / 3
    return v_shape(request, "v-min", turn=0, w_delay=3 if pp % 3 == 0 else 0, cap_units=cap)


def v_half(request: ScheduleRequest) -> Schedule:
    """A turn of p-1 slots and W a period after B: a lifespan of about 3p slots, half of
    V-ZB's, so about M/2 ((p+2)//2 microbatches' worth at rank 0), and up to p/2 + 1
    stage-units of extra warm-up forwards; bubble about half of 1F1B's."""
    pp = request.pp
    return v_shape(request, "v-half", turn=max(0, pp - 1), w_delay=6, cap_units=pp // 2 + 1)


def v_zb(request: ScheduleRequest) -> Schedule:
    """A turn of 4p-7 slots: a lifespan long enough that the steady state never waits (about M
    at rank 0, like 1F1B), plus 2p-3 (at least 3) stage-units of warm-up forwards, so that the pipeline has
    no bubble beyond its fill."""
    pp = request.pp
    return v_shape(request, "v-zb", turn=max(0, 4 * pp - 7), w_delay=3, cap_units=max(3, 2 * pp - 3))
