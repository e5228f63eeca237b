"""Which rank is gone, or stuck, for the line a failed rank prints.

gloo and NCCL report a failed collective with an address or a timeout, never the rank behind it.
Each rank therefore beats in the job's store (the rendezvous ``TCPStore`` at MASTER_ADDR and
MASTER_PORT, through a client of its own): a counter and what the rank is doing, once a second,
from a daemon thread. After a communication failure the rank reads every beat twice, three beats
apart: a rank whose counter stood still is gone; one that still beats but is elsewhere than this
rank (another phase of the iteration) is the one that stopped answering. A rank that ends on a
failure of its own marks its beat so, and is not taken for the cause. ``megatron-pp-ext train``'s
launcher holds the store (launch.py), as torchrun's agent does, so the beats outlive rank 0.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

KEY = "megatron_pp_ext/heartbeat/{rank}"
ENDED = "ended: "  # the phase of a rank that stopped on a failure of its own
SHOWN = 3  # ranks named in a line; the rest counted


class Heartbeat:
    """This rank's beat (``start``/``stop``) and the diagnosis of the others' (``diagnose``)."""

    def __init__(self, rank: int, world_size: int, phase: Callable[[], str], interval_s: float = 1.0) -> None:
        self.rank, self.world_size, self.phase, self.interval_s = rank, world_size, phase, interval_s
        self.beats = 0
        self._store: dist.Store | None = None
        self._lock = threading.Lock()  # the beat thread and the main thread share the client
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Beat from now on; without a store address (MASTER_ADDR, MASTER_PORT) do nothing."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host is None or port is None:
            return self
        timeout = datetime.timedelta(seconds=max(5.0, 5 * self.interval_s))
        try:
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            self._beat()
        except Exception:  # a diagnosis aid: no store, no beat (the job's own start-up says why)
            self._store = None
            return self
        self._thread = threading.Thread(target=self._run, name="megatron_pp_ext-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, ended: str | None = None) -> None:
        """Stop beating; with ``ended``, leave that as this rank's last word (a failure of its own)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if ended is not None and self._store is not None:
            try:
                self._write(ENDED + ended)
            except Exception:  # the store's host may be gone too: nothing to tell then
                pass
        self._store = None  # the client's connection closes with it

    def diagnose(self) -> str | None:
        """After a failed collective or p2p op: the ranks that are gone or stopped answering, in
        words; None when every rank beats where this one is (or there is no store)."""
        if self._store is None:
            return None
        try:
            before = self._read()
            time.sleep(3 * self.interval_s)
            after = self._read()
        except Exception:  # the client's own timeout or a closed connection
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            return (
                f"the job's store at {host}:{port} does not answer: the process holding it is gone "
                "(the launcher or torchrun's agent; rank 0 under a plain srun)"
            )
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        gone = [
            rank
            for rank in others
            if rank not in after
            or (after[rank][0] == before.get(rank, (None,))[0] and not after[rank][1].startswith(ENDED))
        ]
        if gone:
            silent = (
                f"{_ranks(gone, 'went')} silent (no heartbeat for {3 * self.interval_s:g} s: dead or stopped)"
            )
            # a beat a second: the phase of the last one may be some iterations old
            last = [
                f"rank {rank}'s last beat was in {after[rank][1]}" for rank in gone[:SHOWN] if rank in after
            ]
            return "; ".join([silent, *last])
        mine = self.phase()
        elsewhere = [
            rank for rank in others if not after[rank][1].startswith(ENDED) and after[rank][1] != mine
        ]
        if elsewhere:
            phases = "; ".join(f"rank {rank} in {after[rank][1]}" for rank in elsewhere[:SHOWN])
            return f"{_ranks(elsewhere, 'is')} alive but elsewhere: {phases}"
        return None

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store is gone: diagnose says so; the job's own error ends the run
                return

    def _beat(self) -> None:
        self.beats += 1
        self._write(self.phase())

    def _write(self, phase: str) -> None:
        with self._lock:
            self._store.set(KEY.format(rank=self.rank), f"{self.beats}|{phase}")

    def _read(self) -> dict[int, tuple[int, str]]:
        """Every rank's (beat count, phase) that has beaten."""
        beats = {}
        with self._lock:
            for rank in range(self.world_size):
                key = KEY.format(rank=rank)
                if self._store.check([key]):
                    count, _, phase = self._store.get(key).decode().partition("|")
                    beats[rank] = (int(count), phase)
        return beats


def _ranks(ranks: list[int], verb: str) -> str:
    """The subject of the line: 'rank 1 went', 'ranks 1, 2, 3 and 5 more are' (``verb`` is or went)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} {verb}"
    shown = ", ".join(map(str, ranks[:SHOWN]))
    more = f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else ""
    return f"ranks {shown}{more} {'are' if verb == 'is' else verb}"
