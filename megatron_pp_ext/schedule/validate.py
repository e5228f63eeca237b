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
   order F, OFFLOAD, RELOAD, B (or BW); one without the other is an error;
5. vocabulary parallelism (``vocab.py``): every rank runs S, T and each collective of the variant
   exactly once per unit; every rank issues each channel's collectives in the same order (they
   match by position, as NCCL and gloo match them); and on each rank the local order holds:
   BCAST_X before S, S before its REDUCE_S, REDUCE_S before T, T before REDUCE_T, the loss rank's
   last-stage F before its BCAST_X and its input-gradient reduce before the last stage's B, the
   first stage's REDUCE_EMB before its F and its B before BCAST_DEMB. The execution check then
   treats a collective as done once every rank has issued it (issuing never waits).
"""

from __future__ import annotations

from collections import defaultdict, deque

from .deps import Unit, compute_dependencies, describe
from .ir import COMPUTE_KINDS, COPY_KINDS, Op, OpKind, Schedule, format_op, matching_op
from .vocab import CHANNELS, Layout


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the op, the rank and the rule."""


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` for the first broken rule; return None for a valid schedule."""
    _check_structure(schedule)
    if schedule.is_lowered:
        _check_channels(schedule)
    if schedule.vocab_parallel != "none":
        _check_vocab(schedule)
    _check_execution(schedule)


def is_valid(schedule: Schedule) -> bool:
    try:
        validate(schedule)
    except ScheduleError:
        return False
    return True


def weight_order_error(schedule: Schedule) -> str | None:
    """Where a stage's W ops do not come in the order of its B ops (None: they all do).

    Not a validity rule (our own weight-gradient store takes W in any order), but Transformer
    Engine keeps deferred weight gradients in a first-in first-out queue per linear layer, so on
    its layer spec each stage's W must follow its B order. Every split generator keeps it."""
    for rank, ops in enumerate(schedule.ranks):
        b_order: dict[int, list[tuple[int, int]]] = defaultdict(list)
        w_order: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for op in ops:
            if op.kind == OpKind.B:
                b_order[op.stage].append((op.microbatch, op.slice))
            elif op.kind == OpKind.W:
                w_order[op.stage].append((op.microbatch, op.slice))
        for stage, ws in sorted(w_order.items()):
            for w_unit, b_unit in zip(ws, b_order[stage]):
                if w_unit != b_unit:
                    return (
                        f"rank {rank}, stage {stage}: W of microbatch {w_unit[0]} slice {w_unit[1]} comes "
                        f"where B order has microbatch {b_unit[0]} slice {b_unit[1]}"
                    )
    return None


def slice_order_error(schedule: Schedule) -> str | None:
    """Where a stage runs a backward of a microbatch before all of that microbatch's slices ran
    forward there (None: never).

    Not a validity rule either, but statistics of the whole sequence that every slice's gradient
    uses (a mixture-of-experts layer's tokens per expert) are complete at a microbatch's first
    backward only where it holds. Every sliced generator keeps it: a microbatch's last slice runs
    backward first, and it needs every earlier slice's forward."""
    for rank, ops in enumerate(schedule.ranks):
        forwards: dict[tuple[int, int], int] = defaultdict(int)
        for position, op in enumerate(ops):
            key = (op.stage, op.microbatch)
            if op.kind == OpKind.F:
                forwards[key] += 1
            elif op.kind in (OpKind.B, OpKind.BW) and forwards[key] < schedule.slices:
                return (
                    f"{_where(rank, position)}: stage {op.stage} runs a backward of microbatch "
                    f"{op.microbatch} after {forwards[key]} of its {schedule.slices} slices ran forward"
                )
    return None


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
        if op.is_vocab:
            continue  # on every rank: _check_vocab
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


def _check_vocab(schedule: Schedule) -> None:
    """Rule 5: each rank's vocabulary ops, their channel order and their local order."""
    layout = Layout.of(schedule)
    expected = layout.kinds()
    units = [(mb, j) for mb in range(schedule.microbatches) for j in range(schedule.slices)]
    channels: dict[str, list[tuple[int, list[tuple[Op, int]]]]] = {}
    for rank, ops in enumerate(schedule.ranks):
        where: dict[tuple[OpKind, Unit], int] = {}
        mine: dict[str, list[tuple[Op, int]]] = {}
        for position, op in enumerate(ops):
            if op.kind in (*COMPUTE_KINDS, OpKind.S, OpKind.T, *CHANNELS):
                key = (op.kind, op.unit)
                if op.is_vocab and key in where:
                    raise ScheduleError(
                        f"{op} appears twice on rank {rank}: at positions {where[key]} and {position}"
                    )
                where.setdefault(key, position)
            if op.is_vocab and op.stage != layout.stage_of(op.kind):
                which = "last" if layout.stage_of(op.kind) else "first"
                raise ScheduleError(
                    f"{op} at {_where(rank, position)}: a {op.kind.value} names stage "
                    f"{layout.stage_of(op.kind)} (the {which} stage's unit it serves)"
                )
            if op.kind == OpKind.REDUCE_T and layout.variant != "vocab-1":
                raise ScheduleError(f"{op} at {_where(rank, position)}: vocab-2 has no REDUCE_T")
            if op.is_collective:
                mine.setdefault(CHANNELS[op.kind], []).append((op, position))
        for kind in expected:
            stage = layout.stage_of(kind)
            for microbatch, slice_ in units:
                if (kind, (stage, microbatch, slice_)) not in where:
                    name = describe("", (stage, microbatch, slice_))
                    raise ScheduleError(
                        f"rank {rank} has no {kind.value}{name}: with {layout.variant} every rank runs "
                        f"{', '.join(k.value for k in expected)} for every microbatch (and slice)"
                    )
        _check_vocab_order(schedule, layout, rank, where)
        for channel, issued in mine.items():
            channels.setdefault(channel, []).append((rank, issued))
    for channel, per_rank in channels.items():
        first_rank, first = per_rank[0]
        for rank, issued in per_rank[1:]:
            for index, ((a, _), (b, position)) in enumerate(zip(first, issued)):
                if (a.kind, a.unit) != (b.kind, b.unit):
                    raise ScheduleError(
                        f"collective order differs in channel {channel!r}: collective {index} is {a} on "
                        f"rank {first_rank} but {b} on rank {rank} (position {position}); every rank "
                        "must issue a channel's collectives in the same order"
                    )


def _check_vocab_order(schedule: Schedule, layout: Layout, rank: int, where: dict) -> None:
    """The local order of the vocabulary ops on ``rank``: each pair (earlier, later, why)."""
    last = layout.last_stage
    for microbatch in range(schedule.microbatches):
        for slice_ in range(schedule.slices):
            out, emb = (last, microbatch, slice_), (0, microbatch, slice_)
            pairs = [
                (OpKind.S, OpKind.T, out, "T needs the logits shard and statistics that S keeps"),
                (OpKind.BCAST_X, OpKind.S, out, "S reads the broadcast output of the last stage"),
                (OpKind.S, OpKind.REDUCE_S, out, "the reduce carries the statistics S computes"),
                (OpKind.REDUCE_S, OpKind.T, out, "T needs the global max and sum"),
                (OpKind.BCAST_IDS, OpKind.REDUCE_EMB, emb, "the lookup needs the token ids"),
            ]
            if layout.variant == "vocab-1":
                pairs.append((OpKind.T, OpKind.REDUCE_T, out, "the reduce carries T's input gradient"))
            if rank == layout.loss_rank:
                backward = OpKind.B if (OpKind.B, out) in where else OpKind.BW
                pairs += [
                    (OpKind.F, OpKind.BCAST_X, out, "the broadcast sends the last stage's output"),
                    (
                        layout.input_gradient(),
                        backward,
                        out,
                        "the last stage's backward needs the input gradient",
                    ),
                ]
            if rank == layout.first_rank:
                backward = OpKind.B if (OpKind.B, emb) in where else OpKind.BW
                pairs += [
                    (OpKind.REDUCE_EMB, OpKind.F, emb, "the first stage's F needs the embedding"),
                    (
                        backward,
                        OpKind.BCAST_DEMB,
                        emb,
                        "the broadcast sends the first stage's input gradient",
                    ),
                ]
            for earlier, later, unit, why in pairs:
                first, second = where.get((earlier, unit)), where.get((later, unit))
                if first is not None and second is not None and second < first:
                    name = describe("", unit)
                    raise ScheduleError(
                        f"{later.value}{name} at {_where(rank, second)} runs before {earlier.value}{name} "
                        f"(position {first}): {why}"
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
        self.layout = Layout.of(schedule)
        self.issued: dict[tuple[OpKind, Unit], int] = defaultdict(int)

    def missing(self, rank: int, op: Op) -> tuple[str, str, frozenset[OpKind], Unit, tuple] | None:
        """None if ``op`` can run now, else (what it waits for, where that is, the op kinds that
        would satisfy it, their unit, the fact it waits for)."""
        place = self.schedule.placement
        if op.is_copy:
            return None  # placed after its F and before its B on the same rank: checked above
        needed = self.layout.waits_for(op, rank)
        if needed is not None and ("DONE", needed.kind, needed.unit) not in self.facts:
            return (
                format_op(needed),
                "every rank (a collective completes once all have issued it)",
                frozenset({needed.kind}),
                needed.unit,
                ("DONE", needed.kind, needed.unit),
            )
        if op.is_vocab:
            return self._vocab_missing(rank, op)
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

    def _vocab_missing(self, rank: int, op: Op) -> tuple[str, str, frozenset[OpKind], Unit, tuple] | None:
        """An S or T waits only for its collective (above); a collective's issue waits for what
        it sends, on this rank."""
        if not op.is_collective:
            return None
        needs = self.layout.issue_needs(op, rank)
        if needs is None:
            return None
        what, unit = needs
        if what in ("S", "T"):
            fact = (what, rank, unit)
            kinds = frozenset({OpKind(what)})
            label = f"{what}{describe('', unit)}"
        else:
            fact = (what, unit)
            kinds = _SATISFIES[what]
            label = describe(what, unit)
        if fact in self.facts:
            return None
        return label, f"rank {rank}", kinds, unit, fact

    def run(self, rank: int, op: Op) -> list[tuple]:
        """Record that ``op`` ran; return the facts it established."""
        if op.is_collective:
            key = (op.kind, op.unit)
            self.issued[key] += 1
            if self.issued[key] < self.schedule.pp:
                return []
            self.facts.add(("DONE", op.kind, op.unit))
            return [("DONE", op.kind, op.unit)]
        if op.kind in (OpKind.S, OpKind.T):
            new = [(op.kind.value, rank, op.unit)]
            self.facts.update(new)
            return new
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
