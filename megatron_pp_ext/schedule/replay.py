"""Event-driven replay of a lowered schedule: time, bubbles and activation memory per rank.

``simulate.simulate`` lowers a schedule and replays it here. The replay itself needs no lowering,
so the lowering's message-order pass (``message_order.py``) replays schedules with it too.

Each rank runs its ops in order. A compute op starts when the rank is free and its input has
arrived: a RECV only posts the receive (``lowering`` may post it early, see
``message_order.py``); the op that consumes the message waits for the matching SEND's data (the
SEND is issued when the producing op ends and the message takes the cost model's latency);
sends never block, unless the replay follows NCCL's in-order completion (``completion.py``: a
message completes with both of its ends, one at a time per rank, in launch order). Memory: F adds
the op's activation when it starts, B frees all but the weight-gradient share (at its end), W
frees that share, BW frees everything.

Activation copies (OFFLOAD/RELOAD, see ``lowering.insert_offload``) run beside compute on two copy
streams per rank, device-to-host and host-to-device. An OFFLOAD is issued when the rank reaches it
(right after its F) and frees the copied bytes when its copy ends; a RELOAD starts once that copy
is done and its stream is free, allocates the bytes when it starts, and the unit's B (or BW) waits
for it to end. The ``ranks_per_host`` ranks of one host share its link: each direction carries
one copy at a time, so the copies of those ranks queue behind each other. Waiting for a reload is
idle time, so a link that is too slow shows up as bubble.

Vocabulary parallelism (``vocab.py``): S and T are compute ops of every rank (busy time); an S
allocates the cost model's ``vocab_activation`` when it starts and its T frees it when it ends. A
collective is issued when its rank reaches it (issuing never waits) and completes once every rank
has issued it and the previous collective of its channel has completed, plus the model's
``collective_time``: one stream per channel, the same order on every rank. The op that needs it
(S after BCAST_X, T after REDUCE_S, the last stage's B after the input-gradient reduce, the first
stage's F after REDUCE_EMB, a lookup after its token ids) starts no earlier. The makespan then
also covers the last collective.

Bubble rate of a rank = idle time / makespan; the overall rate is the mean over ranks. The
"in span" rate counts each rank only between its own first and last op, as the zero-bubble
papers do.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right, insort
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import pairs
from .completion import COMPLETIONS, FREE, IN_ORDER_SYNC, Completed, InOrderQueues
from .costs import CostModel, UniformCosts
from .ir import BACKWARD_KINDS, Op, OpKind, Schedule, format_op
from .validate import ScheduleError
from .vocab import CHANNELS, Layout


@dataclass(frozen=True)
class Event:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    makespan: float
    busy_per_rank: list[float]
    peak_memory_per_rank: list[float]  # in the cost model's memory unit (bytes for FLOP models)
    microbatch_activation: float
    events: list[Event] = field(default_factory=list)  # compute ops
    memory_curves: list[list[tuple[float, float]]] = field(default_factory=list)
    copies: list[Event] = field(default_factory=list)  # OFFLOAD/RELOAD on the copy streams
    offloaded_bytes_per_rank: list[float] = field(default_factory=list)
    baseline: SimResult | None = None  # the same schedule without its copies, when compared
    collectives: list[Event] = field(default_factory=list)  # per rank: issue to completion
    without_vocab: SimResult | None = None  # the schedule without vocabulary parallelism, when compared
    free_sends: SimResult | None = None  # the same replay with sends that never wait, when compared

    @property
    def bubble_rate_per_rank(self) -> list[float]:
        if self.makespan <= 0:
            return [0.0 for _ in self.busy_per_rank]
        return [(self.makespan - busy) / self.makespan for busy in self.busy_per_rank]

    @property
    def bubble_rate(self) -> float:
        rates = self.bubble_rate_per_rank
        return sum(rates) / len(rates)

    @property
    def bubble_rate_in_span_per_rank(self) -> list[float]:
        """Idle share of each rank between its own first op's start and last op's end: the
        zero-bubble papers' convention (a rank's staggered start is not counted)."""
        first = [math.inf] * len(self.busy_per_rank)
        last = [0.0] * len(self.busy_per_rank)
        for event in self.events:
            first[event.rank] = min(first[event.rank], event.start)
            last[event.rank] = max(last[event.rank], event.end)
        return [
            (end - start - busy) / (end - start) if end > start else 0.0
            for start, end, busy in zip(first, last, self.busy_per_rank)
        ]

    @property
    def bubble_rate_in_span(self) -> float:
        rates = self.bubble_rate_in_span_per_rank
        return sum(rates) / len(rates)

    @property
    def busy_max_over_min(self) -> float:
        """Most over least busy rank: 1.0 is perfectly balanced compute."""
        low = min(self.busy_per_rank, default=0.0)
        return max(self.busy_per_rank) / low if low > 0 else math.inf

    @property
    def peak_max_over_min(self) -> float:
        """Highest over lowest activation peak across ranks."""
        low = min(self.peak_memory_per_rank, default=0.0)
        return max(self.peak_memory_per_rank) / low if low > 0 else math.inf

    @property
    def peak_memory_m(self) -> list[float]:
        """Peak activation per rank in units of M (one whole microbatch over all layers)."""
        return [peak / self.microbatch_activation for peak in self.peak_memory_per_rank]

    def to_dict(self) -> dict[str, Any]:
        s = self.schedule
        return {
            "schedule": s.name,
            "pp": s.pp,
            "microbatches": s.microbatches,
            "vpp": s.vpp,
            "slices": s.slices,
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_per_rank": self.bubble_rate_per_rank,
            "bubble_rate_in_span": self.bubble_rate_in_span,
            "peak_memory_m": self.peak_memory_m,
            "peak_memory_bytes": self.peak_memory_per_rank,
            "offloaded_bytes": self.offloaded_bytes_per_rank,
            "busy_per_rank": self.busy_per_rank,
            "busy_max_over_min": self.busy_max_over_min,
            "peak_max_over_min": self.peak_max_over_min,
            "vocab_parallel": s.vocab_parallel,
            **({"without_offload": self.baseline.to_dict()} if self.baseline is not None else {}),
            **({"without_vocab_parallel": self.without_vocab.to_dict()} if self.without_vocab else {}),
        }


def message_key(op: Op) -> tuple[str, int, int, int]:
    """The same key for a SEND and its matching RECV: (direction, receiving stage, mb, slice)."""
    if op.kind == OpKind.SEND_F:
        return ("F", op.stage + 1, op.microbatch, op.slice)
    if op.kind == OpKind.SEND_B:
        return ("B", op.stage - 1, op.microbatch, op.slice)
    return ("F" if op.kind == OpKind.RECV_F else "B", op.stage, op.microbatch, op.slice)


def input_key(op: Op) -> tuple[str, int, int, int] | None:
    """The message a compute op consumes (its input, or its output gradient), named as
    :func:`message_key` names it; None for an op that consumes none."""
    if op.kind == OpKind.F:
        return ("F", op.stage, op.microbatch, op.slice)
    if op.kind in BACKWARD_KINDS:
        return ("B", op.stage, op.microbatch, op.slice)
    return None


class _Link:
    """One direction of one host link: the copies booked on it, as disjoint sorted intervals."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def book(self, ready: float, duration: float) -> float:
        """Book the earliest free stretch of ``duration`` at or after ``ready``; return its start."""
        start = ready
        if duration <= 0:
            return start
        index = bisect_right(self.ends, start)
        while index < len(self.starts) and self.starts[index] < start + duration:
            start = max(start, self.ends[index])
            index += 1
        insort(self.starts, start)
        insort(self.ends, start + duration)
        return start


class _Copies:
    """The copy streams of every rank and the host links they share."""

    def __init__(self, pp: int, ranks_per_host: int) -> None:
        self.ranks_per_host = max(1, ranks_per_host)
        self.links: dict[tuple[int, OpKind], _Link] = defaultdict(_Link)
        self.stream_free: dict[tuple[int, OpKind], float] = defaultdict(float)
        self.events: list[Event] = []

    def run(self, rank: int, op: Op, ready: float, duration: float) -> tuple[float, float]:
        """Queue ``op``'s copy on its rank's stream for its direction; return (start, end)."""
        ready = max(ready, self.stream_free[(rank, op.kind)])
        start = self.links[(rank // self.ranks_per_host, op.kind)].book(ready, duration)
        self.stream_free[(rank, op.kind)] = start + duration
        self.events.append(Event(rank, op, start, start + duration))
        return start, start + duration


class _Collectives:
    """The channels of the vocabulary collectives in one replay: each rank's k-th collective of a
    channel is the channel's k-th; it completes once all ranks issued it, after the one before."""

    def __init__(self, pp: int, costs: CostModel) -> None:
        self.pp = pp
        self.duration = getattr(costs, "collective_time", None) or (lambda op: 0.0)
        self.seq: dict[str, list[Op]] = defaultdict(list)
        self.issues: dict[str, list[dict[int, float]]] = defaultdict(list)
        self.count: dict[tuple[str, int], int] = defaultdict(int)  # (channel, rank) -> issued
        self.completed: dict[str, list[float]] = defaultdict(list)
        self.done: dict[tuple[OpKind, int, int, int], float] = {}  # op (kind, unit) -> completion
        self.events: list[Event] = []

    def issue(self, rank: int, op: Op, time: float) -> list[Op]:
        """Record ``rank`` issuing ``op``; return the collectives that completed."""
        channel = CHANNELS[op.kind]
        index = self.count[(channel, rank)]
        self.count[(channel, rank)] += 1
        seq, issues = self.seq[channel], self.issues[channel]
        if index == len(seq):
            seq.append(op)
            issues.append({})
        elif (seq[index].kind, seq[index].unit) != (op.kind, op.unit):
            raise ScheduleError(
                f"collective {index} of channel {channel!r} is {seq[index]} on one rank but {op} on "
                f"rank {rank}: every rank must issue a channel's collectives in the same order"
            )
        issues[index][rank] = time
        finished: list[Op] = []
        completed = self.completed[channel]
        while len(completed) < len(seq) and len(issues[len(completed)]) == self.pp:
            k = len(completed)
            start = max([*issues[k].values(), completed[-1] if completed else 0.0])
            completed.append(start + self.duration(seq[k]))
            self.done[(seq[k].kind, *seq[k].unit)] = completed[k]
            self.events.extend(Event(r, seq[k], t, completed[k]) for r, t in sorted(issues[k].items()))
            finished.append(seq[k])
        return finished


def replay(
    lowered: Schedule,
    costs: CostModel | None = None,
    schedule: Schedule | None = None,
    holds: Mapping[tuple[int, int], float] | None = None,
    completion: str = FREE,
) -> SimResult:
    """Replay ``lowered`` as it stands (no lowering pass runs: ``message_order`` replays the
    schedule it is ordering). ``schedule``: what the result reports (default ``lowered``).
    ``completion``: ``FREE`` (sends never wait), or NCCL's in-order completion (``completion.py``)
    with the host ahead of the GPU (``IN_ORDER``) or the host computing (``IN_ORDER_SYNC``)."""
    if completion not in COMPLETIONS:
        raise ValueError(f"completion {completion!r} is not one of {', '.join(COMPLETIONS)}")
    schedule = lowered if schedule is None else schedule
    holds = holds or {}
    if costs is None:
        costs = UniformCosts(
            num_stages=schedule.num_stages, num_slices=schedule.slices, chunks_per_rank=schedule.vpp
        )
    layout = Layout.of(lowered)
    vocab_memory = getattr(costs, "vocab_activation", None) or (lambda op: 0.0)
    arrival: dict[tuple[str, int, int, int], float] = {}  # message_key -> arrival time
    clock = [0.0] * lowered.pp
    busy = [0.0] * lowered.pp
    changes: list[list[tuple[float, int, float]]] = [[] for _ in range(lowered.pp)]
    order = itertools.count()  # replay order breaks ties between changes at the same time
    copies = _Copies(lowered.pp, costs.ranks_per_host)
    collectives = _Collectives(lowered.pp, costs)
    copied_out: dict[tuple[int, int, int], float] = {}  # unit -> end of its OFFLOAD copy
    reloaded: dict[tuple[int, int, int], float] = {}  # unit -> end of its RELOAD copy
    offloaded_bytes = [0.0] * lowered.pp
    held_for_w: dict[tuple[int, tuple[int, int, int]], float] = {}
    held_for_t: dict[tuple[int, tuple[int, int, int]], float] = {}
    events: list[Event] = []
    pointers = [0] * lowered.pp
    last_compute_end = [0.0] * lowered.pp
    posted: list[set[tuple[str, int, int, int]]] = [set() for _ in range(lowered.pp)]  # RECVs not consumed
    queues = (
        InOrderQueues(
            lowered.pp,
            message_key,
            costs.comm_latency,
            collectives.issue,
            lambda op: collectives.done.get((op.kind, *op.unit)),
        )
        if completion != FREE
        else None
    )
    host = [0.0] * lowered.pp  # where each rank's host is: it waits only for messages and holds
    # overlapped pairs (pairing.py): first op -> its partner, and second op -> the first
    pair_firsts = pairs.first_ops(lowered)
    pair_seconds = [{second: first for first, second in firsts.items()} for firsts in pair_firsts]

    def completed(finished: list[Completed]) -> None:
        """Messages and collectives the launch queues completed: their consumers may start."""
        for item, end in finished:
            if item.op.is_collective:
                wake(("COLLECTIVE", item.op.kind, *item.op.unit))
            elif item.op.kind in (OpKind.RECV_F, OpKind.RECV_B):
                arrival[message_key(item.op)] = end
                wake(message_key(item.op))

    def inbound(rank: int, op: Op) -> tuple[str, int, int, int] | None:
        """The posted message a compute op consumes (its input, or its output gradient)."""
        key = input_key(op)
        return key if key in posted[rank] else None

    def partner_inbound(rank: int, op: Op) -> tuple[str, int, int, int] | None:
        """The message the second op of the pair ``op`` starts needs: the pair waits for it."""
        partner = pair_firsts[rank].get(pairs.key_of(op)) if op.is_compute else None
        return None if partner is None else inbound(rank, pairs.op_of(partner))

    def collective_ready(rank: int, op: Op) -> float | None:
        """When the collective ``op`` waits for has completed (0.0: it waits for none; None: not yet)."""
        needed = layout.waits_for(op, rank)
        if needed is None:
            return 0.0
        return collectives.done.get((needed.kind, *needed.unit))

    def step(rank: int, op: Op) -> bool:
        """Run ``op`` on ``rank`` if it can run now; return whether it ran."""
        now = clock[rank]
        if op.kind in (OpKind.RECV_F, OpKind.RECV_B):
            posted[rank].add(message_key(op))  # the consumer waits for the data
            if queues is not None:
                completed(queues.launch(rank, op, now if completion == IN_ORDER_SYNC else host[rank]))
            return True
        if op.kind in (OpKind.SEND_F, OpKind.SEND_B):
            if queues is not None:
                completed(queues.launch(rank, op, last_compute_end[rank]))
            else:
                arrival[message_key(op)] = last_compute_end[rank] + costs.comm_latency(op)
                wake(message_key(op))
            return True
        if op.kind == OpKind.OFFLOAD:
            size = costs.offload_bytes(op)
            _, copied_out[op.unit] = copies.run(rank, op, now, costs.copy_time(op))
            offloaded_bytes[rank] += size
            _change(rank, copied_out[op.unit], -size)
            return True
        if op.kind == OpKind.RELOAD:
            start, reloaded[op.unit] = copies.run(
                rank, op, max(now, copied_out[op.unit]), costs.copy_time(op)
            )
            _change(rank, start, costs.offload_bytes(op))
            return True
        ready = collective_ready(rank, op)
        if ready is None:
            return False
        if op.is_collective:
            clock[rank] = max(now, ready)  # a lookup waits for its token ids
            if queues is not None:
                completed(queues.launch(rank, op, clock[rank]))
                return True
            for done in collectives.issue(rank, op, clock[rank]):
                wake(("COLLECTIVE", done.kind, *done.unit))
            return True
        message = inbound(rank, op)
        if message is not None:
            if message not in arrival:
                return False
        partner_message = partner_inbound(rank, op)
        if partner_message is not None:
            if partner_message not in arrival:
                return False
            ready = max(ready, arrival[partner_message])
        if message is not None:
            posted[rank].discard(message)
            ready = max(ready, arrival[message])
            host[rank] = max(host[rank], arrival[message])  # the host waits for the message
        duration = costs.duration(op)
        first = pair_seconds[rank].get(pairs.key_of(op)) if op.is_compute else None
        if first is not None:  # the pair's all-to-alls hidden behind each other's compute
            duration -= pairs.hidden_seconds(pairs.op_of(first), op, costs)
        start = max(now, ready)
        if op.kind in BACKWARD_KINDS:
            start = max(start, reloaded.pop(op.unit, 0.0))
        end = start + duration
        events.append(Event(rank, op, start, end))
        busy[rank] += duration
        clock[rank] = end
        last_compute_end[rank] = end
        if op.kind == OpKind.F:
            _change(rank, start, costs.activation(op))
        elif op.kind == OpKind.B:
            share = costs.weight_share(op)
            held_for_w[(rank, op.unit)] = share
            _change(rank, end, share - costs.activation(op))
        elif op.kind == OpKind.W:
            _change(rank, end, -held_for_w.pop((rank, op.unit)))
        elif op.kind == OpKind.BW:
            _change(rank, end, -costs.activation(op))
        elif op.kind == OpKind.S:
            held_for_t[(rank, op.unit)] = vocab_memory(op)
            _change(rank, start, held_for_t[(rank, op.unit)])
        elif op.kind == OpKind.T:
            _change(rank, end, -held_for_t.pop((rank, op.unit), 0.0))
        return True

    def _change(rank: int, time: float, delta: float) -> None:
        changes[rank].append((time, next(order), delta))

    def wait_key(rank: int, op: Op) -> tuple:
        message = inbound(rank, op)
        if message is not None and message not in arrival:
            return message
        message = partner_inbound(rank, op)
        if message is not None and message not in arrival:
            return message
        needed = layout.waits_for(op, rank)
        assert needed is not None
        return ("COLLECTIVE", needed.kind, *needed.unit)

    # A rank runs until it waits for a message or a collective; the SEND (or the last rank to
    # issue the collective) wakes it.
    waiting: dict[tuple, list[int]] = defaultdict(list)
    ready = deque(range(lowered.pp))

    def wake(key: tuple) -> None:
        ready.extend(waiting.pop(key, ()))

    while ready:
        rank = ready.popleft()
        ops = lowered.ranks[rank]
        while pointers[rank] < len(ops):
            op = ops[pointers[rank]]
            hold = holds.get((rank, pointers[rank]), 0.0)
            clock[rank], host[rank] = max(clock[rank], hold), max(host[rank], hold)
            if not step(rank, op):
                waiting[wait_key(rank, op)].append(rank)
                break
            pointers[rank] += 1
    stuck = [r for r in range(lowered.pp) if pointers[r] < len(lowered.ranks[r])]
    if stuck:
        detail = "; ".join(f"rank {r} waits at {_waiting(lowered.ranks[r], pointers[r])}" for r in stuck)
        if queues is not None:
            detail += "; under in-order completion the launch queues wait at " + ", ".join(queues.stuck())
        raise ScheduleError(f"deadlock in simulation: {detail}")
    makespan = max((e.end for e in events + collectives.events), default=0.0)
    peaks, curves = _memory(changes)
    return SimResult(
        schedule=schedule,
        makespan=makespan,
        busy_per_rank=busy,
        peak_memory_per_rank=peaks,
        microbatch_activation=costs.microbatch_activation,
        events=events,
        memory_curves=curves,
        copies=copies.events,
        offloaded_bytes_per_rank=offloaded_bytes,
        collectives=collectives.events,
    )


def _waiting(ops: list[Op], position: int) -> str:
    """The op a stuck rank stands at, and the RECV whose message it waits for, if any."""
    op = ops[position]
    text = format_op(op)
    wanted = input_key(op)
    if wanted is not None:
        posted = [
            o for o in ops[:position] if o.kind in (OpKind.RECV_F, OpKind.RECV_B) and message_key(o) == wanted
        ]
        if posted:
            text += f" for {format_op(posted[0])}"
    return text


def _memory(
    changes: list[list[tuple[float, int, float]]],
) -> tuple[list[float], list[list[tuple[float, float]]]]:
    """Peak and curve of each rank from its changes in time order. A copy ends at a time the rank
    has not reached when it is replayed, so the changes are sorted; at equal times they keep the
    replay order (a copy that ends as an F starts frees first)."""
    peaks: list[float] = []
    curves: list[list[tuple[float, float]]] = []
    for rank_changes in changes:
        level, peak, curve = 0.0, 0.0, [(0.0, 0.0)]
        for time, _, delta in sorted(rank_changes):
            level += delta
            peak = max(peak, level)
            curve.append((time, level))
        peaks.append(peak)
        curves.append(curve)
    return peaks, curves
