"""Lowering passes: turn a schedule of compute ops into one the runtime can execute.

Each pass is a function ``Schedule -> Schedule``. :func:`insert_p2p` adds the point-to-point
communication: a RECV right before each compute op whose input lives on another rank, and a
SEND right after each compute op whose output another rank needs. Two stages on the same rank
(the tip of a V) hand over in memory and get no comm op. :func:`order_messages` then moves the
RECVs earlier (and the vocabulary collectives later) into one global order of the step's
messages. :func:`insert_offload` adds the activation copies of PipeOffload (which units to copy
is a policy: ``offload.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

from . import pairs
from .ir import Op, OpKind, Schedule
from .message_order import order_messages as in_one_order

Unit = tuple[int, int, int]  # (stage, microbatch, slice)


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
    """Add SEND_F/RECV_F/SEND_B/RECV_B around every compute op that crosses ranks. The two ops of
    an overlapped pair (``pairing.py``) run as one unit: both ops' receives before the first, both
    ops' sends after the second."""
    if schedule.is_lowered:
        return schedule
    ranks: list[list[Op]] = []
    for rank, (ops, firsts) in enumerate(zip(schedule.ranks, pairs.first_ops(schedule))):
        seconds = set(firsts.values())
        lowered: list[Op] = []
        held: list[Op] = []  # the first op's sends, until its partner has run
        for op in ops:
            before, after = _comm_for(op, schedule, rank)
            key = pairs.key_of(op)
            if key in firsts:
                partner_before, _ = _comm_for(pairs.op_of(firsts[key]), schedule, rank)
                lowered.extend(before + partner_before)
                lowered.append(op)
                held = after
                continue
            if key not in seconds:
                lowered.extend(before)
            lowered.append(op)
            lowered.extend(held + after)
            held = []
        ranks.append(lowered)
    return schedule.with_ranks(ranks)


def _group_start(ops: list[Op], position: int) -> int:
    """First position of the compute op at ``position`` together with the RECVs that feed it."""
    op = ops[position]
    recv = OpKind.RECV_F if op.kind == OpKind.F else OpKind.RECV_B
    while position > 0 and ops[position - 1].kind == recv and ops[position - 1].unit == op.unit:
        position -= 1
    return position


def _group_end(ops: list[Op], position: int) -> int:
    """Last position of the F at ``position`` together with the SEND of its output (receives
    posted right before that SEND, in the step's message order, stay inside the group)."""
    unit = ops[position].unit
    scan = position + 1
    while scan < len(ops) and ops[scan].is_comm:
        if ops[scan].kind == OpKind.SEND_F and ops[scan].unit == unit:
            return scan
        scan += 1
    return position


def insert_offload(schedule: Schedule, units: Collection[Unit] | None = None, lookahead: int = 1) -> Schedule:
    """Add an OFFLOAD right after the F of each unit in ``units`` (every unit when None) and a
    RELOAD ``lookahead`` compute ops ahead of its B (or BW), so the copy back overlaps them.

    A unit with ``lookahead`` or fewer compute ops between its F and its B is left alone: its
    activation would be back on the device before anything else ran, so copying it frees
    nothing. On a lowered schedule an OFFLOAD goes after the F's SEND and a RELOAD before the
    RECVs of the op it precedes (it then also overlaps the wait). A schedule that already has
    copies is returned unchanged."""
    if lookahead < 0:
        raise ValueError(f"the reload lookahead must be at least 0 compute ops, got {lookahead}")
    if any(op.is_copy for _, _, op in schedule.all_ops()):
        return schedule
    wanted = None if units is None else set(units)
    ranks: list[list[Op]] = []
    for ops in schedule.ranks:
        compute = [position for position, op in enumerate(ops) if op.is_compute]
        index = {(ops[p].kind, ops[p].unit): n for n, p in enumerate(compute)}
        after: dict[int, list[Op]] = defaultdict(list)
        before: dict[int, list[tuple[int, Op]]] = defaultdict(list)
        for n, position in enumerate(compute):
            op = ops[position]
            if op.kind != OpKind.F or (wanted is not None and op.unit not in wanted):
                continue
            back = index.get((OpKind.B, op.unit), index.get((OpKind.BW, op.unit)))
            if back is None or back - n - 1 <= lookahead:
                continue
            after[_group_end(ops, position)].append(Op(OpKind.OFFLOAD, *op.unit))
            target = _group_start(ops, compute[back - lookahead])
            before[target].append((back, Op(OpKind.RELOAD, *op.unit)))
        lowered: list[Op] = []
        for position, op in enumerate(ops):
            lowered.extend(reload for _, reload in sorted(before.get(position, []), key=lambda item: item[0]))
            lowered.append(op)
            lowered.extend(after.get(position, []))
        ranks.append(lowered)
    return schedule.with_ranks(ranks)


def order_messages(schedule: Schedule, costs: Any = None) -> Schedule:
    """Post the RECVs and issue the vocabulary collectives in one global order of the step's
    messages (``message_order.py``: NCCL's in-order completion cannot hang it then), the order
    a replay at ``costs`` sends them in (default: unit costs; a run's own: ``run_costs.py``)."""
    return in_one_order(schedule, costs)


def lower(schedule: Schedule, costs: Any = None) -> Schedule:
    """``schedule`` with its communication ops, its messages ordered by a replay at ``costs``
    (default: unit costs; a run's own: ``run_costs.run_costs``); a schedule that has them
    already is returned as it is (offload adds its copies to a lowered schedule, which must keep
    its order)."""
    if schedule.is_lowered:
        return schedule
    return order_messages(insert_p2p(schedule), costs)
