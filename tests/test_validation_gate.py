"""The validation gate of optimizer post-validation (schedule/gate.py) and the partial-state chain
(schedule/iterations.py ``completion_order``), on every registered generator.

A rank runs only forward work before its gate; the gates must form a consistent cut (nothing
received before a gate was sent after one), the messages in flight at the cut are exactly what
a restarted receiver has to drop, and after dropping them every channel is empty so the redo of
the iteration starts clean. Everything here is recomputed independently of gate.py.
"""

from __future__ import annotations

from collections import deque
from functools import cache

import pytest

from megatron_pp_ext.schedule.gate import FORWARD_SIDE, ValidationGate, validation_gate
from megatron_pp_ext.schedule.generators import SCHEDULES, RequestError, generate
from megatron_pp_ext.schedule.ir import Op, OpKind, Schedule, matching_op
from megatron_pp_ext.schedule.iterations import completion_order
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.offload import OffloadPolicy, apply_offload
from megatron_pp_ext.schedule.vocab import add_vocab_passes

# The test's own idea of "forward work", so that a change to gate.FORWARD_SIDE is caught.
FORWARD = frozenset({OpKind.F, OpKind.SEND_F, OpKind.RECV_F})
SIZES = [(pp, m) for pp in (2, 3, 4) for m in (pp, 2 * pp, 2 * pp + 1)]
SLICED = {"seq1f1b", "slimpipe", "seq1f1b-interleaved", "slimpipe-interleaved"}
VARIANTS = ("plain", "offload", "vocab-1")

Channel = tuple[int, int]  # (sender, receiver)
Message = tuple[int, int, int]  # the (stage, microbatch, slice) of the SEND_F that carries it

# Every size for the generators' own schedules; the offload and vocab variants at m = 2p only.
CASES = [
    pytest.param(name, pp, m, variant, id=f"{name}-pp{pp}-m{m}-{variant}")
    for variant in VARIANTS
    for name in SCHEDULES
    for pp, m in SIZES
    if variant == "plain" or m == 2 * pp
]


def _slices(name: str, pp: int) -> int:
    """Sliced generators get 2 slices per microbatch (at least what the registry demands)."""
    spec = SCHEDULES[name]
    return max(2 if name in SLICED else 1, spec.min_slices(pp, spec.default_vpp))


@cache
def _generated(name: str, pp: int, m: int) -> Schedule:
    """The generator's schedule; skips only a request below the registry's documented minimum
    number of microbatches (dualpipev needs 2p), and re-raises any other rejection."""
    spec, slices = SCHEDULES[name], _slices(name, pp)
    try:
        return generate(name, pp, m, slices=slices)
    except RequestError:
        if m >= spec.min_microbatches(pp, spec.default_vpp, slices):
            raise
        pytest.skip(f"{name} documents at least {spec.min_microbatches(pp, spec.default_vpp, slices)} mbs")


@cache
def _lowered(name: str, pp: int, m: int, variant: str = "plain") -> Schedule:
    """The lowered schedule, with every unit offloaded or vocab-1 passes for the variants."""
    schedule = _generated(name, pp, m)
    if variant == "offload":
        schedule = apply_offload(schedule, OffloadPolicy("full"))
    elif variant == "vocab-1":
        schedule = add_vocab_passes(schedule, "vocab-1")
    return lower(schedule)


def _first_not_forward(ops: list[Op]) -> int:
    return next((position for position, op in enumerate(ops) if op.kind not in FORWARD), len(ops))


def _message(op: Op) -> tuple[int, Message]:
    """(sender, message) of a RECV_F: the key its SEND_F has in :func:`_send_positions`."""
    assert op.kind == OpKind.RECV_F and op.peer is not None
    return op.peer, matching_op(op).unit


def _send_positions(schedule: Schedule) -> dict[tuple[int, Message], tuple[int, int]]:
    """(sender, message) -> (receiver, position of the SEND_F on the sender)."""
    positions = {}
    for rank, ops in enumerate(schedule.ranks):
        for position, op in enumerate(ops):
            if op.kind == OpKind.SEND_F:
                assert op.peer is not None and op.peer != rank
                key = (rank, op.unit)
                assert key not in positions, f"message {key} sent twice"
                positions[key] = (op.peer, position)
    return positions


def _sent(schedule: Schedule, channel: Channel, end: int | None = None) -> list[Message]:
    """Messages the sender puts on ``channel`` before position ``end`` (all when None), in order."""
    sender, receiver = channel
    ops = schedule.ranks[sender][:end]
    return [op.unit for op in ops if op.kind == OpKind.SEND_F and op.peer == receiver]


def _received(schedule: Schedule, channel: Channel, end: int | None = None) -> list[Op]:
    """RECV_F ops the receiver runs on ``channel`` before position ``end`` (all when None)."""
    sender, receiver = channel
    ops = schedule.ranks[receiver][:end]
    return [op for op in ops if op.kind == OpKind.RECV_F and op.peer == sender]


def _channels(schedule: Schedule) -> set[Channel]:
    """Every (sender, receiver) pair that carries at least one activation."""
    channels = set()
    for rank, ops in enumerate(schedule.ranks):
        channels |= {(rank, op.peer) for op in ops if op.kind == OpKind.SEND_F and op.peer is not None}
    return channels


def _is_consistent(schedule: Schedule, cut: list[int]) -> bool:
    """No RECV_F before the receiver's cut whose SEND_F is at or after the sender's cut."""
    sends = _send_positions(schedule)
    for rank, ops in enumerate(schedule.ranks):
        for op in ops[: cut[rank]]:
            if op.kind == OpKind.RECV_F:
                receiver, position = sends[_message(op)]
                assert receiver == rank
                if position >= cut[op.peer]:
                    return False
    return True


def _latest_consistent_cut(schedule: Schedule, limits: list[int]) -> list[int]:
    """Run the schedule from the bottom up to ``limits``: a RECV_F runs once its SEND_F ran. What
    runs is the largest consistent cut below the limits (a top-down fixed point, as gate.py
    computes it, must land on the same cut for a deadlock-free schedule)."""
    sends = _send_positions(schedule)
    done = [0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(schedule.ranks):
            while done[rank] < limits[rank]:
                op = ops[done[rank]]
                if op.kind == OpKind.RECV_F and sends[_message(op)][1] >= done[op.peer]:
                    break
                done[rank] += 1
                progress = True
    return done


def _gate(name: str, pp: int, m: int, variant: str = "plain") -> tuple[Schedule, ValidationGate]:
    schedule = _lowered(name, pp, m, variant)
    return schedule, validation_gate(schedule)


# ---- 1. the gates: forward work only, a consistent cut, the latest one ---------------------------


def test_forward_side_is_forward_compute_and_its_activations() -> None:
    """Anything else before the gate (a B, a W, a copy, a collective) could not be undone."""
    assert FORWARD_SIDE == FORWARD


@pytest.mark.parametrize("name, pp, m, variant", CASES)
def test_gates_are_a_consistent_cut_of_forward_work(name: str, pp: int, m: int, variant: str) -> None:
    """A restart redoes only forwards, and never makes a sender send twice what was taken once."""
    schedule, gate = _gate(name, pp, m, variant)
    first = [_first_not_forward(ops) for ops in schedule.ranks]
    sends = _send_positions(schedule)
    assert len(gate.positions) == len(gate.in_flight) == pp
    for rank, ops in enumerate(schedule.ranks):
        at = gate.positions[rank]
        assert 0 <= at <= first[rank]
        assert all(op.kind in FORWARD for op in ops[:at]), (rank, [str(op) for op in ops[:at]])
        for op in ops[:at]:
            if op.kind == OpKind.RECV_F:
                assert sends[_message(op)][1] < gate.positions[op.peer], (rank, str(op))
    assert _is_consistent(schedule, gate.positions)
    if _is_consistent(schedule, first):  # no move needed: the gate is at the first non-forward
        assert gate.positions == first
    assert gate.positions == _latest_consistent_cut(schedule, first)  # moved no further than needed


@pytest.mark.parametrize("pp, m", SIZES)
def test_1f1b_gates_at_the_first_backward(pp: int, m: int) -> None:
    """1F1B's warm-up forwards are received in the order they were sent: nothing to move; each
    rank waits right before its first backward (the RECV_B feeding it, none on the last rank)."""
    schedule, gate = _gate("1f1b", pp, m)
    assert gate.positions == [_first_not_forward(ops) for ops in schedule.ranks]
    kinds = [schedule.ranks[rank][at].kind for rank, at in enumerate(gate.positions)]
    assert kinds == [OpKind.RECV_B] * (pp - 1) + [OpKind.BW]


def test_slimpipe_interleaved_needs_a_consistency_move() -> None:
    """Rank 0 receives chunk 1's first input from rank 3 after its last slice's forward, but rank 3
    sends it only after its own first backward: rank 0's gate moves back to that RECV_F."""
    schedule, gate = _gate("slimpipe-interleaved", 4, 8)
    first = [_first_not_forward(ops) for ops in schedule.ranks]
    assert not _is_consistent(schedule, first)
    assert first == [31, 37, 32, 20]
    assert gate.positions == [28, 36, 32, 20]
    assert str(schedule.ranks[0][28]) == "RECV_F4:1<3"


# ---- 2. in flight at the cut -------------------------------------------------------------------


@pytest.mark.parametrize("name, pp, m, variant", CASES)
def test_in_flight_is_what_was_sent_before_a_gate_and_not_received(
    name: str, pp: int, m: int, variant: str
) -> None:
    """Exactly these RECV_F ops must be drained by a restarted receiver, in its list order."""
    schedule, gate = _gate(name, pp, m, variant)
    pending: set[tuple[int, Message]] = set()
    for channel in _channels(schedule):
        sender, receiver = channel
        sent = set(_sent(schedule, channel, gate.positions[sender]))
        received = {_message(op)[1] for op in _received(schedule, channel, gate.positions[receiver])}
        pending |= {(sender, message) for message in sent - received}
    expected = [
        [op for op in ops if op.kind == OpKind.RECV_F and _message(op) in pending] for ops in schedule.ranks
    ]
    assert gate.in_flight == expected
    for rank, ops in enumerate(schedule.ranks):
        assert all(ops.index(op) >= gate.positions[rank] for op in gate.in_flight[rank])


# ---- 3. a restart leaves every channel empty ----------------------------------------------------


@pytest.mark.parametrize("name, pp, m, variant", CASES)
def test_restart_drains_every_channel_and_the_redo_starts_clean(
    name: str, pp: int, m: int, variant: str
) -> None:
    """FIFO channels: the first attempt up to the gates, the receiver drops ``in_flight``, and the
    redo of the whole iteration then pairs every SEND_F with its own RECV_F."""
    schedule, gate = _gate(name, pp, m, variant)
    for channel in sorted(_channels(schedule)):
        sender, receiver = channel
        fifo: deque[Message] = deque(_sent(schedule, channel, gate.positions[sender]))
        for op in _received(schedule, channel, gate.positions[receiver]):  # first attempt
            assert fifo, (channel, f"{op} received before the gate was never sent before one")
            assert fifo.popleft() == _message(op)[1], (channel, str(op))
        for op in gate.in_flight[receiver]:  # the restarted receiver drops what is still in flight
            if op.peer == sender:
                assert fifo, (channel, f"{op} is in flight but nothing is left on the channel")
                assert fifo.popleft() == _message(op)[1], (channel, str(op))
        assert not fifo, (channel, f"left on the channel after the drain: {list(fifo)}")
        fifo.extend(_sent(schedule, channel))  # the redo, from every rank's first op
        for op in _received(schedule, channel):
            assert fifo and fifo.popleft() == _message(op)[1], (channel, str(op))
        assert not fifo


# ---- 4. where the gate matters ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zb-h2", "v-zb"])
def test_zero_bubble_schedules_run_forwards_before_their_gate(name: str) -> None:
    """ZB-H2 and V-ZB are where post-validation removes the boundary bubble: every rank has
    optimistic forward work to overlap with the global check."""
    schedule, gate = _gate(name, 4, 8)
    assert all(at > 0 for at in gate.positions), gate.positions
    assert all(gate.forward_ops_before(schedule, rank) >= 1 for rank in range(4))


def test_1f1b_gates_and_optimistic_forwards() -> None:
    """1F1B pp=4 m=8: rank r runs its p-r warm-up forwards before the gate. Ranks 1 and 2 post the
    receive of rank r-1's last warm-up activation before they send their own (the step's message
    order, as Megatron's send_forward_recv_forward), so it is not in flight at the cut; rank 3
    takes its second input only after its first backward, after its gate."""
    schedule, gate = _gate("1f1b", 4, 8)
    assert gate.positions == [8, 10, 7, 2]
    assert [gate.forward_ops_before(schedule, rank) for rank in range(4)] == [4, 3, 2, 1]
    assert [[str(op) for op in ops] for ops in gate.in_flight] == [[], [], [], ["RECV_F3:1<2"]]


def test_zb_h2_runs_more_optimistic_forwards_than_1f1b() -> None:
    """H2's longer warm-up is what post-validation lets run ahead of the check."""
    h2, h2_gate = _gate("zb-h2", 4, 8)
    plain, plain_gate = _gate("1f1b", 4, 8)
    h2_forwards = [h2_gate.forward_ops_before(h2, rank) for rank in range(4)]
    plain_forwards = [plain_gate.forward_ops_before(plain, rank) for rank in range(4)]
    assert all(a >= b for a, b in zip(h2_forwards, plain_forwards))
    assert sum(h2_forwards) > sum(plain_forwards)


# ---- 5. input checking --------------------------------------------------------------------------


def test_validation_gate_needs_a_lowered_schedule() -> None:
    """Without the SEND/RECV ops there is no cut to check."""
    with pytest.raises(ValueError, match="lowered"):
        validation_gate(generate("1f1b", 4, 8))


# ---- 6. the partial state's chain ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, order",
    [("zb-h2", [0, 1, 2, 3]), ("v-zb", [0, 1, 2, 3]), ("1f1b", [3, 2, 1, 0]), ("zb-h1", [3, 2, 1, 0])],
)
def test_completion_order_pp4_m8(name: str, order: list[int]) -> None:
    """H2 and V-ZB end on rank 0 first (the paper's chain, up); 1F1B and H1 on rank p-1 (down)."""
    assert completion_order(generate(name, 4, 8)) == order


@pytest.mark.parametrize("name, pp, m", [case.values[:3] for case in CASES if case.values[3] == "plain"])
def test_completion_order_is_a_permutation_of_the_ranks(name: str, pp: int, m: int) -> None:
    """The chain visits every rank exactly once."""
    assert sorted(completion_order(_generated(name, pp, m))) == list(range(pp))
