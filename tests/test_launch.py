"""The launcher's verdict when a job goes wrong (``launch.run``, the processes train starts): which
rank to blame. Workers here only sleep, fail or die: no torch.distributed, a few seconds a test."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from megatron_pp_ext import launch


def hangs_or_fails(rank: int, world_size: int, local_rank: int, stuck: int) -> None:
    """Rank ``stuck`` stops answering (sleeps on); the others fail the way a rank that timed out
    waiting for it does (exit 1 after a moment)."""
    if rank == stuck:
        time.sleep(600)
    time.sleep(0.5)
    sys.stdout.flush()
    os._exit(1)


def dies_or_fails(rank: int, world_size: int, local_rank: int, dead: int) -> None:
    """Rank ``dead`` is killed (SIGKILL); the others fail a moment later, as its peers do."""
    if rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    os._exit(1)


def succeeds(rank: int, world_size: int, local_rank: int) -> None:
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world_size)


def test_a_hung_rank_is_named_not_the_first_that_timed_out() -> None:
    start = time.monotonic()
    with pytest.raises(launch.WorkerHung) as died:  # a WorkerDied, as train catches it
        launch.run(hangs_or_fails, 3, 1, grace_s=2.0)
    assert died.value.rank == 1, died.value
    expected = "rank 1 stopped answering (still running 2 s after the others ended; stopped)"
    assert str(died.value) == expected
    assert time.monotonic() - start < 60  # the grace, not the hung rank's 600 s


def test_a_killed_rank_is_named_though_the_others_fail_too() -> None:
    with pytest.raises(launch.WorkerDied) as died:
        launch.run(dies_or_fails, 3, 2, grace_s=5.0)
    assert died.value.rank == 2 and died.value.how == "killed by SIGKILL", died.value


def test_a_job_that_succeeds_returns() -> None:
    launch.run(succeeds, 2, grace_s=5.0)


def says(rank: int, world_size: int, local_rank: int, tag: str) -> None:
    print(f"rank {rank} says {tag}", file=sys.stderr, flush=True)


def test_each_launch_writes_where_its_caller_s_stderr_points_now(tmp_path) -> None:
    """The ranks write to the caller's stderr of this launch, not to the one the forkserver
    inherited at the first launch of the process (a library caller redirecting between runs)."""
    saved = os.dup(2)
    try:
        for tag in ("first", "second"):
            with open(tmp_path / f"{tag}.txt", "w") as target:
                os.dup2(target.fileno(), 2)
                launch.run(says, 2, tag, grace_s=5.0)
                os.dup2(saved, 2)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    for tag in ("first", "second"):
        lines = sorted(line for line in (tmp_path / f"{tag}.txt").read_text().splitlines() if "says" in line)
        assert lines == [f"rank 0 says {tag}", f"rank 1 says {tag}"], lines
