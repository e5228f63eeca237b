"""SlimPipe's attention workload redistribution, as a cost-model transform for the simulator.

With uniform slices, slice j of a sequence attends to (j + 1/2) c^2 query-key pairs (c tokens a
slice), so the rank working on a late slice is slower than its neighbours on early ones and they
wait for it. SlimPipe (REFERENCE sec. 4) evens this out step by step: the ranks are sorted by
the attention work of the op they run, the i-th lightest is paired with the i-th heaviest, and
the heavy rank hands part of its attention (its query block against its OLDEST K/V chunks) to
the light partner, which returns the partial output and log-sum-exp to merge. The share moved is
half the difference of the two ops' attention times, capped at ``cap`` times the heavy op's
attention time (``--pp-attn-redistribution CAP``; 0 is off).

A "step" is the lock-step slot of an op: the time it starts when every compute op lasts one unit
and messages are instant, i.e. the schedule's dependency structure without its durations. The
ops of one slot run side by side in a steady pipeline, so they are the ones that pair up. The
transfers (Q and K/V out, output and lse back) are assumed to overlap with compute, as in the
paper, and are not charged. Only the durations change; memory is the schedule's own.

:func:`delegation_plan` is the same pairing for real ranks: it says, for every (rank, op), which
partner computes how many of the op's oldest K/V slices. Every rank computes it alone from the
schedule and the slice lengths, so all ranks agree without talking (``runtime/redistribution.py``
carries it out).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .flops import FlopCosts
from .ir import Op, OpKind, Schedule
from .partition import causal_pairs
from .slots import slot_costs

ATTENTION_PASSES = {OpKind.F: 1.0, OpKind.B: 2.0, OpKind.BW: 2.0, OpKind.W: 0.0}


def attention_time(costs: FlopCosts, op: Op) -> float:
    """Seconds of ``op`` spent in attention (the part that can move): forward once, backward
    twice, weight gradient none."""
    lengths = costs.slice_lengths or [costs.seq_length]
    end = sum(lengths[: op.slice + 1])
    pairs = causal_pairs(lengths[op.slice], end) * costs.micro_batch_size
    flops = costs.layers_per_stage[op.stage] * costs.shape.attention_flops_per_pair() * pairs
    return ATTENTION_PASSES.get(op.kind, 0.0) * flops / (costs.peak_flops * costs.utilisation)


def lockstep_slots(schedule: Schedule, costs: Any = None) -> dict[tuple[int, Op], int]:
    """(rank, compute op) -> the slot it runs in under unit durations and instant messages.
    ``costs`` only supplies what the replay asks besides durations (default: unit costs)."""
    from .simulate import simulate

    result = simulate(schedule, slot_costs(schedule, costs))
    return {(event.rank, event.op): round(event.start) for event in result.events}


@dataclass
class RedistributedCosts:
    """``base`` with the durations of paired ops adjusted; everything else is ``base``'s.

    ``moved`` records, per (heavy op, light op) pair, the seconds of attention moved."""

    base: FlopCosts
    adjust: dict[Op, float] = field(default_factory=dict)  # op -> seconds added (negative: removed)
    moved: list[tuple[Op, Op, float]] = field(default_factory=list)

    def duration(self, op: Op) -> float:
        return self.base.duration(op) + self.adjust.get(op, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def lockstep_pairs(
    schedule: Schedule, costs: Any, work: Callable[[int, Op], float]
) -> list[tuple[tuple[int, Op], tuple[int, Op]]]:
    """(heavy, light) pairs of (rank, op), slot by slot: the ops of a slot sorted by ``work``,
    the i-th lightest paired with the i-th heaviest (the middle op of an odd count stays alone).
    Deterministic: ties keep the simulator's event order."""
    by_slot: dict[int, list[tuple[int, Op]]] = defaultdict(list)
    for key, slot in lockstep_slots(schedule, costs).items():
        by_slot[slot].append(key)
    pairs = []
    for slot in sorted(by_slot):
        ops = sorted(by_slot[slot], key=lambda key: work(*key))
        half = len(ops) // 2
        pairs += [(heavy, light) for light, heavy in zip(ops[:half], reversed(ops[half:]))]
    return pairs


def check_cap(cap: float) -> None:
    if not 0.0 <= cap <= 1.0:
        raise ValueError(f"--pp-attn-redistribution must be between 0 and 1, got {cap}")


def redistribute(schedule: Schedule, costs: FlopCosts, cap: float) -> RedistributedCosts:
    """Pair heavy and light ranks at every lock-step slot and move attention from heavy to light
    (see the module docstring). ``cap`` in [0, 1]; 0 returns ``costs`` unchanged."""
    check_cap(cap)
    result = RedistributedCosts(costs)
    if cap == 0.0:
        return result
    for (_, heavy), (_, light) in lockstep_pairs(schedule, costs, lambda _, op: attention_time(costs, op)):
        heavy_time, light_time = attention_time(costs, heavy), attention_time(costs, light)
        share = min((heavy_time - light_time) / 2, cap * heavy_time)
        if share <= 0.0:
            continue
        result.adjust[heavy] = result.adjust.get(heavy, 0.0) - share
        result.adjust[light] = result.adjust.get(light, 0.0) + share
        result.moved.append((heavy, light, share))
    return result


# ---- the plan for real ranks ---------------------------------------------------------------


@dataclass(frozen=True)
class Delegation:
    """The heavy op hands the attention of its queries to its ``oldest_slices`` first K/V slices
    to ``partner`` (a pipeline rank), whose op ``light`` runs in the same slot. ``work``: the
    attention moved, in query-key pairs x passes x layers for one sequence."""

    partner: int
    oldest_slices: int
    light: Op
    work: int


def attention_work(
    op: Op, slice_lengths: Sequence[int], layers_per_stage: Sequence[int] | None = None
) -> int:
    """Attention of ``op`` for one sequence: query-key pairs of its slice (earlier slices all
    visible, its own causal) x passes (F 1, B and BW 2, W 0) x attention layers of its stage."""
    end = sum(slice_lengths[: op.slice + 1])
    return _per_pair(op, layers_per_stage) * causal_pairs(slice_lengths[op.slice], end)


def _per_pair(op: Op, layers_per_stage: Sequence[int] | None) -> int:
    """Work units one query-key pair of ``op`` costs: passes x attention layers."""
    layers = 1 if layers_per_stage is None else layers_per_stage[op.stage]
    return int(ATTENTION_PASSES.get(op.kind, 0.0)) * layers


def oldest_slices_within(op: Op, slice_lengths: Sequence[int], per_pair: int, budget: float) -> int:
    """The most whole K/V slices, oldest first and before ``op``'s own, whose attention with the
    op's queries (``per_pair`` work units per query-key pair) stays within ``budget``."""
    queries = slice_lengths[op.slice]
    count, moved = 0, 0
    for length in slice_lengths[: op.slice]:
        moved += per_pair * queries * length
        if moved > budget:
            break
        count += 1
    return count


def delegation_plan(
    schedule: Schedule,
    slice_lengths: Sequence[int],
    cap: float,
    layers_per_stage: Sequence[int] | None = None,
) -> dict[tuple[int, Op], Delegation]:
    """Which (rank, op) hands which oldest K/V slices to which partner; the same on every rank.

    The ops of each lock-step slot are paired as in :func:`redistribute`, by
    :func:`attention_work` (``layers_per_stage``: attention layers of each stage; None counts one
    each). The heavy op moves whole slices, oldest first, covering at most
    min((heavy - light) / 2, cap * heavy); a pair where not even one slice fits moves nothing.
    A B's delegation is decided in its own slot, apart from its F's. W ops (no attention) and
    stages without attention layers never delegate. ``cap`` 0 gives an empty plan."""
    check_cap(cap)
    lengths = list(slice_lengths)
    if len(lengths) != schedule.slices:
        raise ValueError(f"{len(lengths)} slice lengths for a schedule with {schedule.slices} slices")
    if cap == 0.0 or schedule.slices < 2:
        return {}

    def work(_: int, op: Op) -> int:
        return attention_work(op, lengths, layers_per_stage)

    plan: dict[tuple[int, Op], Delegation] = {}
    for (heavy_rank, heavy), (light_rank, light) in lockstep_pairs(schedule, None, work):
        heavy_work, light_work = work(heavy_rank, heavy), work(light_rank, light)
        budget = min((heavy_work - light_work) / 2, cap * heavy_work)
        if budget <= 0:
            continue
        per_pair = _per_pair(heavy, layers_per_stage)
        count = oldest_slices_within(heavy, lengths, per_pair, budget)
        if count:
            moved = per_pair * lengths[heavy.slice] * sum(lengths[:count])
            plan[(heavy_rank, heavy)] = Delegation(light_rank, count, light, moved)
    return plan


def plan_links(plan: dict[tuple[int, Op], Delegation]) -> list[tuple[int, int]]:
    """The ordered (delegating rank, partner) pairs of a plan, sorted: every rank creates their
    process groups in this order."""
    return sorted({(rank, delegation.partner) for (rank, _), delegation in plan.items()})


def planned_costs(schedule: Schedule, costs: FlopCosts, cap: float) -> RedistributedCosts:
    """``costs`` with the moves real ranks make (:func:`delegation_plan`: whole oldest slices,
    so less even than :func:`redistribute`'s exact shares, and nothing when a slice is over the
    cap), for the simulator to show what the runtime does."""
    result = RedistributedCosts(costs)
    lengths, layers = costs.slice_lengths or [costs.seq_length], costs.layers_per_stage
    for (_, heavy), delegation in delegation_plan(schedule, lengths, cap, layers).items():
        seconds = delegation.work / attention_work(heavy, lengths, layers) * attention_time(costs, heavy)
        result.adjust[heavy] = result.adjust.get(heavy, 0.0) - seconds
        result.adjust[delegation.light] = result.adjust.get(delegation.light, 0.0) + seconds
        result.moved.append((heavy, delegation.light, seconds))
    return result
