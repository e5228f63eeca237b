"""Process launch: use torchrun's or srun's processes when there are some, else start them here.

``train`` works three ways: ``torchrun --nproc-per-node P megatron-pp-ext train ...`` and
``srun -n P megatron-pp-ext train ...`` give each process its rank through the environment;
plain ``megatron-pp-ext train`` starts P local processes itself (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import connection, reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import stop
from .launcher_env import launcher_world


class LaunchError(ValueError):
    """More ranks on a node than it has GPUs: NCCL refuses two ranks on one device."""


def check_gpus(ranks_here: int, gpus: int, how: str = "") -> None:
    """NCCL needs a GPU of its own per rank ("Duplicate GPU detected" otherwise, from inside
    NCCL at the first collective): refuse, in one line, more ranks on this node than GPUs."""
    if gpus and ranks_here > gpus:
        raise LaunchError(
            f"{ranks_here} ranks on this node{how} but it has {gpus} GPU{'s' * (gpus > 1)}: NCCL needs "
            f"one GPU per rank; start at most {gpus} here (torchrun --nproc-per-node {gpus}, srun "
            f"--ntasks-per-node {gpus}) and the rest on other nodes, or shrink the layout (or share "
            "the GPUs, slowly, with --distributed-backend gloo)"
        )


def init_distributed(
    rank: int, world_size: int, local_rank: int, timeout_s: float, backend: str | None = None
) -> torch.device:
    """Initialise torch.distributed: NCCL on a GPU per process when there are GPUs, else gloo.

    ``backend`` "gloo" with GPUs (Megatron's ``--distributed-backend gloo``): the ranks share the
    GPUs (local rank modulo their count), compute on CUDA and talk gloo, which moves host memory
    only: pipeline messages are staged through it (``PipeComm``), bookkeeping collectives use CPU
    tensors (:func:`collective_device`). One GPU then runs a whole pipeline, slowly but on real
    kernels and streams."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if backend == "gloo":
            device = torch.device("cuda", local_rank % count)
        else:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
            check_gpus(max(local_ranks, local_rank + 1), count, f" (rank {rank}, local rank {local_rank})")
            device = torch.device("cuda", local_rank)
            backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # Processes share the cores: one thread each unless there are cores to spare.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))))
    # NCCL: binding the device creates each group's communicator eagerly (at new_group), as
    # Megatron-LM's initialisation does; the pairs are warmed before the first step (creation.py)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return device


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, on every rank (the world group; picklable objects)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def collective_device(device: torch.device) -> torch.device:
    """Where a small bookkeeping tensor goes for a collective: the GPU under NCCL, host memory
    under gloo (gloo's all-gather, gather and send take CPU tensors only)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


class _ParentStream:
    """This process's file descriptor ``fd`` (stdout, stderr) as the rank receives it: a
    forkserver's child would otherwise write to the server's, those of the first launch."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received, (reduction.DupFd(self.fd),)  # sent with the child while it is pickled


def _received(dup: Any) -> int:
    return dup.detach()


def _entry(
    local_rank: int,
    world_size: int,
    port: int,
    environment: dict[str, str],
    streams: tuple[int, int] | None,
    worker: Callable[..., Any],
    args: tuple,
) -> None:
    # a forkserver's child has the environment and output streams of the server's start: this
    # launch's come along
    os.environ.clear()
    os.environ.update(environment)
    for target, fd in zip((1, 2), streams or ()):
        os.dup2(fd, target)
        os.close(fd)
    # the store is this launcher's, as torchrun's agent holds it: every rank is its client
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    worker(local_rank, world_size, local_rank, *args)


def run_for_results(
    worker: Callable[..., Any],
    world_size: int,
    settings_for: Callable[[str], Any],
    backend: str | None = None,
) -> str:
    """:func:`run` for a job whose rank 0 writes its results to a file: ``settings_for(path)``
    builds the workers' settings around that path; returns what rank 0 wrote ("" in another
    rank's process under torchrun or srun, where rank 0 reports)."""
    handle, output = tempfile.mkstemp(prefix="megatron-pp-ext-", suffix=".json")
    os.close(handle)
    try:
        run(worker, world_size, settings_for(output), backend=backend)
        with open(output) as results:
            return results.read()
    finally:
        os.unlink(output)


class WorkerDied(Exception):
    """A rank of a job this process started ended badly: which one and how."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__(f"rank {rank} ended ({how})")
        self.rank, self.how = rank, how


class WorkerHung(WorkerDied):
    """A rank that stopped answering: still running when the others had ended, waiting for it."""

    def __init__(self, rank: int, waited_s: float) -> None:
        waited = f"{waited_s:.0f} s" if waited_s >= 1 else f"{waited_s:.1f} s"
        how = f"still running {waited} after the others ended; stopped"
        Exception.__init__(self, f"rank {rank} stopped answering ({how})")
        self.rank, self.how = rank, how


def start_method(worker: Callable[..., Any]) -> str:
    """How this process starts its ranks. Without CUDA: a forkserver that imports torch,
    megatron-core and the worker's module once, each rank forked from it ready to run (spawn
    imports them in every rank: about 10 s of CPU each on a 2-core machine). With CUDA: spawn,
    as PyTorch asks, since a module may touch the driver at import and a fork after that breaks
    the child's CUDA."""
    if torch.cuda.is_available():
        return "spawn"
    preload = ["torch", "torch.distributed"]
    if worker.__module__ != "__main__":
        preload.append(worker.__module__)
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def run(
    worker: Callable[..., Any], world_size: int, *args: Any, grace_s: float = 30.0, backend: str | None = None
) -> None:
    """Call ``worker(rank, world_size, local_rank, *args)`` in each process of the job.

    When it starts the processes itself and one ends badly, the others get ``grace_s`` to notice
    it and end on their own (each says in one line what it was waiting for) before they are
    stopped; then :class:`WorkerDied` names the first. SIGTERM and SIGINT sent to this process are
    passed on to the ranks (``stop.py``: they stop at the end of the iteration)."""
    given = launcher_world()
    if given is not None:
        rank, world, local_rank = given
        if world != world_size:
            raise ValueError(
                f"the launcher started {world} processes but the job needs {world_size} "
                f"(TP x PP x DP); start it with {world_size} processes"
            )
        worker(rank, world, local_rank, *args)
        return
    if torch.cuda.is_available() and backend != "gloo":  # gloo: the ranks share the GPUs
        check_gpus(world_size, torch.cuda.device_count())
    # a rank killed mid-run leaves its semaphores to multiprocessing's resource tracker, which
    # warns about them at exit: expected then, and the job's own lines say what happened
    quiet_tracker = "ignore:resource_tracker:UserWarning"
    given_warnings = os.environ.get("PYTHONWARNINGS", "")
    if quiet_tracker not in given_warnings.split(","):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [given_warnings, quiet_tracker]))
    # The job's store (rendezvous, and each rank's heartbeat: training/heartbeat.py) lives here,
    # not in rank 0, as torchrun's agent holds it: when rank 0 dies the others can still read it.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    method = start_method(worker)
    sys.stdout.flush()
    sys.stderr.flush()
    streams = (_ParentStream(1), _ParentStream(2)) if method == "forkserver" else None
    context = mp.start_processes(
        _entry,
        args=(world_size, store.port, dict(os.environ), streams, worker, args),
        nprocs=world_size,
        start_method=method,
        join=False,
    )
    previous = stop.forward_to(context.processes)
    try:
        _watch(context.processes, grace_s)
        context.join()  # every rank has ended: torch raises for the first that failed
    except mp.ProcessExitedException as error:
        how = f"killed by {error.signal_name}" if error.signal_name else f"exit code {error.exit_code}"
        raise WorkerDied(error.error_index, how) from None
    finally:
        stop.restore(previous)
        del store  # the server stops with the last reference


def _watch(processes: list[Any], grace_s: float) -> None:
    """Wait until every rank has ended, or one has ended badly; then give the others ``grace_s``
    to notice it and end on their own, and stop those still running. Raises :class:`WorkerDied`
    for the rank to blame when it is not the first failure torch would name: a rank killed by a
    signal (the others then fail waiting for it), else a rank that never ended (it stopped
    answering: the others timed out waiting for it)."""
    while True:
        running = [process for process in processes if process.exitcode is None]
        if any(process.exitcode for process in processes) or not running:
            break
        connection.wait([process.sentinel for process in running], timeout=1.0)
    deadline = time.monotonic() + grace_s
    while (running := [p for p in processes if p.exitcode is None]) and time.monotonic() < deadline:
        connection.wait([process.sentinel for process in running], timeout=deadline - time.monotonic())
    hung = [rank for rank, process in enumerate(processes) if process.exitcode is None]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    killed = [rank for rank, p in enumerate(processes) if rank not in hung and (p.exitcode or 0) < 0]
    if killed:
        rank = killed[0]
        raise WorkerDied(rank, f"killed by {signal.Signals(-processes[rank].exitcode).name}")
    if hung:
        raise WorkerHung(hung[0], grace_s)
