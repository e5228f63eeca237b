"""One global order for a step's messages, so that NCCL's in-order completion cannot hang it.

With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a GPU completes its communication in launch order, across
all its communicators (docs/nccl.md, rule 3). Two ranks then hang when one launches A before B and
its peer B before A: rank r sends F(k) to rank r+1 and then posts the receive of B(j) from it,
while rank r+1 sends B(j) first and receives F(k) after. Megatron's p2p_communication avoids it
for 1F1B by batching each adjacent send and receive; that does not cover V shapes, interleaving
at k = 2p or the vocabulary collectives. What covers every schedule: if every rank launches its
messages in the order of one global list, the first message of that list not yet completed has
both ends at the head of their queues, so it completes, whatever the timing.

The list comes from a replay of the schedule (``replay.replay``, uniform costs): a message's
place is the time its SEND goes out, a collective's the time its last member issues it. Each rank
keeps its compute ops and sends where they are (a send right after the op that produces it) and
moves each RECV and each vocabulary collective to its place in the list:

* a RECV moves earlier only as far as it must: before the first send that comes after its message
  in the list (else before its consumer, as now); the runtime posts the receive there and waits
  for it when the consumer runs. Posting as late as that keeps each rank's queue free (a posted
  receive holds every later launch back) and the validation gate of post-validation where it was;
* a collective moves later, after every compute op that ends before its last member issues it
  (what it sends is computed before that; what waits for it starts after), and no further: its
  last member issues it then, and later would hold the others back.

Ties in time are broken the same way on every rank: computes before collectives before sends,
then by zero-time depth (below), then by sender and position. Where computes take no time (a
stage of the embedding alone, at FLOP costs), a send that such a compute forwards goes out at the
very time of the message it waited for, and must still come after it: its depth is one more
(``_zero_time_depths``). Where every compute takes time, every depth is 0. Only the replay decides
the list, so every rank derives the same one from the same schedule.

SlimPipe's attention redistribution (``exchanges``: the plan of ``redistribute.delegation_plan``)
adds one more kind of message: in a lock-step slot the heavy op and the light op of a pair talk
while they run (the heavy one's requests, the light one's answers). The pair's exchange takes the
place of the slot's end in the list, on both ranks: the two ops become fixed items with that key,
so every receive and collective that comes before it in the list is posted before either op and
none after it. The replay then uses the slots' own timing (every compute one unit, messages
instant: ``slots.py``, as ``redistribute.lockstep_slots`` pairs them), so the two ops of a pair
end at the same time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import pairs
from .costs import UniformCosts
from .ir import COLLECTIVE_KINDS, Op, OpKind, Schedule
from .replay import input_key, message_key, replay
from .slots import slot_costs
from .vocab import CHANNELS, Layout, default_costs

SENDS = frozenset({OpKind.SEND_F, OpKind.SEND_B})
RECVS = frozenset({OpKind.RECV_F, OpKind.RECV_B})
# classes of a key (time, class, ...): at one time, computes end before attention exchanges
# complete before collectives complete before sends go out
COMPUTE, EXCHANGE, COLLECTIVE, SEND = 1, 2, 3, 4

Key = tuple[Any, ...]


def order_messages(
    schedule: Schedule, costs: Any = None, exchanges: Mapping[tuple[int, Op], Any] | None = None
) -> Schedule:
    """``schedule`` (lowered) with its RECVs and vocabulary collectives moved so that every rank
    launches its communication in one global order. ``costs``: the replay's cost model (default:
    uniform, with the vocabulary passes' own costs; lock-step slots with ``exchanges``); every
    rank must use the same. ``exchanges``: ``{(rank, heavy op): delegation}`` (with ``.partner``
    and ``.light``), SlimPipe's plan for this schedule."""
    if schedule.pp < 2 or not schedule.is_lowered:
        return schedule
    if costs is None:
        costs = slot_costs(schedule) if exchanges else _ordering_costs(schedule)
    result = replay(schedule, costs)
    compute_end = {(event.rank, event.op): event.end for event in result.events}
    depths = _zero_time_depths(schedule, result.events)
    completion = {(event.rank, event.op): event.end for event in result.collectives}
    channel_index: dict[tuple[int, str], int] = {}
    exchange_keys = _exchange_keys(schedule, exchanges or {}, compute_end)

    sends: dict[tuple[str, int, int, int], Key] = {}
    fixed_keys: list[list[Key | None]] = []
    for rank, ops in enumerate(schedule.ranks):
        keys: list[Key | None] = []
        last_end, last_depth = 0.0, 0
        for position, op in enumerate(ops):
            if op.kind in SENDS:
                sends[message_key(op)] = (last_end, SEND, last_depth, rank, position)
                keys.append(sends[message_key(op)])
            elif (rank, op) in compute_end:
                last_end, last_depth = compute_end[(rank, op)], depths[(rank, op)]
                keys.append(exchange_keys.get((rank, op), (last_end, COMPUTE)))
            else:
                keys.append(None)
        fixed_keys.append(keys)

    layout = Layout.of(schedule)
    partners = pairs.first_ops(schedule)  # an overlapped pair's first op waits for both inputs
    ranks: list[list[Op]] = []
    for rank, ops in enumerate(schedule.ranks):
        movable: list[tuple[Key, Op]] = []
        for op in ops:
            if op.kind in RECVS:
                movable.append((sends[message_key(op)], op))
            elif op.kind in COLLECTIVE_KINDS:
                channel = CHANNELS[op.kind]
                index = channel_index.get((rank, channel), 0)
                channel_index[(rank, channel)] = index + 1
                movable.append(((completion[(rank, op)], COLLECTIVE, channel, index), op))
        movable.sort(key=lambda item: item[0])
        ranks.append(_merge(ops, fixed_keys[rank], movable, layout, rank, partners[rank]))
    return schedule.with_ranks(ranks)


def _merge(
    ops: list[Op],
    keys: list[Key | None],
    movable: list[tuple[Key, Op]],
    layout: Layout,
    rank: int,
    partners: Mapping[Any, Any] | None = None,
) -> list[Op]:
    """One rank's ops with its movable ops (sorted by key) put back: each as late as the order
    allows (a receive right before the send or attention exchange that must follow it, or its
    consumer: as Megatron posts it, and after the validation gate of the forwards before it),
    except a collective, issued before the first compute that ends after it completes (its last
    member reaches it then: issuing it later would hold every other member back)."""
    where = {_consumed_key(op): index for index, (_, op) in enumerate(movable)}
    ordered: list[Op] = []
    taken = 0
    for op, key in zip(ops, keys):
        if op.kind in RECVS or op.kind in COLLECTIVE_KINDS:
            continue
        upto = taken - 1
        if key is not None:
            talks = op.kind in SENDS or key[1] == EXCHANGE  # launches communication itself
            index = taken
            while index < len(movable) and movable[index][0] < key:
                if talks or movable[index][1].kind in COLLECTIVE_KINDS:
                    upto = index
                index += 1
        needs = _consumes(op, layout, rank)
        partner = (partners or {}).get(pairs.key_of(op)) if op.is_compute else None
        if partner is not None:  # the pair's first op: its partner's input is posted before it too
            needs += _consumes(pairs.op_of(partner), layout, rank)
        for needed in needs:
            upto = max(upto, where.get(needed, -1))
        ordered.extend(item for _, item in movable[taken : upto + 1])
        taken = max(taken, upto + 1)
        ordered.append(op)
    ordered.extend(item for _, item in movable[taken:])
    return ordered


def _zero_time_depths(schedule: Schedule, events: list[Any]) -> dict[tuple[int, Op], int]:
    """(rank, compute) -> how many messages forwarded at one instant lead to it: 0 for a compute
    that takes time; for one that takes none, one more than the compute that sent the message it
    consumes when that message went out at its own end time, and at least as many as the compute
    before it on its rank when that one ended then. ``events`` are the replay's, in the order it
    ran them: a compute runs once its inputs have arrived, so every source comes before."""
    sender: dict[tuple[str, int, int, int], tuple[int, Op]] = {}  # message -> compute before its SEND
    ran = {(event.rank, event.op) for event in events}
    for rank, ops in enumerate(schedule.ranks):
        last: Op | None = None
        for op in ops:
            if op.kind in SENDS and last is not None:
                sender[message_key(op)] = (rank, last)
            elif (rank, op) in ran:
                last = op
    end = {(event.rank, event.op): event.end for event in events}
    depths: dict[tuple[int, Op], int] = {}
    previous: dict[int, tuple[float, int]] = {}  # rank -> (end, depth) of its last compute
    for event in events:
        depth = 0
        if event.end == event.start:
            before = previous.get(event.rank)
            if before is not None and before[0] == event.end:
                depth = before[1]
            source = sender.get(input_key(event.op)) if input_key(event.op) else None
            if source is not None and end[source] == event.end:
                depth = max(depth, depths[source] + 1)
        depths[(event.rank, event.op)] = depth
        previous[event.rank] = (event.end, depth)
    return depths


def _consumed_key(op: Op) -> tuple[Any, ...]:
    """How a consumer names a movable op: a message by its key, a collective by kind and unit."""
    if op.kind in RECVS:
        return message_key(op)
    return (op.kind, op.microbatch, op.slice)


def _consumes(op: Op, layout: Layout, rank: int) -> list[tuple[Any, ...]]:
    """The movable ops a fixed op waits for: a compute's input message, a collective's result."""
    message = input_key(op)
    found: list[tuple[Any, ...]] = [] if message is None else [message]
    if op.is_compute or op.kind in (OpKind.S, OpKind.T):
        needed = layout.waits_for(op, rank)
        if needed is not None:
            found.append((needed.kind, needed.microbatch, needed.slice))
    return found


def _exchange_keys(
    schedule: Schedule, exchanges: Mapping[tuple[int, Op], Any], compute_end: dict[tuple[int, Op], float]
) -> dict[tuple[int, Op], Key]:
    """(rank, op) -> the key of its attention exchange, the same for the heavy op and the light
    op of a pair: the slot's end, then the heavy rank and op. Both must end together."""
    keys: dict[tuple[int, Op], Key] = {}
    for (rank, heavy), delegation in exchanges.items():
        light = (delegation.partner, delegation.light)
        end = compute_end.get((rank, heavy))
        if end is None or compute_end.get(light) != end:
            raise ValueError(
                f"attention exchange of rank {rank}'s {heavy} with rank {light[0]}'s {light[1]}: the "
                "two ops do not run in one lock-step slot of this schedule"
            )
        key = (end, EXCHANGE, rank, heavy.kind.value, heavy.stage, heavy.microbatch, heavy.slice)
        keys[(rank, heavy)] = keys[light] = key
    return keys


def _ordering_costs(schedule: Schedule) -> Any:
    """Uniform costs; the vocabulary passes' S and T cost their GEMMs (a compute that takes no
    time could not be told apart from the collective it waits for)."""
    if schedule.vocab_parallel != "none":
        return default_costs(schedule, schedule.vocab_parallel)
    return UniformCosts(
        num_stages=schedule.num_stages, num_slices=schedule.slices, chunks_per_rank=schedule.vpp
    )
