"""Where a rank's communication is launched: at once, or (``--pp-emulate-nccl`` on gloo) in
NCCL's launch order.

NCCL's rule 3: with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron asks for it with TP/SP on
Hopper) a GPU completes its communication in the order it was launched, across all its
communicators. Gloo runs every operation on its own as soon as both ends are there, so an order
that would hang a GPU passes on CPU. Under emulation, :class:`Launcher` gives each rank one
thread that starts an operation only once the one launched before it has completed: a receive
posted early holds back every later send and collective of its rank, as on the GPU, and a bad
order hangs here until the deadline names the op, its peer and what it was queued behind.

Every launch site of the runtime goes through a ``Launcher``: pipeline sends and receives
(``p2p.PipeComm``) and the vocabulary collectives of a step (``vocab_parallel.VocabParallel``),
synchronous ones too (they would wait behind the queue on a GPU as well). Creating a
communicator is not queued: NCCL creates it on the host at the first use, whatever the GPU is
doing (``creation.py``). Without emulation (gloo, or NCCL itself, which needs none) a launch
is the plain ``torch.distributed`` call.

A helper thread's launches would come at whatever moment the thread gets there, so two ranks
could put them in different places of their orders (vocab-2's REDUCE_S worker did, and hung under
emulation where the schedule check, which takes helpers to react at once, passed). A helper
therefore launches into a :class:`Slot` that the main thread reserved at the op's place:
under emulation the queue waits there until the helper fills it; without emulation the main
thread's next launch waits until the slot is filled, so the order is the same on every backend
(on a GPU the helper only launches kernels, so that wait is short).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

Start = Callable[[], Any]  # issues one asynchronous operation, returns its dist.Work


class Launcher:
    """This rank's launch queue. ``launcher(start, what)`` runs ``start`` (a closure around one
    ``torch.distributed`` call with ``async_op=True``, or an ``isend``/``irecv``) and returns
    something to ``wait()`` on: its ``Work``, or under ``in_order`` a :class:`Launched`."""

    def __init__(self, rank: int, timeout_s: float, in_order: bool = False) -> None:
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.in_order = in_order
        self._queue: queue.Queue[Launched | None] = queue.Queue()
        self._lock = threading.Condition()  # keeps launch order = queue order across threads
        self._reserved: list[Slot] = []  # without emulation: slots reserved, not filled yet
        self._running: Launched | None = None
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.launched = 0  # operations that went through the queue (a test can see it is used)

    def __call__(self, start: Start, what: str) -> Any:
        if not self.in_order:
            self._after_reserved(what)
            return start()
        item = Launched(self, start, what)
        with self._lock:
            self._enqueue(item)
        return item

    def reserve(self, what: str) -> Slot:
        """A place in this rank's launch order, here and now, for an operation that a helper
        thread launches later (:meth:`Slot.fill`)."""
        slot = Slot(self, what)
        with self._lock:
            if self.in_order:
                slot.item = Launched(self, slot.start_when_filled, what)
                self._enqueue(slot.item)
            else:
                self._reserved.append(slot)
        return slot

    def _enqueue(self, item: Launched) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nccl-launch-order", daemon=True)
            self._thread.start()
        self.launched += 1
        self._queue.put(item)

    def _after_reserved(self, what: str) -> None:
        """Without emulation: wait until every reserved slot is filled (launched)."""
        with self._lock:
            if not self._lock.wait_for(lambda: not self._reserved, self.timeout_s):
                raise RuntimeError(
                    f"{what} waits to be launched after {self._reserved[0].what}, which its helper "
                    f"thread did not launch within {self.timeout_s:.1f}s"
                )

    def run(self, start: Start, what: str) -> None:
        """Launch and wait (a synchronous collective: it too waits its turn on a GPU)."""
        work = self(start, what)
        if work is not None:
            work.wait()

    def _loop(self) -> None:
        # longer than the deadline of whoever waits: the waiter names what it was queued behind
        timeout = datetime.timedelta(seconds=2 * self.timeout_s + 1.0)
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._failed is None:
                self._running = item
                try:
                    work = item.start()
                    if work is not None:
                        work.wait(timeout)
                except BaseException as error:  # reported by whoever waits on it
                    self._failed = RuntimeError(f"{item.what} failed: {error}")
                    item.error = error
                self._running = None
            else:
                item.error = RuntimeError(f"launched after an operation that failed ({self._failed})")
            item.finished.set()

    def holding(self, item: Launched) -> str:
        """Why ``item`` has not completed: which operation it waits behind, if any."""
        running = self._running
        if running is None or running is item:
            return f"{item.what} was running and did not complete"
        return (
            f"{item.what} is launched behind {running.what}, which has not completed "
            f"(NCCL completes a GPU's communication in launch order; --pp-emulate-nccl)"
        )

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None


class Slot:
    """A reserved place in a rank's launch order (:meth:`Launcher.reserve`)."""

    def __init__(self, launcher: Launcher, what: str) -> None:
        self.launcher = launcher
        self.what = what
        self.item: Launched | None = None  # under emulation: its entry in the queue
        self._start: Start | None = None
        self._filled = threading.Event()

    def fill(self, start: Start) -> Any:
        """Launch the operation into this place; returns what to ``wait()`` on."""
        launcher = self.launcher
        if self.item is not None:  # the queue thread starts it once it reaches the slot
            self._start = start
            self._filled.set()
            return self.item
        with launcher._lock:
            if not launcher._reserved or launcher._reserved[0] is not self:
                raise RuntimeError(f"{self.what} filled out of the order its slots were reserved in")
            try:
                return start()
            finally:
                launcher._reserved.pop(0)
                launcher._lock.notify_all()

    def cancel(self, why: BaseException) -> None:
        """The helper failed before launching: free the place (whoever waits on it gets ``why``)."""
        launcher = self.launcher
        if self.item is not None:
            if not self._filled.is_set():

                def fail() -> Any:
                    raise RuntimeError(f"its helper thread failed: {why}")

                self._start = fail
                self._filled.set()
            return
        with launcher._lock:
            if self in launcher._reserved:
                launcher._reserved.remove(self)
                launcher._lock.notify_all()

    def start_when_filled(self) -> Any:
        if not self._filled.wait(self.launcher.timeout_s):
            raise RuntimeError(f"its helper thread did not launch it within {self.launcher.timeout_s:.1f}s")
        assert self._start is not None
        return self._start()


class Launched:
    """One operation in the launch queue; waits like a ``dist.Work`` (within a deadline)."""

    def __init__(self, launcher: Launcher, start: Start, what: str) -> None:
        self.launcher = launcher
        self.start = start
        self.what = what
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = self.launcher.timeout_s if timeout is None else timeout.total_seconds()
        begin = time.monotonic()
        if not self.finished.wait(seconds):
            raise RuntimeError(
                f"no completion after {time.monotonic() - begin:.1f}s: {self.launcher.holding(self)}"
            )
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed: {self.error}") from self.error
        return True


def direct() -> Launcher:
    """A launcher that launches at once (what a component gets before the runtime wires it)."""
    return Launcher(dist.get_rank() if dist.is_initialized() else 0, 300.0, in_order=False)
