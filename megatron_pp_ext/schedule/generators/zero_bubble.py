"""Zero Bubble pipeline schedules (Qi et al., ICLR'24): backward split into B and W.

The previous stage waits only on B, so B goes first; W (the weight gradient) can run any time
after its own B on the same rank, so it fills time that would otherwise be idle. Memory is held
from F until W (B releases the part that W does not need), so delaying W costs memory and every
schedule here bounds it.
"""

from __future__ import annotations

from ..ir import Op, OpKind, Placement, Schedule
from .list_scheduler import ListResult, Policy, RankView, list_schedule
from .one_f_one_b import one_f_one_b_order
from .request import RequestError, ScheduleRequest


class FollowOrderFillWithW:
    """Run each rank's F and B in a fixed order; a W runs only when the next F/B is not ready
    (the rank would idle) or when that F would put more than ``bound`` stage-units in flight."""

    def __init__(self, order: list[list[Op]], bound: int, weight_time: float | None = None) -> None:
        self.order = order
        self.bound = bound
        self.weight_time = weight_time  # if set, an idle-time W must end before the next input lands
        self.position = [0] * len(order)

    def __call__(self, view: RankView, ready: list[Op]) -> Op | None:
        ops, index = self.order[view.rank], self.position[view.rank]
        weights = [op for op in ready if op.kind == OpKind.W]
        if index < len(ops):
            planned = ops[index]
            held_back = planned.kind == OpKind.F and view.in_flight >= self.bound
            if planned in ready and not held_back:
                self.position[view.rank] += 1
                return planned
            if held_back:
                return weights[0] if weights else None
        if weights and self.weight_time is not None:
            if view.now + self.weight_time > view.next_arrival + 1e-9:
                return None
        return weights[0] if weights else None


class Greedy:
    """Among the ready ops take the first kind in ``prefer``; a forward waits while it would push
    the rank's memory (in stage-units, see :attr:`RankView.memory`) or its in-flight count past
    the limits."""

    def __init__(
        self,
        prefer: tuple[OpKind, ...] = (OpKind.B, OpKind.F, OpKind.W),
        max_in_flight: float = float("inf"),
        max_memory: float = float("inf"),
        w_must_fit: bool = False,
        weight_time: float = 1.0,
    ) -> None:
        self.prefer = prefer
        self.max_in_flight = max_in_flight
        self.max_memory = max_memory
        self.w_must_fit = w_must_fit
        self.weight_time = weight_time

    def __call__(self, view: RankView, ready: list[Op]) -> Op | None:
        forward_blocked = False
        for kind in self.prefer:
            for op in ready:
                if op.kind != kind:
                    continue
                if kind == OpKind.F and not self._room_for_forward(view):
                    forward_blocked = True
                    continue
                if kind == OpKind.W and self.w_must_fit and not forward_blocked:
                    if view.now + self.weight_time > view.next_arrival + 1e-9:
                        continue
                return op
        return None

    def _room_for_forward(self, view: RankView) -> bool:
        return view.in_flight + 1 <= self.max_in_flight and view.memory + 1 <= self.max_memory + 1e-9


def _placement(request: ScheduleRequest) -> Placement:
    return Placement(request.pp, request.pp, "interleaved")


def _run(request: ScheduleRequest, name: str, policy: Policy, meta: dict) -> ListResult:
    return list_schedule(
        request.name or name,
        _placement(request),
        request.microbatches,
        request.slices,
        policy,
        costs=request.costs,
        meta=meta,
    )


def zb_h1(request: ScheduleRequest) -> Schedule:
    """1F1B's order of F and B and 1F1B's peak (at most p + k - 1 stage-units in flight, what
    rank 0 holds in 1F1B); W only fills what would be idle. The cool-down holes of 1F1B fill
    with deferred W, leaving (p-1)(F+B-W) of bubble, a third of 1F1B's when F=B=W."""
    pp, slices = request.pp, request.slices
    order = one_f_one_b_order(
        pp, request.microbatches, slices, lambda rank: pp - 1 - rank + slices - 1, backward=OpKind.B
    )
    bound = pp + slices - 1
    return _run(request, "zb-h1", FollowOrderFillWithW(order, bound), {"max_in_flight": bound}).schedule


def zb_h2(request: ScheduleRequest) -> Schedule:
    """Every rank may hold up to 2p - 1 (+ k - 1) stage-units in flight, enough warm-up forwards
    to cover the round trip of the first microbatch; B first, then F, W fills the rest. The
    steady state has no bubble; peak memory is about 2M."""
    pp, slices = request.pp, request.slices
    bound = 2 * pp - 1 + slices - 1
    return _run(request, "zb-h2", Greedy(max_in_flight=bound), {"max_in_flight": bound}).schedule


def zb_auto(request: ScheduleRequest) -> Schedule:
    """Greedy list scheduling with the measured F, B, W and comm times under a memory limit
    (``request.memory_limit`` in M; None means M, the 1F1B peak): B first, F while memory allows,
    W into idle time. The limit counts a unit from its F to its W, so it holds whether B frees
    part of the activation or not (every accounting of the simulator).

    Like the paper's automatic scheduler it builds a few candidates (the 1F1B-shaped one, and
    greedy ones that fill idle time with any W or only with a W that ends before the next input
    arrives) and keeps the one with the shortest planned makespan; among equally short ones, the
    one whose ranks idle least between their first and last op (the shortest per-rank spans),
    then the lowest peak."""
    pp, slices, costs = request.pp, request.slices, request.costs
    limit_m = 1.0 if request.memory_limit is None else request.memory_limit
    limit = limit_m * pp * slices  # stage-units: one is 1/(p*k) of M
    if limit + 1e-9 < slices:
        raise RequestError(
            f"zb-auto needs room for one microbatch's {slices} slice(s) on a stage, i.e. a memory "
            f"limit of at least {1 / pp:.3g} M; got {limit_m:g}",
            flag="--memory-limit",
        )
    in_flight = int(limit + 1e-9)
    candidates: list[tuple[str, Policy]] = [
        ("greedy", Greedy(max_in_flight=in_flight)),
        ("greedy-w-fits", Greedy(max_in_flight=in_flight, w_must_fit=True, weight_time=costs.weight)),
    ]
    in_flight_1f1b = pp + slices - 1
    if in_flight_1f1b <= in_flight:
        order = one_f_one_b_order(
            pp, request.microbatches, slices, lambda rank: pp - 1 - rank + slices - 1, backward=OpKind.B
        )
        candidates.append(("1f1b-order", FollowOrderFillWithW(order, in_flight_1f1b)))
        candidates.append(
            ("1f1b-order-w-fits", FollowOrderFillWithW(order, in_flight_1f1b, weight_time=costs.weight))
        )
    best: tuple[tuple[float, float, int], ListResult] | None = None
    for label, policy in candidates:
        result = _run(request, "zb-auto", policy, {"memory_limit_m": limit_m, "policy": label})
        key = (round(result.makespan, 9), round(sum(result.span_idle), 9), max(result.peak_in_flight))
        if best is None or key < best[0]:
            best = (key, result)
    assert best is not None
    return best[1].schedule
