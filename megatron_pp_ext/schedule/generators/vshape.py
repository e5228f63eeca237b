"""V-shape schedules with controllable memory (Qi et al., NeurIPS'24): V-Min, V-Half, V-ZB.

Each rank holds two chunks placed as a V: stage s on rank s for s < p and on rank 2p-1-s after,
so rank 0 holds the first and the last stage and computes the loss. Memory is counted from a
unit's F to its W (a stage-unit is 1/(2p) of M): that bounds the peak whether B frees part of the
activation or not, so each schedule keeps its paper's memory in every accounting the simulator
offers (until B, the default, until W; the runtime's deferred W keeps almost all of an F's
activation with flash attention, see docs/schedules.md).

V-Min and V-Half come from the paper's *building block*, the passes of one unit laid out in
time, repeated every 6 slots (each rank runs 2 F, 2 B and 2 W per unit, one slot each when
F=B=W). A rank's activation memory is about (lifespan of a unit on it) / 6 units, so the block's
shape sets the memory:

* the forwards go down the V one slot apart and back up ``climb`` slots apart, each op taking
  the first slot that is free modulo 6 on its rank (so the repeated blocks never collide);
* after ``turn`` extra slots at the loss (the end of the V, back on rank 0), the backwards go
  back the same way, and each W follows its B after ``w_delay`` slots.

Repeating the block and running it as soon as possible (the paper's *squeezing*) leaves bubbles
in the warm-up and the cool-down, where memory is underused; the paper *reorders* those phases.
Ours lets the list scheduler do it: each rank follows the repeated block's order and, when its
next op is not ready, fills the slot with other ready work, a new forward only under a cap.
V-Half with whole microbatches reorders as the paper does instead (:func:`half_order`): in
slots, each op of the warm-up and the cool-down moves to the earliest free slot after its inputs
that keeps its rank within the block's memory; that is never worse than the list scheduler's
fill with F = B = W, and as good as the paper's authors' generator in time, idle and memory.

V-ZB is the paper's zero-bubble V (Qi et al.'s ZB-V), built in rounds on each rank's time line
(:class:`ZeroBubbleV`): a warm-up that fills every rank to M, then one B and one F per rank and
round with the Ws in the waits, which leaves no rank idle between its first and last op.

With k slices a unit is a (microbatch, slice) pair; the backwards of a microbatch go last slice
first, so the backward half of the block moves k-1 periods later (the last slice's forward must
be done before the first backward of its microbatch).
"""

from __future__ import annotations

from collections import deque

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .list_scheduler import ListResult, RankView, list_schedule
from .request import ScheduleRequest

PERIOD = 6  # slots per repeated block on each rank: F, F, B, B, W, W
Block = dict[tuple[OpKind, int], int]  # (kind, stage) -> slot of unit 0


def v_placement(pp: int) -> Placement:
    return Placement(pp, 2 * pp, "vshape")


def building_block(pp: int, turn: int, w_delay: int, climb: tuple[int, int] = (1, 1)) -> Block:
    """Slots of one unit's passes: forwards down and up the V, ``turn`` slots at the loss, the
    backwards back down, each W ``w_delay`` slots after its B; every op takes the first slot at
    or after that which no other op of its rank uses modulo :data:`PERIOD`. The passes that climb
    the V from the turn at rank p-1 on take ``climb`` = (forward, backward) slots per hop (the up
    leg's forwards, the down leg's backwards): 1 is the tightest block, 2 doubles the lifespan
    that climb adds to every unit."""
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
        hop = 1 if stage < pp else climb[0]
        put(OpKind.F, stage, 0 if stage == 0 else block[(OpKind.F, stage - 1)] + hop)
    for stage in reversed(range(2 * pp)):
        hop = 1 if stage >= pp else climb[1]
        after = block[(OpKind.F, last)] + 1 + turn if stage == last else block[(OpKind.B, stage + 1)] + hop
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


def _first(ready: list[Op], kind: OpKind) -> Op | None:
    """The first ready op of ``kind`` (ready ops come in the list scheduler's order)."""
    return next((op for op in ready if op.kind == kind), None)


class FollowBlock:
    """Follow the repeated block. When the next planned op is not ready, the slot takes a ready B,
    else a ready F (the up leg's first) while the rank holds fewer than ``cap`` stage-units from F
    to W, else a W; a ready B overtakes a planned W only under that cap too, so what a fill adds
    is bounded whether B frees part of an activation or not. With ``drain`` (the number of units),
    a rank that has run all its forwards lets every ready B overtake its planned Ws: its memory
    can only fall from there, and the Ws fill the cool-down's holes instead."""

    def __init__(
        self, plan: list[list[Op]], pp: int, cap: float, drain: int | None = None, strict: bool = True
    ) -> None:
        self.plan = plan
        self.pp = pp
        self.cap = cap
        self.drain = drain
        self.strict = strict
        self.position = [0] * len(plan)
        self.index = [{op: i for i, op in enumerate(ops)} for ops in plan]
        self.done = [bytearray(len(ops)) for ops in plan]

    def _next_planned(self, rank: int) -> Op | None:
        ops, done, i = self.plan[rank], self.done[rank], self.position[rank]
        while i < len(ops) and done[i]:
            i += 1
        self.position[rank] = i
        return ops[i] if i < len(ops) else None

    def _draining(self, view: RankView) -> bool:
        return self.drain is not None and all(view.forwards_done[s] >= self.drain for s in view.stages)

    def _choose(self, view: RankView, ready: list[Op]) -> Op | None:
        if not self.strict:
            return self._choose_loose(view, ready)
        planned = self._next_planned(view.rank)
        room = view.in_flight + 1 <= self.cap + 1e-9
        backward = _first(ready, OpKind.B)
        overtakes = planned is not None and planned.kind == OpKind.W and (room or self._draining(view))
        if overtakes and backward is not None:
            return backward
        if planned in ready:
            return planned
        if backward is not None:
            return backward
        forwards = [op for op in ready if op.kind == OpKind.F]
        if room and forwards:
            return max(forwards, key=lambda op: op.stage)  # the up leg's first
        return _first(ready, OpKind.W)

    def _choose_loose(self, view: RankView, ready: list[Op]) -> Op | None:
        """The first V-Min rule: a ready B overtakes a planned W, an idle slot takes a B or an
        up-leg F, and a new down-leg F only while the memory counted with B freeing part of the
        activation (:attr:`RankView.memory`) stays under the cap."""
        planned = self._next_planned(view.rank)
        backward = _first(ready, OpKind.B)
        if planned is not None and planned.kind == OpKind.W and backward is not None:
            return backward
        if planned in ready:
            return planned
        for op in ready:
            if op.kind == OpKind.B or (op.kind == OpKind.F and op.stage >= self.pp):
                return op
        if view.memory + 1 <= self.cap + 1e-9:
            forward = _first(ready, OpKind.F)
            if forward is not None:
                return forward
        return _first(ready, OpKind.W)

    def __call__(self, view: RankView, ready: list[Op]) -> Op | None:
        choice = self._choose(view, ready)
        if choice is not None:
            self.done[view.rank][self.index[view.rank][choice]] = 1
        return choice


def v_shape(
    request: ScheduleRequest,
    name: str,
    turn: int,
    w_delay: int,
    cap_units: float,
    climb: tuple[int, int] = (1, 1),
    drain: bool = False,
    strict: bool = True,
) -> ListResult:
    """The common V-shape generator; ``cap_units`` is per slice-free stage-unit (scaled by k)."""
    pp, slices = request.pp, request.slices
    block = building_block(pp, turn, w_delay, climb)
    plan = repeat_block(block, pp, request.microbatches, slices)
    cap = cap_units * slices
    meta = {"turn": turn, "w_delay": w_delay, "climb": list(climb), "fill_cap_units": cap}
    units_per_stage = request.microbatches * slices
    return list_schedule(
        request.name or name,
        v_placement(pp),
        request.microbatches,
        slices,
        FollowBlock(plan, pp, cap, units_per_stage if drain else None, strict),
        costs=request.costs,
        meta=meta,
    )


def _peaks(result: ListResult) -> tuple[int, int]:
    return max(result.peak_activations), max(result.peak_in_flight)


def v_min(request: ScheduleRequest) -> Schedule:
    """The shortest lifespan the V allows: forwards straight down and up, backwards straight
    back, W right after B. About M/3 at rank 0, bubble about 2/3 of 1F1B's. Whole microbatches
    already fill M/3, so no extra warm-up forwards; sliced units hold far less, so the warm-up
    fills up to M/3 (2p/3 stage-units). When 3 divides p the tight block collides with itself
    modulo 6; starting the Ws half a period later untangles it.

    The reorder the paper's generator makes when 3 divides p is tried too: Ws two slots after
    their B, and extra down-leg forwards in the warm-up while a rank holds fewer than half the
    (p+4)//3 microbatches V-Min allows (counted from F to W, so in every accounting). It is kept
    only when it is shorter at no more memory, counted with B freeing the activation or not (two
    slots shorter whenever 3 divides p)."""
    pp, slices = request.pp, request.slices
    cap = 0.0 if slices == 1 else 2 * pp / 3
    tight = v_shape(request, "v-min", 0, 3 if pp % 3 == 0 else 0, cap, strict=False)
    filled = v_shape(request, "v-min", 0, 2, (pp + 4) // 3)
    faster = filled.makespan < tight.makespan - 1e-9
    no_more_memory = all(a <= b for a, b in zip(_peaks(filled), _peaks(tight)))
    return (filled if faster and no_more_memory else tight).schedule


def v_half_blocks(pp: int) -> list[tuple[tuple[int, int], int, int, int]]:
    """(climb, turn, w_delay, fill cap) of our list-scheduled V-Half blocks: forwards climbing the V
    two slots per hop (backwards one) with a turn of two slots or one; or the tight block with a
    turn of p-1 slots at the loss, W right after B or a slot later; each with a fill cap of p/2 + 1
    and of 3p/4 stage-units."""
    blocks = [((2, 1), 2, 0), ((2, 1), 1, 0), ((1, 1), max(0, pp - 1), 0), ((1, 1), max(0, pp - 1), 1)]
    caps = sorted({pp // 2 + 1, (3 * pp) // 4})
    return [(climb, turn, w_delay, cap) for climb, turn, w_delay in blocks for cap in caps]


# ---- V-Half: the paper's block, repeated, its ends reordered ----------------------------------

F_DOWN, F_UP, B_UP, B_DOWN, W_ANY = range(5)
"""The lanes of one rank in the V-Half construction, in the order ties go: the forwards down and
up the V, the backwards of the up leg (first: the loss is on rank 0) and of the down leg, the Ws.
A W only needs some B before it and frees one stage-unit, so the construction counts Ws; each
runs its rank's oldest pending W, as the list scheduler does."""
HOLDS = (1, 1, 0, 0, -1)  # stage-units held from F to W that an op of each lane adds
Lanes = list[list[int]]  # one rank: per lane, the slot of each microbatch


def half_block(pp: int) -> list[tuple[int, int, int, int]]:
    """Microbatch 0's slots on each rank (F down, F up, B up, B down): the paper's V-Half block.
    The forwards go down the V two slots per hop and back up one, the backwards go back along the
    up leg two slots per hop and up the down leg one, so a unit stays about half as long as V-ZB
    keeps it; with p even the loss waits 3 slots more, so that the block repeated every 6 slots
    never meets itself."""
    wait = 3 if pp % 2 == 0 else 0
    return [(2 * r, 3 * pp - 2 - r, 3 * pp - 1 + wait + 2 * r, 6 * pp - 2 + wait - r) for r in range(pp)]


def _ops(ranks: list[Lanes]) -> list[tuple[int, int, int, int]]:
    """(slot, rank, lane, microbatch) of every op, in time order."""
    return sorted(
        (slot, rank, lane, mb)
        for rank, lanes in enumerate(ranks)
        for lane, slots in enumerate(lanes)
        for mb, slot in enumerate(slots)
    )


def _inputs(ranks: list[Lanes], rank: int, lane: int, mb: int) -> list[int]:
    """Slots of what an F or B waits for: its lane's previous microbatch and the pass one stage
    back along the V (for a B, its own F too)."""
    pp, lanes = len(ranks), ranks[rank]
    slots = [lanes[lane][mb - 1]] if mb else []
    if lane == F_DOWN and rank > 0:
        slots.append(ranks[rank - 1][F_DOWN][mb])
    elif lane == F_UP:
        slots.append(lanes[F_DOWN][mb] if rank == pp - 1 else ranks[rank + 1][F_UP][mb])
    elif lane == B_UP:
        slots += [lanes[F_UP][mb]] + ([ranks[rank - 1][B_UP][mb]] if rank > 0 else [])
    elif lane == B_DOWN:
        slots += [lanes[F_DOWN][mb], lanes[B_UP][mb] if rank == pp - 1 else ranks[rank + 1][B_DOWN][mb]]
    return slots


def _peak(lanes: Lanes) -> int:
    """The most stage-units the rank holds from F to W, slot by slot. Without a W lane, each free
    slot runs a W if a B has left one: where the Ws will go."""
    lane_at = {slot: lane for lane, slots in enumerate(lanes) for slot in slots}
    held = peak = pending = 0
    for slot in range(max(lane_at) + 1):
        lane = lane_at.get(slot)
        if lane is not None:
            held += HOLDS[lane]
            pending += lane in (B_UP, B_DOWN)
        elif pending and len(lanes) == W_ANY:
            held, pending = held - 1, pending - 1
        peak = max(peak, held)
    return peak


def _w_slots(lanes: Lanes) -> list[int]:
    """Each W in the first free slot once a B has left one; the rest one a slot after the last."""
    lane_at = {slot: lane for lane, slots in enumerate(lanes[:W_ANY]) for slot in slots}
    last, slot, pending = max(lane_at), 0, 0
    ws: list[int] = []
    while slot <= last or pending:
        lane = lane_at.get(slot)
        if lane is None and pending:
            ws.append(slot)
            pending -= 1
        elif lane in (B_UP, B_DOWN):
            pending += 1
        slot += 1
    return ws


def _squeeze(ranks: list[Lanes]) -> list[Lanes]:
    """Every op as early as its inputs and its rank allow, one slot each, in the order of the
    slots: the paper's squeezing."""
    start = [[[0] * len(slots) for slots in lanes] for lanes in ranks]
    free = [0] * len(ranks)
    for _, rank, lane, mb in _ops(ranks):
        at = free[rank]
        if lane != W_ANY:
            at = max([at, *(slot + 1 for slot in _inputs(start, rank, lane, mb))])
        start[rank][lane][mb] = at
        free[rank] = at + 1
    return start


def _reorder(ranks: list[Lanes], warm_up: bool) -> None:
    """The paper's reorder: in time order, each op of the cool-down (and of the warm-up with
    ``warm_up``) moves to the earliest slot after its inputs that no op seen before takes and where
    its rank holds no more than the fullest rank of the repeated block. The warm-up ends at rank 0's
    first down-leg B (the last B of microbatch 0), the cool-down starts after the last
    microbatch's first forward; the steady state between keeps the block's slots."""
    cap = max(_peak(lanes) for lanes in ranks)
    last = len(ranks[0][F_DOWN]) - 1
    taken: list[set[int]] = [set() for _ in ranks]
    phase = "warm-up"
    for slot, rank, lane, mb in _ops(ranks):
        if phase == "warm-up" and lane == B_DOWN and rank == 0:
            phase = "steady"
        if phase == "steady" and lane == F_DOWN and mb == last:
            phase = "cool-down"
            taken[rank].add(slot)
            continue
        if phase == "steady" or (phase == "warm-up" and not warm_up):
            taken[rank].add(slot)
            continue
        lanes = ranks[rank]
        if lane == W_ANY:  # after the rank's mb-th B
            inputs = [sorted(lanes[B_UP] + lanes[B_DOWN])[mb]] + ([lanes[W_ANY][mb - 1]] if mb else [])
        else:
            inputs = _inputs(ranks, rank, lane, mb)
        for earlier in range(max(inputs, default=-1) + 1, slot):
            if earlier in taken[rank]:
                continue
            lanes[lane][mb] = earlier
            if _peak(lanes) <= cap:
                break
        else:
            lanes[lane][mb] = slot
        taken[rank].add(lanes[lane][mb])


def half_order(pp: int, microbatches: int) -> list[list[Op]]:
    """Each rank's ops in the paper's V-Half order: its block repeated every 6 slots, the Ws in the
    free slots, the warm-up and the cool-down reordered and everything squeezed; then the
    cool-down reordered once more with the Ws left to whatever slots are free, squeezed, and the
    Ws put in the free slots (each the rank's oldest pending one)."""
    ranks = [
        [[slot + PERIOD * mb for mb in range(microbatches)] for slot in block] for block in half_block(pp)
    ]
    for lanes in ranks:
        lanes.append(_w_slots(lanes))
    _reorder(ranks, warm_up=True)
    ranks = [lanes[:W_ANY] for lanes in _squeeze(ranks)]
    _reorder(ranks, warm_up=False)
    ranks = [lanes[:W_ANY] for lanes in _squeeze([lanes + [_w_slots(lanes)] for lanes in ranks])]
    plan: list[list[Op]] = []
    for rank, lanes in enumerate(ranks):
        stage = {F_DOWN: rank, F_UP: 2 * pp - 1 - rank, B_UP: 2 * pp - 1 - rank, B_DOWN: rank}
        timed = [
            (slot, Op(OpKind.F if lane in (F_DOWN, F_UP) else OpKind.B, stage[lane], mb))
            for lane, slots in enumerate(lanes)
            for mb, slot in enumerate(slots)
        ]
        backwards = [op for _, op in sorted(timed, key=lambda item: item[0]) if op.kind == OpKind.B]
        timed += [(slot, Op(OpKind.W, b.stage, b.microbatch)) for slot, b in zip(_w_slots(lanes), backwards)]
        plan.append([op for _, op in sorted(timed, key=lambda item: item[0])])
    return plan


class FollowOrder:
    """Run each rank's ops in the given order, waiting whenever the next one is not ready."""

    def __init__(self, plan: list[list[Op]]) -> None:
        self.plan = plan
        self.position = [0] * len(plan)

    def __call__(self, view: RankView, ready: list[Op]) -> Op | None:
        planned = self.plan[view.rank][self.position[view.rank]]
        if planned not in ready:
            return None
        self.position[view.rank] += 1
        return planned


def _figures(result: ListResult) -> tuple[float, ...]:
    """Makespan, idle in the ranks' spans, and the peak counted until B, half until W, until W."""
    return (
        result.makespan,
        sum(result.span_idle),
        max(result.peak_activations),
        max(result.peak_units),
        max(result.peak_in_flight),
    )


def v_half(request: ScheduleRequest) -> Schedule:
    """The paper's V-Half (:func:`half_order`): a unit lives about half as long as in V-ZB and each
    W fills the first free slot after its B, so a rank holds about M/2 however B's memory is
    counted: at most (p+2)/2 microbatches' worth, p+2 stage-units from F to W.

    Our list-scheduled blocks (:func:`v_half_blocks`, the first V-Half) are tried too, and one is
    kept only when it is no worse than the paper's in makespan, idle and every peak and better in
    one of the first two: that can happen with the costs the planner gives, never with F = B = W
    for p = 2..16. With k slices the paper's order does not apply (a unit is a slice, and a
    microbatch's backwards go last slice first): the shortest of our blocks within the bound,
    then the one that idles least."""
    pp, slices = request.pp, request.slices
    bound = (pp + 2) * slices
    candidates = [
        v_shape(request, "v-half", turn, w_delay, cap_units, climb=climb, drain=True)
        for climb, turn, w_delay, cap_units in v_half_blocks(pp)
    ]
    # our first V-Half (W a period after B, the fill counted with B freeing half): within the
    # bound only when slices make the units small
    candidates.append(v_shape(request, "v-half", max(0, pp - 1), 6, pp // 2 + 1, strict=False))
    if slices > 1:
        return min(
            candidates,
            key=lambda result: (max(result.peak_in_flight) > bound, result.makespan, sum(result.span_idle)),
        ).schedule
    paper = list_schedule(
        request.name or "v-half",
        v_placement(pp),
        request.microbatches,
        1,
        FollowOrder(half_order(pp, request.microbatches)),
        costs=request.costs,
        meta={"construction": "paper"},
    )
    reference = _figures(paper)
    better = [
        result
        for result in candidates
        if all(a <= b + 1e-9 for a, b in zip(_figures(result), reference))
        and _figures(result)[:2] < reference[:2]
    ]
    return min(better or [paper], key=lambda result: _figures(result)[:2]).schedule


# ---- V-ZB: zero bubble at M, built in rounds ---------------------------------------------------

DOWN, UP = 0, 1  # the two chunks of a rank: stage r going down the V, stage 2p-1-r coming back up
_KINDS = {"F": OpKind.F, "B": OpKind.B}


class _VRank:
    """One rank as the rounds fill it: its ops in order, the time it is free, what it holds."""

    def __init__(self, rank: int, pp: int) -> None:
        self.stage = (rank, 2 * pp - 1 - rank)
        self.ops: list[Op] = []
        self.free_at = 0.0
        self.idle = 0.0  # time spent waiting since its first op: the in-span bubble
        self.in_flight = 0  # stage-units whose F has run and whose W has not
        self.done = {(kind, chunk): 0 for kind in _KINDS for chunk in (DOWN, UP)}
        self.pending_w: deque[Op] = deque()


class ZeroBubbleV:
    """Qi et al.'s ZB-V as a greedy in rounds, on each rank's time line as the simulator replays it.

    The memory bound is what makes it V-ZB: every rank holds at most ``limit`` stage-units from F
    to W (2p, i.e. M), so the peak stays at M whether B frees part of an activation or not.

    1. Warm-up, down the V: each rank forwards the first unit; then, from the bottom rank up, a
       rank and all above it forward one more unit each as long as that does not delay the rank's
       first up-leg forward and leaves it room for the up-leg units to come; then, from the top
       down, every rank forwards (alternating legs) until it holds as many as the rank above it:
       at the end every rank is full.
    2. Rounds: each rank runs one B (the up leg's, whose B comes first, until it has one more of
       those than of the down leg's, and then the down leg's if its input is already known), then
       one F (the up leg's when its input is known, else a new unit down the V). A W runs first when
       the rank is full, and a W fills any wait for an input long enough to hold it.
       ``fill_b``/``fill_f`` also let a W go before a down-leg B / an F whenever the wait is longer
       than the worst bubble of any rank so far, so no rank idles more than it must.
    3. The remaining W.

    Within a round the down leg's Bs go from the bottom rank up and the up leg's from rank 0 down,
    the way their inputs flow, so a B's input is placed before it whenever it can be. Times are
    those the simulator will replay (an op starts when its rank is free and its input has arrived).
    """

    def __init__(
        self, request: ScheduleRequest, limit: int, fill_b: bool = True, fill_f: bool = True
    ) -> None:
        self.pp = request.pp
        self.limit = limit
        self.fill_b, self.fill_f = fill_b, fill_f
        costs = request.costs
        self.duration = {"F": costs.forward, "B": costs.backward, "W": costs.weight}
        self.comm = costs.comm
        self.forward_units = units(request.microbatches, request.slices)
        self.backward_units = backward_units(request.microbatches, request.slices)
        forward_index = {unit: i for i, unit in enumerate(self.forward_units)}
        self.forward_of_backward = [forward_index[unit] for unit in self.backward_units]
        self.count = len(self.forward_units)
        self.ranks = [_VRank(rank, self.pp) for rank in range(self.pp)]
        self.end: dict[tuple[str, int, int], float] = {}  # (kind, stage, index) -> end time

    # ---- what an op waits for -----------------------------------------------------------

    def _left(self, rank: int, kind: str, chunk: int) -> bool:
        return self.ranks[rank].done[(kind, chunk)] < self.count

    def _input(self, rank: int, kind: str, chunk: int) -> tuple[str, int, int] | None:
        """The (kind, stage, index) whose end the next such op waits for; None for stage 0's F."""
        index = self.ranks[rank].done[(kind, chunk)]
        stage = self.ranks[rank].stage[chunk]
        if kind == "F":
            return None if stage == 0 else ("F", stage - 1, index)
        if stage == 2 * self.pp - 1:
            return ("F", stage, self.forward_of_backward[index])
        return ("B", stage + 1, index)

    def _known(self, rank: int, kind: str, chunk: int) -> bool:
        """The next such op exists and its input is placed: its start time is known."""
        if not self._left(rank, kind, chunk):
            return False
        source = self._input(rank, kind, chunk)
        return source is None or source in self.end

    def _ready_at(self, rank: int, kind: str, chunk: int) -> float:
        """When the next such op's input is usable on ``rank`` (a message costs ``comm``)."""
        source = self._input(rank, kind, chunk)
        if source is None:
            return 0.0
        same_rank = source[1] in self.ranks[rank].stage
        return self.end[source] + (0.0 if same_rank else self.comm)

    # ---- placing ops ----------------------------------------------------------------------

    def _run(self, rank: int, start: float, op: Op, duration: float) -> None:
        state = self.ranks[rank]
        if state.ops:
            state.idle += start - state.free_at
        state.free_at = start + duration
        state.ops.append(op)

    def put(self, rank: int, kind: str, chunk: int) -> None:
        state = self.ranks[rank]
        index = state.done[(kind, chunk)]
        stage = state.stage[chunk]
        mb, j = (self.forward_units if kind == "F" else self.backward_units)[index]
        start = max(state.free_at, self._ready_at(rank, kind, chunk))
        self._run(rank, start, Op(_KINDS[kind], stage, mb, j), self.duration[kind])
        self.end[(kind, stage, index)] = state.free_at
        state.done[(kind, chunk)] += 1
        if kind == "F":
            state.in_flight += 1
        else:
            state.pending_w.append(Op(OpKind.W, stage, mb, j))

    def put_w(self, rank: int) -> None:
        state = self.ranks[rank]
        self._run(rank, state.free_at, state.pending_w.popleft(), self.duration["W"])
        state.in_flight -= 1

    def _has_room(self, rank: int) -> bool:
        return self.ranks[rank].in_flight + 1 <= self.limit

    def _fill_wait(self, rank: int, kind: str, chunk: int, beyond_worst: bool) -> None:
        """Ws into the wait for the next op's input; with ``beyond_worst`` one more W if the rest
        of the wait is still longer than the worst bubble of any rank exceeds this rank's."""
        state = self.ranks[rank]
        ready = self._ready_at(rank, kind, chunk)
        while state.pending_w and ready >= state.free_at + self.duration["W"]:
            self.put_w(rank)
        worst = max(other.idle for other in self.ranks)
        if beyond_worst and state.pending_w and ready - state.free_at > worst - state.idle:
            self.put_w(rank)

    # ---- the three phases -----------------------------------------------------------------

    def warm_up(self) -> None:
        pp = self.pp
        for rank in range(pp):
            if self._has_room(rank) and self._left(rank, "F", DOWN):
                self.put(rank, "F", DOWN)
        for rank in reversed(range(pp)):
            if not self._known(rank, "F", UP) or not self._has_room(rank):
                continue
            first_up = self._ready_at(rank, "F", UP)
            state = self.ranks[rank]
            while (
                state.in_flight + 2 * (rank + 1) <= self.limit
                and state.free_at + self.duration["F"] <= first_up
                and all(self._left(above, "F", DOWN) and self._has_room(above) for above in range(rank + 1))
            ):
                for above in range(rank + 1):
                    self.put(above, "F", DOWN)
            self.put(rank, "F", UP)
        chunk = DOWN
        for rank in range(1, pp):
            above, this = self.ranks[rank - 1].done, self.ranks[rank].done
            while (
                this[("F", DOWN)] + this[("F", UP)] < above[("F", DOWN)] + above[("F", UP)]
                or this[("F", UP)] <= above[("F", UP)] < self.count
            ):
                placed = False
                for lower in range(pp - 1, rank - 1, -1):
                    if self._known(lower, "F", chunk) and self._has_room(lower):
                        self.put(lower, "F", chunk)
                        placed = True
                chunk = 1 - chunk
                if not placed and not any(
                    self._known(lower, "F", chunk) and self._has_room(lower) for lower in range(rank, pp)
                ):
                    break

    def _backward_chunk(self, rank: int) -> int:
        done = self.ranks[rank].done
        if done[("B", DOWN)] >= done[("B", UP)] and self._left(rank, "B", UP):
            return UP
        if self._known(rank, "B", DOWN) or not self._left(rank, "B", UP):
            return DOWN
        return UP

    def _forward_chunk(self, rank: int) -> int:
        done = self.ranks[rank].done
        if done[("F", UP)] < done[("F", DOWN)] and self._known(rank, "F", UP):
            return UP
        return DOWN

    def rounds(self) -> None:
        pp = self.pp
        while any(self._left(rank, "B", chunk) for rank in range(pp) for chunk in (DOWN, UP)):
            placed = 0
            chunks = [self._backward_chunk(rank) for rank in range(pp)]
            order = [r for r in reversed(range(pp)) if chunks[r] == DOWN]
            order += [r for r in range(pp) if chunks[r] == UP]
            for rank in order:
                chunk = chunks[rank]
                if not self._known(rank, "B", chunk):
                    continue
                self._fill_wait(rank, "B", chunk, beyond_worst=chunk == UP or self.fill_b)
                self.put(rank, "B", chunk)
                placed += 1
            for rank in range(pp):
                chunk = self._forward_chunk(rank)
                if not self._known(rank, "F", chunk):
                    continue
                state = self.ranks[rank]
                while not self._has_room(rank) and state.pending_w:
                    self.put_w(rank)
                if not self._has_room(rank):
                    continue
                self._fill_wait(rank, "F", chunk, beyond_worst=self.fill_f)
                self.put(rank, "F", chunk)
                placed += 1
            if not placed:
                raise RuntimeError("V-ZB rounds are stuck: no rank can run a backward or a forward")
        for rank, state in enumerate(self.ranks):
            while state.pending_w:
                self.put_w(rank)

    def build(self) -> list[list[Op]]:
        """Run the three phases; each rank's ops in order."""
        self.warm_up()
        self.rounds()
        return [state.ops for state in self.ranks]

    @property
    def worst_bubble(self) -> float:
        return max(state.idle for state in self.ranks)

    @property
    def makespan(self) -> float:
        return max(state.free_at for state in self.ranks)


def v_zb(request: ScheduleRequest) -> Schedule:
    """Zero bubble at 1F1B's memory: every rank holds at most 2p stage-units (M) from F to W, and
    the rounds of :class:`ZeroBubbleV` keep every rank busy from its first op to its last. Like the
    paper's generator it tries letting a W into a wait before a down-leg B and before an F or not,
    and keeps the order whose worst rank idles least (then the shortest). With k slices our first
    V-ZB (a repeated block with a turn of 4p-7 slots and extra warm-up forwards) is a candidate too,
    kept when it stays under the same bound and idles less."""
    pp, slices = request.pp, request.slices
    limit = 2 * pp * slices
    best: tuple[tuple[bool, float, float], Schedule] | None = None
    for fill_b in (True, False):
        for fill_f in (True, False):
            builder = ZeroBubbleV(request, limit, fill_b, fill_f)
            ranks = builder.build()
            key = (False, *_rounded(builder.worst_bubble, builder.makespan))
            if best is None or key < best[0]:
                schedule = Schedule(
                    name=request.name or "v-zb",
                    pp=pp,
                    microbatches=request.microbatches,
                    num_stages=2 * pp,
                    slices=slices,
                    placement=v_placement(pp),
                    ranks=ranks,
                    meta={"memory_limit_units": limit, "fill_b": fill_b, "fill_f": fill_f},
                )
                best = (key, schedule)
    if slices > 1:
        block = v_shape(request, "v-zb", max(0, 4 * pp - 7), 3, max(3, 2 * pp - 3), strict=False)
        key = (max(block.peak_in_flight) > limit, *_rounded(max(block.span_idle), block.makespan))
        if best is None or key < best[0]:
            best = (key, block.schedule)
    assert best is not None
    return best[1]


def _rounded(idle: float, makespan: float) -> tuple[float, float]:
    return round(idle, 9), round(makespan, 9)
