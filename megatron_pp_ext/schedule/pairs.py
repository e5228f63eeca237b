"""What an overlapped pair is (``pairing.py`` finds them): the keys naming its two ops, each
rank's pairs as a schedule's ``meta["pairs"]`` holds them, and the all-to-all time a pair hides.
Lowering, the message order and the replay read pairs through this module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .ir import Op, OpKind, Schedule

PairKey = tuple[str, int, int, int]  # (kind, stage, microbatch, slice) of one op


def key_of(op: Op) -> PairKey:
    return (op.kind.value, *op.unit)


def op_of(key: PairKey) -> Op:
    return Op(OpKind(key[0]), *key[1:])


def first_ops(schedule: Schedule) -> list[dict[PairKey, PairKey]]:
    """Per rank: the first op of each pair -> the second."""
    return [
        {tuple(first): tuple(second) for first, second in found}
        for found in (schedule.meta.get("pairs") or [[] for _ in schedule.ranks])
    ]


def count(schedule: Schedule) -> int:
    return sum(len(found) for found in schedule.meta.get("pairs") or [])


def hidden_seconds(first: Op, second: Op, costs: Any) -> float:
    """The all-to-all time a pair hides: each op's all-to-all behind the other's compute."""
    comm_first, comm_second = expert_comm(costs, first), expert_comm(costs, second)
    compute_first = costs.duration(first) - comm_first
    compute_second = costs.duration(second) - comm_second
    return min(comm_first, compute_second) + min(comm_second, compute_first)


def expert_comm(costs: Any, op: Op) -> float:
    """Seconds of ``op``'s expert all-to-all (0 for cost models that have none)."""
    of = getattr(costs, "expert_comm_time", None)
    return of(op) if of is not None else 0.0


def iter_pairs(schedule: Schedule) -> Iterator[tuple[int, PairKey, PairKey]]:
    for rank, found in enumerate(schedule.meta.get("pairs") or []):
        for first, second in found:
            yield rank, tuple(first), tuple(second)
