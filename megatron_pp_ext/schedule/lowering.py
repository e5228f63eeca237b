"""Lowering passes: turn a schedule of compute ops into one the runtime can execute.

A pass is a function ``Schedule -> Schedule``. :func:`insert_p2p` adds the point-to-point
communication: a RECV right before each compute op whose input lives on another rank, and a
SEND right after each compute op whose output another rank needs. Two stages on the same rank
(the tip of a V) hand over in memory and get no comm op. Later passes (offload, vocabulary
S/T ops) plug into :func:`lower` the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from .ir import Op, OpKind, Schedule

Pass = Callable[[Schedule], Schedule]


def _comm_for(op: Op, schedule: Schedule, rank: int) -> tuple[list[Op], list[Op]]:
    """(ops to put before ``op``, ops to put after it) on ``rank``."""
    place = schedule.placement
    before: list[Op] = []
    after: list[Op] = []
    stage, last = op.stage, schedule.num_stages - 1
    prev_rank = place.rank_of(stage - 1) if stage > 0 else None
    next_rank = place.rank_of(stage + 1) if stage < last else None
    if op.kind == OpKind.F:
        if prev_rank is not None and prev_rank != rank:
            before.append(Op(OpKind.RECV_F, stage, op.microbatch, op.slice, prev_rank))
        if next_rank is not None and next_rank != rank:
            after.append(Op(OpKind.SEND_F, stage, op.microbatch, op.slice, next_rank))
    elif op.kind in (OpKind.B, OpKind.BW):
        if next_rank is not None and next_rank != rank:
            before.append(Op(OpKind.RECV_B, stage, op.microbatch, op.slice, next_rank))
        if prev_rank is not None and prev_rank != rank:
            after.append(Op(OpKind.SEND_B, stage, op.microbatch, op.slice, prev_rank))
    return before, after


def insert_p2p(schedule: Schedule) -> Schedule:
    """Add SEND_F/RECV_F/SEND_B/RECV_B around every compute op that crosses ranks."""
    if schedule.is_lowered:
        return schedule
    ranks: list[list[Op]] = []
    for rank, ops in enumerate(schedule.ranks):
        lowered: list[Op] = []
        for op in ops:
            before, after = _comm_for(op, schedule, rank)
            lowered.extend(before)
            lowered.append(op)
            lowered.extend(after)
        ranks.append(lowered)
    return schedule.with_ranks(ranks)


DEFAULT_PASSES: tuple[Pass, ...] = (insert_p2p,)


def lower(schedule: Schedule, passes: tuple[Pass, ...] = DEFAULT_PASSES) -> Schedule:
    for lowering_pass in passes:
        schedule = lowering_pass(schedule)
    return schedule


def matching_op(op: Op) -> Op:
    """The op on the peer rank that pairs with a comm op (SEND_F s <-> RECV_F s+1, ...)."""
    if op.kind == OpKind.SEND_F:
        return Op(OpKind.RECV_F, op.stage + 1, op.microbatch, op.slice)
    if op.kind == OpKind.RECV_F:
        return Op(OpKind.SEND_F, op.stage - 1, op.microbatch, op.slice)
    if op.kind == OpKind.SEND_B:
        return Op(OpKind.RECV_B, op.stage - 1, op.microbatch, op.slice)
    if op.kind == OpKind.RECV_B:
        return Op(OpKind.SEND_B, op.stage + 1, op.microbatch, op.slice)
    raise ValueError(f"{op} is not a communication op")
