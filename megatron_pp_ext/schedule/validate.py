"""The validator: is a schedule complete, ordered correctly and free of deadlock?

It checks, and its error names the first broken rule:

1. every compute op exactly once, on the rank that the placement gives its stage (each unit has
   one F and either one BW or one B plus one W);
2. the data dependencies of ``deps.py`` (F of stage s+1 after F of stage s, B in reverse,
   W after its B on the same rank, slice order inside a microbatch), by executing the schedule
   with zero-cost ops: an op runs only once everything it needs has run, and a rank blocks on
   its next op. If every rank is blocked, the schedule deadlocks;
3. for lowered schedules, that SEND/RECV ops pair up, in the same order on both ends of every
   channel (NCCL and gloo match messages in order), and that a RECV waits for its SEND (sends are
   asynchronous, receives block);
4. activation copies: at most one OFFLOAD and one RELOAD per unit, on the unit's rank, in the
   order F, OFFLOAD, RELOAD, B (or BW); one without the other is an error.
"""

from __future__ import annotations

from collections import defaultdict, deque

from .deps import Unit, compute_dependencies, describe
from .ir import COMPUTE_KINDS, COPY_KINDS, Op, OpKind, Schedule, format_op
from .lowering import matching_op


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the op, the rank and the rule."""


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` for the first broken rule; return None for a valid schedule."""
    _check_structure(schedule)
    if schedule.is_lowered:
        _check_channels(schedule)
    _check_execution(schedule)


def is_valid(schedule: Schedule) -> bool:
    try:
        validate(schedule)
    except ScheduleError:
        return False
    return True


def _where(rank: int, position: int) -> str:
    return f"rank {rank} position {position}"


def _check_structure(schedule: Schedule) -> None:
    if len(schedule.ranks) != schedule.pp:
        raise ScheduleError(f"schedule has {len(schedule.ranks)} ranks but pp={schedule.pp}")
    seen: dict[tuple[OpKind, Unit], tuple[int, int]] = {}
    for rank, position, op in schedule.all_ops():
        if not 0 <= op.stage < schedule.num_stages:
            raise ScheduleError(
                f"{op} at {_where(rank, position)}: stage out of range 0..{schedule.num_stages - 1}"
            )
        if not 0 <= op.microbatch < schedule.microbatches:
            raise ScheduleError(
                f"{op} at {_where(rank, position)}: microbatch out of range 0..{schedule.microbatches - 1}"
            )
        if not 0 <= op.slice < schedule.slices:
            raise ScheduleError(
                f"{op} at {_where(rank, position)}: slice out of range 0..{schedule.slices - 1}"
            )
        owner = schedule.placement.rank_of(op.stage)
        if op.kind in COMPUTE_KINDS or op.kind in COPY_KINDS:
            if owner != rank:
                raise ScheduleError(
                    f"{op} at {_where(rank, position)}: stage {op.stage} belongs to rank {owner} "
                    f"under {schedule.placement.style} placement"
                )
            key = (op.kind, op.unit)
            if key in seen:
                raise ScheduleError(
                    f"{op} appears twice: at {_where(*seen[key])} and at {_where(rank, position)}"
                )
            seen[key] = (rank, position)
    for stage in range(schedule.num_stages):
        for microbatch in range(schedule.microbatches):
            for slice_ in range(schedule.slices):
                _check_unit(schedule, seen, (stage, microbatch, slice_))
    _check_copies(seen)


def _check_unit(schedule: Schedule, seen: dict, unit: Unit) -> None:
    name = describe("", unit)
    has = {kind: (kind, unit) in seen for kind in COMPUTE_KINDS}
    if not has[OpKind.F]:
        raise ScheduleError(f"missing op F{name}: every (stage, microbatch, slice) needs one forward")
    if has[OpKind.BW] and (has[OpKind.B] or has[OpKind.W]):
        raise ScheduleError(f"unit {name} has both BW{name} and a split B/W: use one or the other")
    if not has[OpKind.BW]:
        if not has[OpKind.B]:
            raise ScheduleError(f"missing op B{name} (or BW{name}): every forward needs a backward")
        if not has[OpKind.W]:
            raise ScheduleError(f"missing op W{name}: B{name} defers weight gradients that no W computes")
        b_rank, b_pos = seen[(OpKind.B, unit)]
        w_rank, w_pos = seen[(OpKind.W, unit)]
        if w_pos < b_pos:
            raise ScheduleError(
                f"W{name} at {_where(w_rank, w_pos)} runs before its B{name} at position {b_pos}"
            )


def _check_copies(seen: dict[tuple[OpKind, Unit], tuple[int, int]]) -> None:
    """F, OFFLOAD, RELOAD, B in this order on the unit's rank (the copies sit on that rank)."""
    for (kind, unit), (rank, position) in sorted(seen.items(), key=lambda item: item[1]):
        if kind not in COPY_KINDS:
            continue
        name = describe("", unit)
        here = f"{kind.value}{name} at {_where(rank, position)}"
        if (OpKind.OFFLOAD, unit) not in seen:
            raise ScheduleError(f"{here} has no OFFLOAD{name}: only an offloaded activation can be reloaded")
        if (OpKind.RELOAD, unit) not in seen:
            raise ScheduleError(
                f"{here} has no RELOAD{name}: its backward would find the activation on the host"
            )
        forward = seen[(OpKind.F, unit)][1]
        backward_kind = OpKind.B if (OpKind.B, unit) in seen else OpKind.BW
        backward = seen[(backward_kind, unit)][1]
        if kind == OpKind.OFFLOAD and position < forward:
            raise ScheduleError(f"{here} runs before F{name} (position {forward}): nothing is saved yet")
        if kind == OpKind.RELOAD and position < seen[(OpKind.OFFLOAD, unit)][1]:
            raise ScheduleError(
                f"{here} runs before OFFLOAD{name} (position {seen[(OpKind.OFFLOAD, unit)][1]})"
            )
        if position > backward:
            raise ScheduleError(
                f"{here} runs after {backward_kind.value}{name} (position {backward}), "
                "which needs the activation"
            )


def _channel_key(rank: int, op: Op) -> tuple[int, int, str]:
    """(sender, receiver, direction) of a comm op seen from ``rank``."""
    assert op.peer is not None
    direction = "F" if op.kind in (OpKind.SEND_F, OpKind.RECV_F) else "B"
    if op.kind in (OpKind.SEND_F, OpKind.SEND_B):
        return (rank, op.peer, direction)
    return (op.peer, rank, direction)


def _check_channels(schedule: Schedule) -> None:
    sends: dict[tuple[int, int, str], list[Op]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[Op]] = defaultdict(list)
    for rank, position, op in schedule.all_ops():
        if not op.is_comm:
            continue
        if op.peer is None:
            raise ScheduleError(f"{op} at {_where(rank, position)} names no peer rank")
        expected_peer = schedule.placement.rank_of(matching_op(op).stage)
        if op.peer != expected_peer:
            raise ScheduleError(
                f"{format_op(op)} at {_where(rank, position)}: peer should be rank {expected_peer}"
            )
        key = _channel_key(rank, op)
        (sends if op.kind in (OpKind.SEND_F, OpKind.SEND_B) else recvs)[key].append(op)
    for key in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(key, []), recvs.get(key, [])
        src, dst, direction = key
        for index in range(max(len(sent), len(received))):
            if index >= len(sent):
                raise ScheduleError(
                    f"rank {dst} expects {received[index]} from rank {src}, which never sends it"
                )
            if index >= len(received):
                raise ScheduleError(f"rank {src} sends {sent[index]} to rank {dst}, which never receives it")
            expected = matching_op(sent[index])
            if (expected.kind, expected.unit) != (received[index].kind, received[index].unit):
                raise ScheduleError(
                    f"channel rank {src} -> rank {dst} ({direction}): message {index} is {sent[index]} "
                    f"but rank {dst} receives {received[index]} at that point; both ends must "
                    "order the messages of a channel alike"
                )


_SATISFIES = {
    "F": frozenset({OpKind.F}),
    "B": frozenset({OpKind.B}),
    "BACKWARD": frozenset({OpKind.B, OpKind.BW}),
}


class _Execution:
    """Zero-cost execution of a schedule: the facts established so far ("F of this unit ran",
    "this message was sent", "rank r received this message")."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.lowered = schedule.is_lowered
        self.facts: set[tuple] = set()

    def missing(self, rank: int, op: Op) -> tuple[str, str, frozenset[OpKind], Unit, tuple] | None:
        """None if ``op`` can run now, else (what it waits for, where that is, the op kinds that
        would satisfy it, their unit, the fact it waits for)."""
        place = self.schedule.placement
        if op.is_copy:
            return None  # placed after its F and before its B on the same rank: checked above
        if op.is_comm:
            if op.kind in (OpKind.SEND_F, OpKind.SEND_B):
                what = "F" if op.kind == OpKind.SEND_F else "BACKWARD"
                if (what, op.unit) not in self.facts:
                    return describe(what, op.unit), f"rank {rank}", _SATISFIES[what], op.unit, (what, op.unit)
                return None
            match = matching_op(op)
            fact = ("SENT", match.kind, match.unit)
            if fact not in self.facts:
                return format_op(match), f"rank {op.peer}", frozenset({match.kind}), match.unit, fact
            return None
        for what, unit in compute_dependencies(op, self.schedule.num_stages, self.schedule.slices):
            owner = place.rank_of(unit[0])
            if self.lowered and owner != rank:
                recv_kind = OpKind.RECV_F if what == "F" else OpKind.RECV_B
                fact = ("RECEIVED", rank, recv_kind, op.unit)
                if fact not in self.facts:
                    label = f"{recv_kind.value}{describe('', op.unit)}"
                    return label, f"rank {rank} (from rank {owner})", frozenset({recv_kind}), op.unit, fact
            elif (what, unit) not in self.facts:
                return describe(what, unit), f"rank {owner}", _SATISFIES[what], unit, (what, unit)
        return None

    def run(self, rank: int, op: Op) -> list[tuple]:
        """Record that ``op`` ran; return the facts it established."""
        if op.kind == OpKind.F:
            new = [("F", op.unit)]
        elif op.kind == OpKind.B:
            new = [("B", op.unit), ("BACKWARD", op.unit)]
        elif op.kind == OpKind.BW:
            new = [("BACKWARD", op.unit)]
        elif op.kind in (OpKind.SEND_F, OpKind.SEND_B):
            new = [("SENT", op.kind, op.unit)]
        elif op.kind in (OpKind.RECV_F, OpKind.RECV_B):
            new = [("RECEIVED", rank, op.kind, op.unit)]
        else:
            new = []
        self.facts.update(new)
        return new


def execution_order(schedule: Schedule) -> list[tuple[int, int]]:
    """A global order of (rank, position) in which the schedule can run; raises if it cannot.

    Each rank runs until its next op waits for a fact that is not established yet; it is woken
    when that fact appears, so the cost is linear in the number of ops."""
    state = _Execution(schedule)
    pointers = [0] * schedule.pp
    order: list[tuple[int, int]] = []
    waiting: dict[tuple, list[int]] = defaultdict(list)
    ready = deque(range(schedule.pp))
    while ready:
        rank = ready.popleft()
        ops = schedule.ranks[rank]
        while pointers[rank] < len(ops):
            blocked = state.missing(rank, ops[pointers[rank]])
            if blocked is not None:
                waiting[blocked[4]].append(rank)
                break
            for fact in state.run(rank, ops[pointers[rank]]):
                ready.extend(waiting.pop(fact, ()))
            order.append((rank, pointers[rank]))
            pointers[rank] += 1
    stuck = [rank for rank in range(schedule.pp) if pointers[rank] < len(schedule.ranks[rank])]
    if stuck:
        raise ScheduleError(_explain_stuck(schedule, state, pointers, stuck))
    return order


def _explain_stuck(schedule: Schedule, state: _Execution, pointers: list[int], stuck: list[int]) -> str:
    waits = []
    for rank in stuck:
        position = pointers[rank]
        op = schedule.ranks[rank][position]
        needed, where, kinds, unit, _ = state.missing(rank, op)  # type: ignore[misc]
        later = [
            p
            for p in range(position + 1, len(schedule.ranks[rank]))
            if schedule.ranks[rank][p].kind in kinds and schedule.ranks[rank][p].unit == unit
        ]
        if later:
            return (
                f"{op} at {_where(rank, position)} needs {needed}, which rank {rank} runs only later "
                f"(position {later[0]})"
            )
        waits.append(f"rank {rank} waits at {op} (position {position}) for {needed} on {where}")
    return "deadlock: " + "; ".join(waits)


def _check_execution(schedule: Schedule) -> None:
    execution_order(schedule)
