"""training/heartbeat.py: each rank's beat in the job's store, and the diagnosis a failed rank
adds to its line (which rank is gone, which one is elsewhere). Ranks are Heartbeat objects of one
process here, beating every 100 ms into a real TCPStore; the killed-rank run is in test_faults."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_pp_ext.training.heartbeat import Heartbeat

BEAT_S = 0.1  # three beats (the diagnosis window) = 0.3 s


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return server


def ranks(world: int, phases: dict[int, str] | None = None) -> list[Heartbeat]:
    """``world`` beating ranks, each in its phase of ``phases`` (default: the same step)."""
    phases = phases or {}
    beats = []
    for rank in range(world):
        phase = phases.get(rank, "the pipeline step of iteration 3")
        beats.append(Heartbeat(rank, world, lambda phase=phase: phase, interval_s=BEAT_S).start())
    return beats


def stop_all(beats: list[Heartbeat]) -> None:
    for beat in beats:
        beat.stop()


def test_every_rank_beating_where_this_one_is_blames_none(store: dist.TCPStore) -> None:
    beats = ranks(3)
    try:
        assert beats[0].diagnose() is None
        assert beats[0].beats > 1  # it beat during the diagnosis
    finally:
        stop_all(beats)


def test_a_rank_that_stopped_beating_is_named_silent_with_its_last_phase(store: dist.TCPStore) -> None:
    beats = ranks(4, {2: "the optimizer step of iteration 3"})
    beats[2].stop()  # as SIGKILL leaves it: no last word
    try:
        assert beats[0].diagnose() == (
            "rank 2 went silent (no heartbeat for 0.3 s: dead or stopped); "
            "rank 2's last beat was in the optimizer step of iteration 3"
        )
    finally:
        stop_all(beats)


def test_a_rank_that_ended_on_a_failure_of_its_own_is_not_blamed(store: dist.TCPStore) -> None:
    beats = ranks(3)
    beats[1].stop(ended="a peer failure in the pipeline step of iteration 3")
    beats[2].stop()
    try:
        message = beats[0].diagnose()
        assert message is not None and message.startswith("rank 2 went silent"), message
        assert "rank 1" not in message
    finally:
        stop_all(beats)


def test_a_rank_beating_elsewhere_is_the_one_that_stopped_answering(store: dist.TCPStore) -> None:
    beats = ranks(3, {1: "the pipeline step of iteration 7"})
    try:
        assert beats[0].diagnose() == (
            "rank 1 is alive but elsewhere: rank 1 in the pipeline step of iteration 7"
        )
    finally:
        stop_all(beats)


def test_many_ranks_are_counted_not_listed(store: dist.TCPStore) -> None:
    beats = ranks(6)
    for beat in beats[1:]:
        beat.stop()
    try:
        assert beats[0].diagnose().startswith("ranks 1, 2, 3 and 2 more went silent"), beats[0].diagnose()
    finally:
        stop_all(beats)


def test_a_store_that_went_away_is_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    beat = Heartbeat(0, 2, lambda: "the pipeline step of iteration 1", interval_s=BEAT_S).start()
    del server  # its host is gone
    try:
        assert "does not answer: the process holding it is gone" in beat.diagnose()
    finally:
        beat.stop()


def test_without_a_store_address_nothing_beats_and_nothing_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    beat = Heartbeat(0, 2, lambda: "start-up").start()
    assert beat.beats == 0 and beat.diagnose() is None
    beat.stop(ended="anything")
