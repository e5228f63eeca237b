"""A graceful stop: SIGTERM (a SLURM preemption, ``scancel``) or SIGINT (Ctrl-C) asks a training job
to stop at the end of an iteration. Every rank must stop at the same iteration (a checkpoint is a
collective), so the ranks agree with one all-reduce, started at the end of each iteration and read
at the end of the next: it never waits for a slower rank (no per-iteration barrier, which would
bring back the step-boundary bubble that post-validation removes), and the job stops one
iteration after the signal. It saves when ``--save`` is given and exits cleanly. A second signal,
a few seconds after the first, takes the default action (stop at once), for a user who will not
wait.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# a repeat sooner than this is the same request (Ctrl-C reaches every rank and its parent)
FORCE_AFTER_S = 2.0


class StopRequest:
    """Set by a signal handler in this process; read by :meth:`agreed` at iteration ends."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at = 0.0
        self.previous: dict[int, Any] = {}
        self._pending: tuple[Any, Any, str | None] | None = None  # (work, flag, name) in flight
        self._group: Any = None  # the agreement's own copy of the world group

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT here (the main thread: Python runs handlers there)."""
        for sig in SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signal_name is not None and now - self.received_at > FORCE_AFTER_S:
            self.restore()
            signal.raise_signal(signum)  # the default action, now
            return
        if self.signal_name is None:
            self.signal_name, self.received_at = signal.Signals(signum).name, now

    def agreed(self, device: Any, launch: Any = None) -> str | None:
        """Collective over the world group, called by every rank at every iteration end: the
        answer to the previous call's question (the same on every rank): the signal's name when
        any rank had received one by then, else None; unless it is yes, this call's question is
        sent (asynchronously). ``launch``: the pipeline's launch queue (``PipeComm.launch``), so
        the all-reduce takes its place in this rank's communication order, under
        ``--pp-emulate-nccl`` too. It runs on a group of its own (created at the first call,
        which every rank makes at the same iteration end): the queue may launch it from a helper
        thread, so it must not share a group with the main thread's collectives, whose order on
        a shared group it could cross."""
        import torch
        import torch.distributed as dist

        answer = self._answer()
        if answer is None:
            if self._group is None:
                self._group = dist.new_group()
            flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32, device=device)

            def start() -> Any:
                return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

            work = start() if launch is None else launch(start, "the stop agreement (all-reduce, world)")
            self._pending = (work, flag, self.signal_name)
        return answer

    def _answer(self) -> str | None:
        if self._pending is None:
            return None
        work, flag, name = self._pending
        self._pending = None
        work.wait()
        return (name or "a signal to another rank") if int(flag.item()) else None

    def finish(self) -> None:
        """At the run's end: complete the question in flight (every rank sent it)."""
        self._answer()


def forward_to(processes: list[Any]) -> dict[int, Any]:
    """In a parent that started the ranks itself: pass SIGTERM and SIGINT on to them (a
    ``kill PARENT`` reaches only the parent; Ctrl-C reaches them all, and a repeat within
    ``FORCE_AFTER_S`` is one request). Returns the previous handlers."""

    def forward(signum: int, frame: Any) -> None:
        for process in processes:
            if process.is_alive() and process.pid is not None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    return {sig: signal.signal(sig, forward) for sig in SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
