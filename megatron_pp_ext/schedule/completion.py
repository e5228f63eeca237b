"""NCCL's in-order completion, timed: when each message of a replay completes on a GPU.

With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a GPU completes its communication in the order it was
launched, across all its communicators (docs/nccl.md, rule 3), and a send of an activation is too
large to go out before its receive is posted (rendezvous). The plain replay lets sends go out the
moment their data is computed; under these rules a send also waits until its receiver has reached
the receive, and everything its rank launched after it waits behind it. ``message_order.py``
orders the launches so that this never hangs; this module says how long it makes ranks wait.

:class:`InOrderQueues` keeps one launch queue per rank. An operation begins once it has been
launched and the one before it on its rank has completed. A message completes when its SEND and
its RECV have both begun, plus the message's latency; a vocabulary collective when every rank's
copy has begun and its channel's previous collective has completed, plus its duration. The
replay (``replay.py``) launches a SEND when the op producing it ends (a GPU's send waits for its
data), a collective when its rank reaches it, and a RECV when the rank's host reaches it, and
starts the op that consumes a message or a collective once it has completed. Where the host is:

* ``IN_ORDER`` (NCCL on a GPU): ahead of the device. It launches kernels without waiting for
  them and stops only where it waits for a message (the runtime polls the receive,
  ``p2p.PipeComm.wait_work``) or at a hold (a validation gate), so a RECV is launched once the
  messages its rank consumed before it have arrived;
* ``IN_ORDER_SYNC`` (``--pp-emulate-nccl`` on gloo): the host computes, so a RECV is launched
  when the rank gets there, after the compute ops before it.

Pure Python, like the rest of the schedule core.
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .ir import Op, OpKind


@dataclass
class Launch:
    """One launched operation of one rank: a SEND, a RECV or a vocabulary collective."""

    rank: int
    op: Op
    time: float  # when the host launched it


Completed = tuple[Launch, float]  # an operation and when it completed

FREE = "free"  # sends never wait: gloo without emulation
IN_ORDER = "in-order"  # NCCL on a GPU: the host launches a receive ahead of the device
IN_ORDER_SYNC = "in-order-sync"  # --pp-emulate-nccl on gloo: the host is the device
COMPLETIONS = (FREE, IN_ORDER, IN_ORDER_SYNC)


class InOrderQueues:
    """Every rank's launch queue. ``key(op)`` names a message the same on both ends;
    ``latency(send)`` is its time on the wire; ``issue(rank, op, time)`` hands a collective
    that begins to the replay's collective channels (what it returns is not used), which say when
    it completes (``completion_of(op)``: None while some rank has not begun it)."""

    def __init__(
        self,
        pp: int,
        key: Callable[[Op], tuple],
        latency: Callable[[Op], float],
        issue: Callable[[int, Op, float], object],
        completion_of: Callable[[Op], float | None],
    ) -> None:
        self.queues: list[deque[Launch]] = [deque() for _ in range(pp)]
        self.free = [0.0] * pp  # when each rank's last completed operation completed
        self.issued: set[int] = set()  # id of a head collective handed to the channels
        self.key, self.latency, self.issue, self.completion_of = key, latency, issue, completion_of

    def launch(self, rank: int, op: Op, time: float) -> list[Completed]:
        """``rank`` launches ``op`` at ``time``; return what completed because of it."""
        self.queues[rank].append(Launch(rank, op, time))
        return self.advance([rank]) if len(self.queues[rank]) == 1 else []

    def begin(self, rank: int) -> float:
        """When the head of ``rank``'s queue begins: launched, and its predecessor completed."""
        return max(self.queues[rank][0].time, self.free[rank])

    def advance(self, ranks: list[int]) -> list[Completed]:
        """Complete whatever can complete, starting from the heads of ``ranks``' queues."""
        done: list[Completed] = []
        todo = deque(ranks)
        while todo:
            rank = todo.popleft()
            if not self.queues[rank]:
                continue
            head = self.queues[rank][0]
            if head.op.is_collective:
                todo.extend(self._collective(head, done))
            else:
                todo.extend(self._message(head, done))
        return done

    def _message(self, head: Launch, done: list[Completed]) -> list[int]:
        peer = self.queues[head.op.peer]
        if not peer or self.key(peer[0].op) != self.key(head.op):
            return []  # the other end is not at its head yet: it will come back here
        send, recv = (head, peer[0]) if head.op.kind in (OpKind.SEND_F, OpKind.SEND_B) else (peer[0], head)
        end = max(self.begin(send.rank), self.begin(recv.rank)) + self.latency(send.op)
        for item in (send, recv):
            self._pop(item, end, done)
        return [send.rank, recv.rank]

    def _collective(self, head: Launch, done: list[Completed]) -> list[int]:
        if id(head) not in self.issued:
            self.issued.add(id(head))
            self.issue(head.rank, head.op, self.begin(head.rank))
        end = self.completion_of(head.op)
        if end is None:
            return []
        for queue in self.queues:  # every rank's copy completes together
            item = queue[0] if queue else None
            if item is not None and id(item) in self.issued and self.completion_of(item.op) is not None:
                self.issued.discard(id(item))
                self._pop(item, self.completion_of(item.op), done)
        return list(range(len(self.queues)))

    def _pop(self, item: Launch, end: float, done: list[Completed]) -> None:
        self.queues[item.rank].popleft()
        self.free[item.rank] = end
        done.append((item, end))

    def stuck(self) -> list[str]:
        """What each rank's queue waits at, for a deadlock message."""
        return [f"rank {rank}'s {queue[0].op}" for rank, queue in enumerate(self.queues) if queue]


def add_completion_argument(parser: argparse.ArgumentParser, gloo: bool = True) -> None:
    """``--comm-completion``, for the commands that replay: simulate, and plan (which predicts
    GPUs: ``gloo=False`` leaves the emulated host out)."""
    choices = COMPLETIONS if gloo else (FREE, IN_ORDER)
    sync = ", in-order-sync (the same with the host computing: gloo under --pp-emulate-nccl)" if gloo else ""
    parser.add_argument(
        "--comm-completion",
        choices=choices,
        default=FREE,
        help="when a message completes: free (a send never waits; the default), in-order (NCCL on a "
        "GPU: each rank's messages one after another in launch order, a send together with its "
        f"receive){sync}",
    )
