"""Spawn gloo process groups on 127.0.0.1 for multi-process tests.

Processes are started through a forkserver that imports torch and megatron-core once, so each
rank starts in well under a second instead of re-importing everything (the machine has 2 cores).
The worker must be a module-level function ``fn(rank, world_size, *args)``; its return value
(picklable) comes back per rank. A rank that raises comes back as :class:`RankFailure` with the
traceback; ranks still running after ``timeout`` are killed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt.gpt_model",
    "megatron_pp_ext.megatron.model",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RankFailure:
    rank: int
    error: str
    traceback: str


def warm_context() -> mp.context.BaseContext:
    """multiprocessing's forkserver, its server having imported torch and megatron-core once."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    # one thread a rank by default (2 cores); PP_EXT_TEST_THREADS checks other kernel splits
    torch.set_num_threads(int(os.environ.get("PP_EXT_TEST_THREADS", "1")))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
        value = fn(rank, world_size, *args)
        results.put((rank, value))
    except BaseException as error:  # report everything, including PeerError
        results.put((rank, RankFailure(rank, f"{type(error).__name__}: {error}", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


PORT_TAKEN = "EADDRINUSE"  # the store's port, free when picked, taken before rank 0 listened
LAUNCH_ATTEMPTS = 3


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.
    A launch whose store port another process took between :func:`free_port` and rank 0's listen
    (the other test worker) ran nothing: it is started again on a fresh port."""
    for _ in range(LAUNCH_ATTEMPTS - 1):
        results = _launch(fn, world_size, args, timeout)
        if not any(isinstance(r, RankFailure) and PORT_TAKEN in r.error for r in results):
            return results
    return _launch(fn, world_size, args, timeout)


def _launch(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    context = warm_context()
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(collected) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, value = results.get(timeout=min(remaining, 1.0))
                collected[rank] = value
                if isinstance(value, RankFailure) and PORT_TAKEN in value.error:
                    break  # the others wait for a store that never listens: start again
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [
        collected.get(rank, RankFailure(rank, f"no result (exit code {processes[rank].exitcode})", ""))
        for rank in range(world_size)
    ]


def check_ok(results: list[Any]) -> list[Any]:
    """Raise with every failing rank's traceback if any rank failed."""
    failures = [r for r in results if isinstance(r, RankFailure)]
    if failures:
        raise AssertionError("\n\n".join(f"rank {f.rank}: {f.error}\n{f.traceback}" for f in failures))
    return results
