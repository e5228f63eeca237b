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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .flops import FlopCosts
from .ir import Op, OpKind, Schedule
from .partition import causal_pairs

ATTENTION_PASSES = {OpKind.F: 1.0, OpKind.B: 2.0, OpKind.BW: 2.0, OpKind.W: 0.0}


def attention_time(costs: FlopCosts, op: Op) -> float:
    """Seconds of ``op`` spent in attention (the part that can move): forward once, backward
    twice, weight gradient none."""
    lengths = costs.slice_lengths or [costs.seq_length]
    end = sum(lengths[: op.slice + 1])
    pairs = causal_pairs(lengths[op.slice], end) * costs.micro_batch_size
    flops = costs.layers_per_stage[op.stage] * costs.shape.attention_flops_per_pair() * pairs
    return ATTENTION_PASSES.get(op.kind, 0.0) * flops / (costs.peak_flops * costs.utilisation)


@dataclass
class _SlotCosts:
    """Every compute op one unit, messages instant: the lock-step slots of a schedule."""

    base: Any

    def duration(self, op: Op) -> float:
        return 1.0

    def comm_latency(self, op: Op) -> float:
        return 0.0

    def copy_time(self, op: Op) -> float:
        return 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def lockstep_slots(schedule: Schedule, costs: Any) -> dict[tuple[int, Op], int]:
    """(rank, compute op) -> the slot it runs in under unit durations and instant messages."""
    from .simulate import simulate

    result = simulate(schedule, _SlotCosts(costs))
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


def redistribute(schedule: Schedule, costs: FlopCosts, cap: float) -> RedistributedCosts:
    """Pair heavy and light ranks at every lock-step slot and move attention from heavy to light
    (see the module docstring). ``cap`` in [0, 1]; 0 returns ``costs`` unchanged."""
    if not 0.0 <= cap <= 1.0:
        raise ValueError(f"--pp-attn-redistribution must be between 0 and 1, got {cap}")
    result = RedistributedCosts(costs)
    if cap == 0.0:
        return result
    by_slot: dict[int, list[Op]] = defaultdict(list)
    for (_, op), slot in lockstep_slots(schedule, costs).items():
        by_slot[slot].append(op)
    for slot in sorted(by_slot):
        ops = sorted(by_slot[slot], key=lambda op: attention_time(costs, op))
        for light, heavy in zip(ops[: len(ops) // 2], reversed(ops[len(ops) // 2 :])):
            heavy_time, light_time = attention_time(costs, heavy), attention_time(costs, light)
            share = min((heavy_time - light_time) / 2, cap * heavy_time)
            if share <= 0.0:
                continue
            result.adjust[heavy] = result.adjust.get(heavy, 0.0) - share
            result.adjust[light] = result.adjust.get(light, 0.0) + share
            result.moved.append((heavy, light, share))
    return result
