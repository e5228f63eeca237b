"""Communicator creation: a warm-up in one global order, and NCCL's creation rule imposed on gloo.

NCCL creates a communicator at its first use and blocks every member there until all of them
arrive: a group's first collective, and for point-to-point each pair of a group (torch keeps one
2-rank communicator per pair). Two ranks whose first uses of two communicators come in opposite
orders hang (``schedule/nccl_check.py``, rule 1): every vocabulary-parallel schedule did, and the
interleaved sliced ones with k = 2p slices.

:meth:`Creation.warm_up` creates every communicator a step will use before the step, with one
tiny exchange each, in one order that every rank derives alike (collective groups, then pairs,
each sorted by global members and name). A rank touches only its own communicators, in that
order, so the first communicator of the order not yet created always has all its members at it:
the warm-up cannot hang, and the step creates nothing. A pair's exchange goes the way its channel
carries messages (``F-up`` from the lower rank, as Megatron's first ``send_forward``).

``emulate`` (``--pp-emulate-nccl``) imposes the rule on gloo, which connects everything at
``new_group``: a first use that was not warmed blocks until every member reaches its own first
use of the same communicator (a handshake on the pair, a monitored barrier on a group), so a bad
order hangs on CPU where NCCL would, until the deadline names the rank, the op, the communicator
and the peers it waited for. NCCL's other emulated rule, in-order completion, is
``launch_order.py``'s.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..schedule.ir import Schedule
from .peer_error import PeerError


class CreationError(PeerError):
    """A communicator's creation did not complete within the deadline (a peer never arrived)."""


class ScheduleMismatch(PeerError):
    """Two ranks of a pipeline resolved different schedules: their warm-up tokens disagree."""


@dataclass(frozen=True, order=True)
class Communicator:
    """One communicator: a collective group, or a pair of one point-to-point group. Ordered by
    (kind, global members, name): the global order of the warm-up."""

    kind: int  # 0: a collective group, 1: a point-to-point pair
    members: tuple[int, ...]  # global ranks
    name: str
    group: Any = field(default=None, compare=False, hash=False)
    sender: int | None = field(default=None, compare=False)  # a pair: the global rank that sends


class Creation:
    """Which communicators exist, for one pipeline's :class:`~.p2p.PipeComm`."""

    def __init__(self, comm: Any, emulate: bool = False) -> None:
        self.comm = comm
        self.emulate = emulate
        self.created: set[Communicator] = set()
        self._known: dict[tuple[Any, ...], Communicator] = {}  # built once: sends and receives ask often
        self.warm_up_seconds = 0.0
        # first uses outside a warm-up: (communicator, op); none while the runtime warms up
        self.lazy: list[tuple[str, str]] = []

    # ---- the communicators -----------------------------------------------------------------

    def pair(self, direction: str, sender: int, receiver: int) -> Communicator:
        """The communicator of pipeline ranks ``sender`` -> ``receiver`` on the channel group."""
        key = ("pair", direction, sender, receiver)
        if key not in self._known:
            way = "up" if receiver > sender else "down"
            ranks = self.comm.ranks
            name = f"p2p-{direction}-{way} pair {min(sender, receiver)}-{max(sender, receiver)}"
            members = tuple(sorted((ranks[sender], ranks[receiver])))
            group = self.comm.channel_group(direction, sender, receiver)
            self._known[key] = Communicator(1, members, name, group, ranks[sender])
        return self._known[key]

    def link(self, source: int, partner: int, group: Any) -> Communicator:
        """The pair communicator of an attention-redistribution link (its own 2-rank group)."""
        ranks = self.comm.ranks
        members = tuple(sorted((ranks[source], ranks[partner])))
        return Communicator(1, members, f"attention link {source}-{partner}", group, ranks[source])

    def group(self, name: str, group: Any) -> Communicator:
        """The communicator of a collective group, by the channel name it is used under."""
        key = ("group", name, group)  # the group itself: its id could be reused once it is gone
        if key not in self._known:
            members = tuple(sorted(dist.get_process_group_ranks(group)))
            self._known[key] = Communicator(0, members, name, group)
        return self._known[key]

    def pairs_of(self, lowered: Schedule) -> list[Communicator]:
        """The pairs the lowered schedule's SEND/RECV ops use (the same list on every rank)."""
        found = set()
        for rank, ops in enumerate(lowered.ranks):
            for op in ops:
                if op.is_comm and op.kind.value.startswith("SEND"):
                    found.add(self.pair(op.kind.value[-1], rank, op.peer))
        return sorted(found)

    # ---- creation --------------------------------------------------------------------------

    def use(self, communicator: Communicator, what: str) -> None:
        """Before ``what`` (an op) uses ``communicator``: under emulation, its creation."""
        if communicator in self.created:
            return
        self.lazy.append((communicator.name, what))
        if self.emulate:
            self._create(communicator, what)
        self.created.add(communicator)

    def warm_up(self, communicators: Iterable[Communicator], digest: int = 0) -> None:
        """Create this rank's communicators among ``communicators``, in the global order. With a
        ``digest`` (``Schedule.comm_digest`` of the step about to run), each pair's handshake
        carries it and both ends compare: a rank whose schedule differs (another version of the
        plugin, other flags on one node) is named here, not by a hang in mid-step."""
        me = dist.get_rank()
        start = time.monotonic()
        for communicator in sorted(set(communicators)):
            if me in communicator.members and communicator not in self.created:
                self._create(communicator, "the warm-up", digest)
                self.created.add(communicator)
        self.warm_up_seconds += time.monotonic() - start

    def _create(self, communicator: Communicator, what: str, digest: int = 0) -> None:
        """One tiny exchange over ``communicator`` that every member must join (a pair's carries
        ``digest`` both ways; 0: none to compare)."""
        deadline = self.comm.timeout_s
        me = dist.get_rank()
        others = [rank for rank in communicator.members if rank != me]
        theirs = 0
        try:
            if communicator.kind == 1:
                theirs = self._handshake(communicator, others[0], deadline, digest)
            elif self.comm.backend == "gloo":
                timeout = datetime.timedelta(seconds=deadline)
                dist.monitored_barrier(group=communicator.group, timeout=timeout, wait_all_ranks=True)
            else:
                token = torch.zeros(1, device=self.comm.device)
                work = dist.all_reduce(token, group=communicator.group, async_op=True)
                self.comm.wait_work(work, f"creating {communicator.name} with", others[0])
        except Exception as error:
            peers = ", ".join(str(self.comm.ranks.index(rank)) for rank in others if rank in self.comm.ranks)
            raise CreationError(
                f"rank {self.comm.rank}: {what} waits to create communicator {communicator.name} "
                f"(global ranks {list(communicator.members)}) for rank {peers or others} within "
                f"{deadline:.1f}s: a peer is creating another communicator first, or is gone ({error})"
            ) from error
        if digest and theirs and theirs != digest:
            peer = self.comm.ranks.index(others[0]) if others[0] in self.comm.ranks else others[0]
            raise ScheduleMismatch(
                f"rank {self.comm.rank}: pipeline rank {peer} resolved a different schedule for this "
                f"step (its messages' digest {theirs:016x}, here {digest:016x}), found creating "
                f"{communicator.name}: every rank must run the same megatron_pp_ext with the same "
                "--pp-* flags, model and batch; the first message where they differ would hang"
            )

    def _handshake(self, communicator: Communicator, peer: int, deadline: float, digest: int = 0) -> int:
        """The sender sends a token, the receiver answers: both block until the other arrives
        (the sender's first message goes the channel's way, as Megatron's first send does). The
        tokens carry each end's ``digest``; returns the peer's. They travel as the pipeline's
        messages do (host memory under gloo, where ranks may share a GPU)."""
        wire = self.comm.wire_device(self.comm.device)
        token = torch.tensor([digest], dtype=torch.int64, device=wire)
        answer = torch.zeros(1, dtype=torch.int64, device=wire)
        group = communicator.group
        peer_index = self.comm.ranks.index(peer)
        what = f"creating {communicator.name} with"
        if dist.get_rank() == communicator.sender:
            dist.isend(token, dst=peer, group=group).wait()
            self.comm.wait_work(dist.irecv(answer, src=peer, group=group), what, peer_index)
        else:
            self.comm.wait_work(dist.irecv(answer, src=peer, group=group), what, peer_index)
            dist.isend(token, dst=peer, group=group).wait()
        return int(answer.item())
