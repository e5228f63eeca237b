"""Point-to-point transfers between pipeline ranks, with a deadline on every wait.

Sends are asynchronous (``isend``; the buffer stays referenced until the transfer completes);
a receive is posted where the schedule puts it (``post_recv``) and waited for when its tensor is
needed. Every message goes on one of four process groups, one per channel kind:
(forward or backward) x (towards a higher or a lower rank). On each group a pair of ranks then
exchanges messages one way only, in the order the schedule validator checks, so NCCL (which
matches p2p messages in order and serialises a pair's traffic on one stream) cannot cross two
messages. Gloo (CPU) behaves the same way. What NCCL's rules still allow to hang, and what the
runtime does about it, is in docs/nccl.md: the schedule core checks it (``nccl_check.py``),
lowering orders each step's messages so that it cannot (``message_order.py``), and every
send and receive goes through ``launch`` (``launch_order.py``), which under ``emulate_nccl``
completes this rank's communication in launch order, as a GPU does.

A receive that does not complete within ``timeout_s`` — the peer died, hangs or never sends —
raises :class:`PeerError` naming this rank, the op and the peer, instead of hanging.

Under NCCL each pair of each group is a communicator of its own, created at its first use
(blocking until both ranks arrive): ``creation`` (``creation.py``) warms every pair a schedule
uses, and the runtime's other groups, before the step, in one global order; with
``emulate_nccl`` it imposes that creation rule on gloo too.

Gloo moves host memory only: with ranks computing on a GPU over gloo (``--distributed-backend
gloo``, several ranks sharing one GPU) every message is staged through host memory, copied out
before its send and in after its receive (:meth:`PipeComm.wire_device`).

Gloo send handles never report completion without a blocking ``wait()``, so on gloo one helper
thread per channel (direction, peer) waits on that channel's sends in order (``wait`` releases
the GIL) and marks each done; a send buffer is released as soon as it is out, which keeps the
activation accounting honest.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .creation import Creation
from .launch_order import Launcher
from .peer_error import PeerError

EMULATE_NCCL_VARIABLE = "MEGATRON_PP_EXT_EMULATE_NCCL"


@dataclass
class _PendingSend:
    work: dist.Work
    buffer: Tensor
    what: str
    peer: int
    on_done: Callable[[], None] | None
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _SendWaiter:
    """A daemon thread that waits on gloo sends in issue order and marks each finished."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._queue: queue.Queue[_PendingSend | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="pipe-send-waiter", daemon=True)
        self._thread.start()

    def watch(self, pending: _PendingSend) -> None:
        self._queue.put(pending)

    def _loop(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                pending.work.wait(self._timeout)
            except BaseException as error:  # reported by the main thread
                pending.error = error
            pending.finished.set()

    def close(self) -> None:
        self._queue.put(None)


class PipeComm:
    """P2P between the ranks of one pipeline. ``ranks[i]`` is the global rank of pipeline rank i
    (default: the whole world is one pipeline).

    Construction is collective over the default group: every process must create its PipeComm
    objects in the same order (``new_group`` semantics). With tensor or data parallelism the world
    holds several pipelines; each process then learns all of them (one ``all_gather_object``) and
    creates every pipeline's groups, keeping its own (:meth:`new_group`)."""

    def __init__(
        self, ranks: Sequence[int] | None = None, timeout_s: float = 300.0, emulate_nccl: bool | None = None
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipeComm needs torch.distributed to be initialised")
        self.ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"global rank {me} is not in the pipeline {self.ranks}")
        self.rank = self.ranks.index(me)
        self.size = len(self.ranks)
        self.timeout_s = float(timeout_s)
        self.backend = dist.get_backend()
        self.pipelines = _all_pipelines(self.ranks)
        self._groups = {
            (direction, upward): self.new_group(range(self.size))
            for direction in ("F", "B")
            for upward in (True, False)
        }
        self._pending: list[_PendingSend] = []
        self._gloo = self.backend == "gloo"
        # Seconds this rank spent blocked on peers (receives and the final flush of sends): its
        # measured bubble, once divided by the step time.
        self.wait_seconds = 0.0
        self._waiters: dict[tuple[str, int], _SendWaiter] = {}
        if emulate_nccl is None:  # as --pp-emulate-nccl, for a whole test run: the variable set to 1
            emulate_nccl = os.environ.get(EMULATE_NCCL_VARIABLE) == "1"
        self.creation = Creation(self, emulate_nccl)
        # NCCL's in-order completion (rule 3), emulated on gloo under --pp-emulate-nccl
        self.launch = Launcher(self.rank, self.timeout_s, in_order=bool(emulate_nccl) and self._gloo)

    @property
    def device(self) -> torch.device:
        """Where this backend's buffers live (NCCL: the current GPU)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def wire_device(self, device: torch.device) -> torch.device:
        """Where a message of a tensor on ``device`` travels: host memory under gloo."""
        return torch.device("cpu") if self._gloo else device

    def new_group(self, pipeline_ranks: Sequence[int]) -> dist.ProcessGroup:
        """The process group of these pipeline ranks (indices into ``ranks``) of this pipeline.
        Collective: the same group is created for every pipeline of the world, in one order, so
        every process makes the same ``new_group`` calls."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        indices = list(pipeline_ranks)
        mine = None
        for pipeline in self.pipelines:
            group = dist.new_group([pipeline[i] for i in indices], timeout=timeout)
            if pipeline == self.ranks:
                mine = group
        return mine

    def channel_group(self, direction: str, sender: int, receiver: int) -> dist.ProcessGroup:
        """The group of messages ``direction`` (F or B) from ``sender`` to ``receiver``."""
        return self._groups[(direction, receiver > sender)]

    # ---- sends -------------------------------------------------------------------------------

    def send(
        self, tensor: Tensor, peer: int, direction: str, what: str, on_done: Callable[[], None] | None = None
    ) -> None:
        """Start sending ``tensor`` to pipeline rank ``peer``; ``on_done`` runs once it is out."""
        buffer = tensor.detach().to(self.wire_device(tensor.device)).contiguous()
        group = self.channel_group(direction, self.rank, peer)
        self.creation.use(self.creation.pair(direction, self.rank, peer), what)
        try:
            work = self.launch(lambda: dist.isend(buffer, dst=self.ranks[peer], group=group), what)
        except RuntimeError as error:
            raise PeerError(f"rank {self.rank}: {what} to rank {peer} failed: {error}") from error
        pending = _PendingSend(work, buffer, what, peer, on_done)
        self._pending.append(pending)
        if self._gloo:
            waiter = self._waiters.get((direction, peer))
            if waiter is None:
                waiter = self._waiters[(direction, peer)] = _SendWaiter(self.timeout_s)
            waiter.watch(pending)
        self.reap()

    def _is_done(self, pending: _PendingSend) -> bool:
        if self._gloo:
            return pending.finished.is_set()
        return pending.work.is_completed()

    def reap(self) -> None:
        """Release the buffers of sends that have completed."""
        still: list[_PendingSend] = []
        for pending in self._pending:
            if self._is_done(pending):
                self._finish(pending)
            else:
                still.append(pending)
        self._pending = still

    def flush(self) -> None:
        """Wait until every send has gone out (each within the timeout)."""
        start = time.monotonic()
        try:
            self._flush()
        finally:
            self.wait_seconds += time.monotonic() - start

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            if self._gloo:
                if not item.finished.wait(self.timeout_s + 1.0):
                    item.error = TimeoutError(f"no completion after {self.timeout_s:.1f}s")
            else:
                self.wait_work(item.work, f"{item.what} to", item.peer)
            self._finish(item)

    def _finish(self, pending: _PendingSend) -> None:
        if pending.error is not None:
            raise PeerError(
                f"rank {self.rank}: {pending.what} to rank {pending.peer} did not complete "
                f"(timeout {self.timeout_s:.1f}s): {pending.error}"
            ) from pending.error
        if not self._gloo:
            pending.work.wait()  # NCCL: order the current stream after the transfer
        if pending.on_done is not None:
            pending.on_done()

    def close(self) -> None:
        """Stop the helper thread (the process groups stay; they belong to torch.distributed)."""
        for waiter in self._waiters.values():
            waiter.close()
        self._waiters = {}
        self.launch.close()

    def abandon(self) -> None:
        """Forget pending sends (after a failure)."""
        self._pending = []

    # ---- receives ----------------------------------------------------------------------------

    def post_recv(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        peer: int,
        direction: str,
        what: str,
    ) -> PostedRecv:
        """Post the receive of a tensor from pipeline rank ``peer``; ``wait()`` on the result
        when the tensor is needed. Posting early is what keeps every rank's communication in one
        global order (``schedule/message_order.py``) without holding its compute back."""
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.wire_device(device))
        group = self.channel_group(direction, peer, self.rank)
        self.creation.use(self.creation.pair(direction, peer, self.rank), what)
        try:
            work = self.launch(lambda: dist.irecv(buffer, src=self.ranks[peer], group=group), what)
        except RuntimeError as error:
            raise PeerError(f"rank {self.rank}: {what} from rank {peer} failed: {error}") from error
        return PostedRecv(self, work, buffer, what, peer, device)

    def wait_work(self, work: dist.Work, what: str, peer: int) -> None:
        """Wait for one transfer with ``peer`` within the timeout; PeerError names rank, op, peer."""
        start = time.monotonic()
        try:
            if self.backend == "gloo":
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            else:
                # NCCL's wait() does not block the host, so a dead peer would hang a later
                # synchronisation instead: poll with a deadline.
                while not work.is_completed():
                    if time.monotonic() - start > self.timeout_s:
                        raise TimeoutError(f"no completion after {self.timeout_s:.1f}s")
                    time.sleep(0.0002)
                work.wait()
        except (RuntimeError, TimeoutError) as error:
            waited = time.monotonic() - start
            raise PeerError(
                f"rank {self.rank}: {what} rank {peer} did not complete after {waited:.1f}s "
                f"(timeout {self.timeout_s:.1f}s): {error}"
            ) from error


class PostedRecv:
    """A receive in flight; :meth:`wait` returns its tensor (once), within the deadline, on
    ``device`` (copied there from host memory when it was staged)."""

    def __init__(
        self,
        comm: PipeComm,
        work: dist.Work,
        buffer: Tensor,
        what: str,
        peer: int,
        device: torch.device | None = None,
    ) -> None:
        self.comm, self.work, self.buffer, self.what, self.peer = comm, work, buffer, what, peer
        self.device = buffer.device if device is None else device
        self.done = False

    def wait(self) -> Tensor:
        if not self.done:
            start = time.monotonic()
            try:
                self.comm.wait_work(self.work, f"{self.what} from", self.peer)
            finally:
                self.comm.wait_seconds += time.monotonic() - start
            self.buffer = self.buffer.to(self.device)  # staged through host memory: copy in
            self.done = True
        return self.buffer


def _all_pipelines(ranks: list[int]) -> list[list[int]]:
    """Every pipeline of the world (rank lists, sorted), given this process's one."""
    world = dist.get_world_size()
    if len(ranks) == world:
        return [ranks]
    gathered: list[list[int] | None] = [None] * world
    dist.all_gather_object(gathered, ranks)
    pipelines = sorted({tuple(r) for r in gathered if r is not None})
    covered = sorted(rank for pipeline in pipelines for rank in pipeline)
    if covered != list(range(world)) or len({len(p) for p in pipelines}) != 1:
        raise ValueError(f"the pipelines {pipelines} do not partition the {world} ranks into equal pipelines")
    return [list(p) for p in pipelines]
