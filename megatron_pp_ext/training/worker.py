"""A training run's processes: :func:`worker` is one rank started by the launcher, around
:func:`train_loop` (the job in a process whose ``torch.distributed`` is up: what tests and
scripts call); a peer that dies or hangs ends the rank in one line (:func:`fatal_message`)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .. import launch
from ..megatron.checkpoint import iteration_dir, read_tracker
from ..runtime import PeerError
from ..stop import StopRequest
from .heartbeat import Heartbeat
from .job import TrainJob

if TYPE_CHECKING:  # for annotations only: no import edge, a shorter import chain
    from .settings import TrainSettings


def worker(rank: int, world_size: int, local_rank: int, settings: TrainSettings) -> None:
    """One rank of ``megatron-pp-ext train``, as the launcher starts it."""
    device = launch.init_distributed(
        rank, world_size, local_rank, settings.timeout, settings.distributed_backend
    )
    request = StopRequest().install()
    try:
        train_loop(rank, settings, device, stop=request)
    except BaseException as error:
        if not is_peer_failure(error):
            raise
        _fatal(rank, settings, error)
    dist.destroy_process_group()


# How torch.distributed's backends word a failed or timed-out collective.
COMMUNICATION_FAILURES = ("gloo", "NCCL", "Timed out", "Connection reset", "Connection closed")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a dead or hung peer's doing: our p2p layer's error, torch.distributed's,
    or a collective's RuntimeError in a backend's words (gloo raises those)."""
    if isinstance(error, fatal_errors()):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error) for word in COMMUNICATION_FAILURES)


def fatal_errors() -> tuple[type[BaseException], ...]:
    """What a dead or hung peer raises: our p2p layer's error, torch.distributed's (anything
    else keeps its traceback)."""
    return (PeerError, dist.DistError)


def _fatal(rank: int, settings: TrainSettings, error: BaseException) -> None:
    """One line naming the rank and the failure (p2p errors name the op and the peer) and the
    checkpoint to resume from; then exit at once: with a peer gone, tearing down the process
    groups could hang."""
    line = f"megatron-pp-ext train: rank {rank}: error: {fatal_message(settings, error)}\n"
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, line.encode())  # one write: the survivors' lines do not interleave on a shared stderr
    os._exit(1)


def fatal_message(settings: TrainSettings, error: BaseException, others: str = "") -> str:
    """The error's first line and, with --save, the checkpoint ``--load`` resumes from."""
    message = _first_line(error)
    notes = getattr(error, "__notes__", [])
    message += f" ({'; '.join(notes)})" if notes else ""
    message += f"; {others}" if others else ""
    latest = read_tracker(settings.save) if settings.save else None
    if latest is None:
        return message + ("; no checkpoint to resume from (no --save)" if not settings.save else "")
    return (
        f"{message}; the last checkpoint is {iteration_dir(settings.save, latest)}: resume with the "
        f"same command and --load {settings.save}"
    )


def _first_line(error: BaseException) -> str:
    """The error's first line without a backend's source location and advice (gloo prefixes
    ``[.../pair.cc:553]`` and appends a paragraph)."""
    line = (str(error).splitlines() or [type(error).__name__])[0]
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", line)
    return line.split(". This is typically caused by")[0]


def train_loop(
    rank: int,
    settings: TrainSettings,
    device: Any,
    forward_step_func: Callable[..., Any] | None = None,
    stop: StopRequest | None = None,
) -> list[dict[str, Any]]:
    """Train in this process of an initialised ``torch.distributed`` job; return the per-iteration
    rows (the loss where it is reported, None elsewhere). Megatron's parallel state is set up and
    torn down here, so one process can run several jobs in a row (the tests do).
    ``forward_step_func`` replaces Megatron's forward step (tests inject faults with it); ``stop``
    ends the run early, saved, when a signal asks (``megatron_pp_ext/stop.py``)."""
    job = TrainJob(rank, settings, device, forward_step_func)
    job.stop = stop
    heartbeat = Heartbeat(rank, dist.get_world_size(), lambda: job.phase)
    ended = None
    try:
        heartbeat.start()
        job.resume()
        try:
            rows = job.run()
        except BaseException as error:
            error.add_note(f"while in {job.phase}")  # fatal_message says where a peer was lost
            if is_peer_failure(error):
                ended = f"a peer failure in {job.phase}"
                diagnosis = heartbeat.diagnose()  # which rank is gone or elsewhere
                if diagnosis is not None:
                    error.add_note(diagnosis)
            raise
        job.report()
        return rows
    finally:
        heartbeat.stop(ended)
        job.close()
