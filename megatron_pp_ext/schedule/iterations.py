"""Several iterations back to back, with the optimizer step between them: the iteration-boundary
bubble, with a synchronous optimizer and with Zero Bubble's optimizer post-validation.

A schedule is bubble-free (or not) inside one iteration; what happens between two iterations is
decided by the optimizer step, which needs the global gradient norm and NaN/inf state:

``sync``
    Every rank issues the all-reduce of its gradient state when its last op of the iteration is
    done; the all-reduce completes ``reduce_time`` after the LAST rank issued it; then every rank
    steps (``optimizer_time``) and starts its next iteration. All ranks restart together, so the
    pipeline's fill (and drain) repeats at every boundary.
``post-validation``
    Zero Bubble, section 4, the partial reduction as ``megatron/post_validation.py`` does it: the
    partial state travels along a chain of ranks; a rank receives the partial state of the ranks
    before it in the chain (one p2p hop, ``hop_time``, after its predecessor had it), adds its own
    once its last op is done, passes it on and steps at once. Its next iteration starts right
    after its own step; the global check completes in the background and only rolls back on
    failure, modelled as not happening.

    The chain's direction matters. ``down`` (rank p-1 to rank 0) is what the runtime does today;
    it suits 1F1B, whose last rank finishes first. Under ZB-H2 rank 0 finishes first and rank p-1
    last, so ``down`` makes rank 0 wait for rank p-1 and nothing is gained; ``up`` (rank 0 to
    p-1) is the paper's direction. ``auto`` (default) takes the ranks in the order their first
    iteration ends (ties: ``down``'s order), a static order a runtime could read from the schedule.
``post-validation-wait``
    What ``MainGradOptimizer._validated_step`` does today: the optimistic step as above, but the
    step returns only after ``pending.wait()``, i.e. the next iteration also waits for the global
    all-reduce (as in ``sync``). Only the step itself overlaps the wait; the barrier stays.

How the timeline is built (exact for ``simulate.py``'s semantics, which is left untouched): the
ops of one iteration depend on the previous iteration only through each rank's order, i.e. a
rank's first op of iteration i+1 cannot start before the rank's optimizer step of iteration i
ended. So iteration i+1 is the single-iteration replay with each rank's clock starting at that
time instead of 0. :func:`simulate` has no start-time argument, so each rank's op list gets a
marker pair first: a SEND and its own RECV of a message no other op uses (negative microbatch id),
whose latency (a cost-model wrapper) is the rank's start time. The RECV sets the rank's clock to
the arrival, exactly like a start offset; markers are not compute, so busy time, events and memory
are unchanged. Copies and collectives of the iteration happen after the rank's start, so their
streams and channels need no carry-over either. A rank's iteration ends at its last compute op,
copy or collective.

Figures: ``period`` is the steady-state time per iteration (between the ends of the first and the
last iteration's steps, over N-1; the makespan for N=1). The bubble rate is each rank's idle share
of a period (busy = its compute per iteration plus its step), averaged over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .costs import CostModel, UniformCosts
from .ir import Op, OpKind, Schedule
from .lowering import lower
from .simulate import SimResult, simulate

OPTIMIZERS = ("sync", "post-validation", "post-validation-wait")


class _Offset:
    """``costs`` with the start markers' latency: a marker of rank r (microbatch -1-r) takes
    ``start[r]``; everything else is the wrapped model's."""

    def __init__(self, costs: CostModel, start: Sequence[float]) -> None:
        self._costs = costs
        self._start = start

    def comm_latency(self, op: Op) -> float:
        if op.microbatch < 0:
            return self._start[-1 - op.microbatch]
        return self._costs.comm_latency(op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._costs, name)


def _with_start_markers(schedule: Schedule) -> Schedule:
    """The lowered schedule with a SEND/RECV marker pair at the head of every rank (see module)."""
    lowered = lower(schedule)
    ranks = []
    for rank, ops in enumerate(lowered.ranks):
        marker = -1 - rank
        ranks.append([Op(OpKind.SEND_F, 0, marker), Op(OpKind.RECV_F, 1, marker), *ops])
    return lowered.with_ranks(ranks)


@dataclass
class IterationsResult:
    """N iterations of one schedule: each iteration's replay (absolute times), each rank's
    optimizer step per iteration, and the per-iteration figures."""

    optimizer: str
    runs: list[SimResult]
    steps: list[list[tuple[float, float]]]  # [iteration][rank] -> (start, end) of the step
    optimizer_time: float
    starts: list[list[float]] = field(default_factory=list)  # [iteration][rank] -> clock start
    chain: list[int] = field(default_factory=list)  # the partial state's order of ranks

    @property
    def iterations(self) -> int:
        return len(self.runs)

    @property
    def pp(self) -> int:
        return len(self.steps[0])

    @property
    def makespan(self) -> float:
        """End of the last iteration's last optimizer step."""
        return max(end for _, end in self.steps[-1])

    @property
    def time_per_iteration(self) -> float:
        return self.makespan / self.iterations

    @property
    def period(self) -> float:
        """Steady-state time per iteration: between the first and last iteration's ends."""
        ends = [max(end for _, end in steps) for steps in self.steps]
        if len(ends) == 1:
            return ends[0]
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    @property
    def busy_per_rank(self) -> list[float]:
        """Compute per iteration plus the optimizer step, per rank (the last iteration's)."""
        return [busy + self.optimizer_time for busy in self.runs[-1].busy_per_rank]

    @property
    def bubble_rate(self) -> float:
        """Mean idle share of a steady-state period (the boundary bubble included)."""
        period = self.period
        if period <= 0:
            return 0.0
        return sum(period - busy for busy in self.busy_per_rank) / (period * self.pp)

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "iterations": self.iterations,
            "optimizer_time": self.optimizer_time,
            "makespan": self.makespan,
            "time_per_iteration": self.time_per_iteration,
            "period": self.period,
            "bubble_rate": self.bubble_rate,
            **({"chain": self.chain} if self.optimizer != "sync" else {}),
        }


def _rank_ends(result: SimResult, start: Sequence[float]) -> list[float]:
    """When each rank's iteration is done: its last compute op, copy or collective (its start
    when it has none)."""
    ends = list(start)
    for event in [*result.events, *result.copies, *result.collectives]:
        ends[event.rank] = max(ends[event.rank], event.end)
    return ends


def chain_order(ends: Sequence[float], chain: str | Sequence[int]) -> list[int]:
    """The ranks in the order the partial state visits them: ``down`` (p-1 to 0, the runtime's),
    ``up`` (0 to p-1, the paper's), ``auto`` (by when each rank's iteration ends) or a list."""
    pp = len(ends)
    if chain == "down":
        return list(reversed(range(pp)))
    if chain == "up":
        return list(range(pp))
    if chain == "auto":
        return sorted(reversed(range(pp)), key=lambda rank: ends[rank])  # stable: ties go down
    if isinstance(chain, str) or sorted(chain) != list(range(pp)):
        raise ValueError(f"chain must be 'down', 'up', 'auto' or a permutation of the ranks, got {chain!r}")
    return list(chain)


def optimizer_steps(
    ends: Sequence[float],
    optimizer: str,
    optimizer_time: float = 0.0,
    reduce_time: float = 0.0,
    hop_time: float = 0.0,
    chain: Sequence[int] | None = None,
) -> tuple[list[tuple[float, float]], list[float]]:
    """Each rank's step (start, end) and its next iteration's start, from when each rank's
    iteration ended (see the module docstring for the three optimizers); ``chain``: the ranks in
    the partial state's order (default: p-1 down to 0)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    pp = len(ends)
    reduced = max(ends) + reduce_time  # the global all-reduce, issued by each rank at its end
    if optimizer == "sync":
        steps = [(reduced, reduced + optimizer_time)] * pp
        return steps, [reduced + optimizer_time] * pp
    partial = [0.0] * pp  # when a rank holds the partial state of itself and the ranks before it
    arrived = 0.0
    for rank in chain_order(ends, "down") if chain is None else chain:
        partial[rank] = max(ends[rank], arrived)
        arrived = partial[rank] + hop_time
    steps = [(t, t + optimizer_time) for t in partial]
    if optimizer == "post-validation":
        return steps, [end for _, end in steps]
    return steps, [max(end, reduced) for _, end in steps]


def simulate_iterations(
    schedule: Schedule,
    costs: CostModel | None = None,
    iterations: int = 3,
    optimizer: str = "sync",
    optimizer_time: float = 0.0,
    reduce_time: float = 0.0,
    hop_time: float | None = None,
    chain: str | Sequence[int] = "auto",
) -> IterationsResult:
    """Replay ``iterations`` iterations of ``schedule`` back to back with ``optimizer``'s step
    between them. ``hop_time`` (one p2p hop of the partial state) defaults to the cost model's
    p2p latency when it has one (``comm``), else 0. ``chain``: see :func:`chain_order`; ``auto``
    is fixed from the first iteration, as a runtime would fix it."""
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if costs is None:
        costs = UniformCosts(
            num_stages=schedule.num_stages, num_slices=schedule.slices, chunks_per_rank=schedule.vpp
        )
    if hop_time is None:
        hop_time = float(getattr(costs, "comm", None) or 0.0)
    marked = _with_start_markers(schedule)
    start = [0.0] * schedule.pp
    runs: list[SimResult] = []
    steps: list[list[tuple[float, float]]] = []
    starts: list[list[float]] = []
    order: list[int] | None = None
    for _ in range(iterations):
        result = simulate(marked, _Offset(costs, start))  # type: ignore[arg-type]
        result.schedule = schedule
        ends = _rank_ends(result, start)
        order = order or chain_order(ends, chain)
        step, next_start = optimizer_steps(ends, optimizer, optimizer_time, reduce_time, hop_time, order)
        runs.append(result)
        steps.append(step)
        starts.append(start)
        start = next_start
    return IterationsResult(optimizer, runs, steps, optimizer_time, starts, order or [])


def compare_optimizers(
    schedule: Schedule,
    costs: CostModel | None = None,
    iterations: int = 3,
    optimizer_time: float = 0.0,
    reduce_time: float = 0.0,
    hop_time: float | None = None,
    chain: str | Sequence[int] = "auto",
) -> dict[str, IterationsResult]:
    """The same N iterations under every optimizer, keyed by its name."""
    return {
        name: simulate_iterations(
            schedule, costs, iterations, name, optimizer_time, reduce_time, hop_time, chain
        )
        for name in OPTIMIZERS
    }
