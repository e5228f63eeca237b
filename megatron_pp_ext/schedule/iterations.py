"""Several iterations back to back, with the optimizer step between them: the iteration-boundary
bubble, with a synchronous optimizer and with Zero Bubble's optimizer post-validation.

A schedule is bubble-free (or not) inside one iteration; what happens between two iterations is
decided by the optimizer step, which needs the global gradient norm and NaN/inf state:

``sync``
    Every rank issues the all-reduce of its gradient state when its last op of the iteration is
    done; the all-reduce completes ``reduce_time`` after the LAST rank issued it (``reduced``);
    then every rank steps (``optimizer_time``) and starts its next iteration. All ranks restart
    together, so the pipeline's fill (and drain) repeats at every boundary.
``post-validation``
    Zero Bubble, section 4, as ``train --pp-post-validation`` runs it (``megatron/post_validation.py``):
    every rank issues the global all-reduce when its iteration ends (complete at ``reduced``, as
    in ``sync``); the partial state travels along a chain of ranks; a rank receives the partial
    state of the ranks before it in the chain (one p2p hop, ``hop_time``, after its predecessor
    had it), adds its own once its last op is done, passes it on and steps at once. Its next
    iteration starts right after its own step, up to its *validation gate*
    (``schedule/gate.py``: its first op that is not a forward, moved earlier to a consistent
    cut): the op there cannot start before the previous iteration's ``reduced``, when the
    global check arrives. Steps with activation copies, vocabulary ops or attention
    redistribution take the gate at position 0, before any op, as the runtime does. A failed
    check (a rollback and a restart of the iteration) is modelled as not happening.

    The chain's direction matters. ``auto`` (default) takes the ranks in the order their first
    iteration ends (ties: higher rank first): :func:`completion_order`, the chain the runtime
    passes the partial state along. Under ZB-H2 and V-ZB that is rank 0 to p-1 (``up``, the
    paper's direction), under 1F1B and ZB-H1 p-1 to 0 (``down``); the fixed directions are kept
    for comparison (``down`` under ZB-H2 makes rank 0 wait for rank p-1: nothing is gained).
``post-validation-wait``
    A comparison, not what ``train`` does: the optimistic step as above, but the step returns
    only after the global all-reduce completed, i.e. every rank's next iteration starts no
    earlier than ``reduced`` (as in ``sync``; the same as a gate at position 0). Only the step
    itself overlaps the wait; the barrier stays.

How the timeline is built (exact for ``simulate.py``'s semantics, which is left untouched): the
ops of one iteration depend on the previous iteration only through each rank's order, i.e. a
rank's first op of iteration i+1 cannot start before the rank's optimizer step of iteration i
ended, and (post-validation) its op at the gate not before ``reduced`` of iteration i. So
iteration i+1 is the single-iteration replay with each rank's clock starting at that time
instead of 0, and held at the gate: :func:`simulate`'s ``holds`` (the earliest start of the op
at a rank's position). Copies and collectives of the iteration happen after the rank's start, so their
streams and channels need no carry-over either. A rank's iteration ends at its last compute op,
copy or collective, or at its gate when nothing follows that.

Figures: ``period`` is the steady-state time per iteration (between the ends of the first and the
last iteration's steps, over N-1; the makespan for N=1). The bubble rate is each rank's idle share
of a period (busy = its compute per iteration plus its step), averaged over ranks.

Why the gate does not bind when ``reduce_time`` is 0: ``reduced`` is then the end of the rank
that finishes last, q. A gate at the rank's first backward-side op (B, W, BW or the RECV_B before
them) waits for a backward, which needs its microbatch's forward through every stage, rank q's
included; a gate the consistent cut moved to a RECV_F waits for a message its sender sends after
its own gate. Rank q runs nothing of iteration i+1 before its own step of iteration i ended, at
or after ``reduced``. So every gate op starts after ``reduced`` anyway, whatever the schedule and
the step time: with unit costs ZB-H2 and V-ZB keep 3m per iteration. A ``reduce_time`` above the
slack of the earliest gate op (under ZB-H2 rank p-1's first B, one F after its start: 1) delays
it, and the period grows by the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .completion import FREE
from .costs import CostModel, UniformCosts
from .gate import gate_at_start, validation_gate
from .ir import Schedule
from .lowering import lower
from .simulate import SimResult, simulate

OPTIMIZERS = ("sync", "post-validation", "post-validation-wait")


def gate_positions(schedule: Schedule, at_start: bool | None = None) -> list[int]:
    """Each rank's validation gate in ``lower(schedule)``, as the runtime places it: 0 for all
    when ``at_start``, by default when the runtime takes the gate before any op
    (:func:`gate.gate_at_start`; SlimPipe's attention redistribution is seen through the meta
    ``simulate --pp-attn-redistribution`` sets)."""
    lowered = lower(schedule)
    if at_start is None:
        at_start = gate_at_start(lowered, bool(schedule.meta.get("attn_redistribution")))
    if at_start:
        return [0] * lowered.pp
    return validation_gate(lowered).positions


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
    gate_positions: list[int] = field(default_factory=list)  # post-validation: in lower(schedule)
    gates: list[list[float]] = field(default_factory=list)  # [iteration][rank] -> when the gate opens

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


def _rank_ends(
    result: SimResult, start: Sequence[float], gates: Sequence[float] | None = None
) -> list[float]:
    """When each rank's iteration is done: its last compute op, copy or collective, or its start
    or gate when nothing runs after them (a rank stands at its gate even when no op follows)."""
    ends = list(start) if gates is None else [max(s, g) for s, g in zip(start, gates)]
    for event in [*result.events, *result.copies, *result.collectives]:
        ends[event.rank] = max(ends[event.rank], event.end)
    return ends


def chain_order(ends: Sequence[float], chain: str | Sequence[int]) -> list[int]:
    """The ranks in the order the partial state visits them: ``auto`` (by when each rank's
    iteration ends, ties: higher rank first; the runtime's, see :func:`completion_order`),
    ``down`` (p-1 to 0), ``up`` (0 to p-1, the paper's) or a list."""
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
    gate_at_start: bool | None = None,
    completion: str = FREE,
) -> IterationsResult:
    """Replay ``iterations`` iterations of ``schedule`` back to back with ``optimizer``'s step
    between them. ``hop_time`` (one p2p hop of the partial state) defaults to the cost model's
    p2p latency when it has one (``comm``), else 0. ``chain``: see :func:`chain_order`; ``auto``
    is fixed from the first iteration, as the runtime fixes it. ``gate_at_start``
    (post-validation): every gate at position 0; default as the runtime decides
    (:func:`gate_positions`). ``completion``: when messages complete (``completion.py``)."""
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
    positions = gate_positions(schedule, gate_at_start) if optimizer == "post-validation" else None
    start = [0.0] * schedule.pp
    gate = [0.0] * schedule.pp  # iteration 1 has no previous step to wait for
    runs: list[SimResult] = []
    steps: list[list[tuple[float, float]]] = []
    starts: list[list[float]] = []
    gates: list[list[float]] = []
    order: list[int] | None = None
    for _ in range(iterations):
        holds = {(rank, 0): time for rank, time in enumerate(start)}
        if positions is not None:  # the op at the gate waits for the previous global check too
            for rank, (at, time) in enumerate(zip(positions, gate)):
                holds[(rank, at)] = max(time, holds.get((rank, at), 0.0))
        result = simulate(schedule, costs, holds, completion)
        ends = _rank_ends(result, start, gate if positions is not None else None)
        order = order or chain_order(ends, chain)
        step, next_start = optimizer_steps(ends, optimizer, optimizer_time, reduce_time, hop_time, order)
        runs.append(result)
        steps.append(step)
        starts.append(start)
        if positions is not None:
            gates.append(gate)
            # the next iteration's gates open when this one's global all-reduce completed
            gate = [max(ends) + reduce_time] * schedule.pp
        start = next_start
    return IterationsResult(
        optimizer, runs, steps, optimizer_time, starts, order or [], positions or [], gates
    )


def completion_order(schedule: Schedule, costs: CostModel | None = None) -> list[int]:
    """The pipeline ranks in the order their part of one iteration ends (ties: higher rank
    first), by the simulator with ``costs`` (default: unit costs): the chain ``train`` passes
    the partial gradient state along (``megatron/post_validation.py``)."""
    return simulate_iterations(schedule, costs, iterations=1, optimizer="post-validation").chain


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
