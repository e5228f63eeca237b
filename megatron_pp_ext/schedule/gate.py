"""Where a rank may still wait for the previous optimizer step's global check: the validation gate.

Under optimizer post-validation (Zero Bubble, section 4) a rank steps on the partial gradient
state and starts its next iteration at once; the global check (NaN/inf, clipping) arrives later.
The next iteration may run with the optimistic weights only as long as a failed check can still
be undone, i.e. while the rank has run forward work only: no gradient of the new iteration
exists yet (the old one is still in the buffers, needed by a redo of the step), and forwards can
simply be run again. So each rank waits for the global check right before its first op that is
not a forward (F, or the SEND_F / RECV_F of a forward activation): its *gate*.

If the check failed, every rank (they all see the same all-reduced state) rolls its step back,
redoes it, and restarts the iteration from its first op. For that the gates must form a
*consistent cut* of the schedule: no message received before the receiver's gate was sent after
the sender's gate (a restarted sender would send it again, to a receiver that already took the
first copy). :func:`validation_gate` moves gates earlier until that holds. Messages sent before
the sender's gate and received after the receiver's gate are *in flight* at the cut: a restarted
receiver takes them off the channel first and drops them (channels keep their order), then the
restarted sender's new copies follow.

Pure Python, like the rest of the schedule core.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Op, OpKind, Schedule, matching_op

# What may run before the gate: forward compute and the activations it sends and receives.
FORWARD_SIDE = frozenset({OpKind.F, OpKind.SEND_F, OpKind.RECV_F})


@dataclass(frozen=True)
class ValidationGate:
    """Per rank of a lowered schedule: the position of the gate (the rank waits for the global
    check before running the op there; ``len(ops)`` means after its last op) and the RECV ops
    after the gate whose message was sent before the sender's gate (to drop on a restart)."""

    positions: list[int]
    in_flight: list[list[Op]]

    def forward_ops_before(self, schedule: Schedule, rank: int) -> int:
        """How many forward compute ops the rank runs before its gate (its optimistic work)."""
        return sum(op.kind == OpKind.F for op in schedule.ranks[rank][: self.positions[rank]])


def validation_gate(schedule: Schedule) -> ValidationGate:
    """The latest consistent gate of every rank of the lowered ``schedule`` (see the module)."""
    if schedule.pp > 1 and not schedule.is_lowered:  # (one rank sends nothing: lowered as it is)
        raise ValueError("validation_gate needs a lowered schedule (schedule.lowering.lower)")
    ranks = schedule.ranks
    positions = [_first_not_forward(ops) for ops in ranks]
    send_position = {
        (rank, op.kind, op.stage, op.microbatch, op.slice): position
        for rank, ops in enumerate(ranks)
        for position, op in enumerate(ops)
        if op.kind == OpKind.SEND_F
    }

    def sent_at(receive: Op) -> int:
        send = matching_op(receive)
        key = (receive.peer, send.kind, send.stage, send.microbatch, send.slice)
        if key not in send_position:
            raise ValueError(f"{receive}: rank {receive.peer} has no matching {send.kind.value}")
        return send_position[key]

    changed = True
    while changed:  # each pass only moves gates earlier, so this ends
        changed = False
        for rank, ops in enumerate(ranks):
            for position in range(positions[rank]):
                op = ops[position]
                if op.kind == OpKind.RECV_F and sent_at(op) >= positions[op.peer]:
                    positions[rank] = position  # its sender's restart would send it again
                    changed = True
                    break
    in_flight = [
        [op for op in ops[positions[rank] :] if op.kind == OpKind.RECV_F and sent_at(op) < positions[op.peer]]
        for rank, ops in enumerate(ranks)
    ]
    return ValidationGate(positions, in_flight)


def gate_at_start(lowered: Schedule, attention_redistribution: bool = False) -> bool:
    """Whether every rank takes the gate before its first op instead: steps whose setup
    communicates or moves state that a restart would have to undo (vocabulary collectives,
    activation copies, SlimPipe's attention redistribution)."""
    return (
        lowered.vocab_parallel != "none"
        or any(op.is_copy for ops in lowered.ranks for op in ops)
        or (lowered.slices > 1 and attention_redistribution)
    )


def _first_not_forward(ops: list[Op]) -> int:
    for position, op in enumerate(ops):
        if op.kind not in FORWARD_SIDE:
            return position
    return len(ops)
