"""Faults of a real ``megatron-pp-ext train`` run (issue 27): a rank killed during a step, and a
SLURM-style preemption (SIGTERM) that saves and resumes. Real processes, gloo, a small model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

JOB = [  # 4 ranks (PP2 x DP2), a few milliseconds a step
    "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", "--num-layers", "2",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--save-interval", "5",
    "--pp-p2p-timeout", "20",
]  # fmt: skip


def start(tmp_path: Path, iterations: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "megatron_pp_ext", "train", *JOB, "--train-iters", str(iterations)]
    command += ["--save", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "metrics.jsonl"), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_iteration(
    tmp_path: Path, iteration: int, process: subprocess.Popen, limit_s: float = 240
) -> None:
    """Until the metrics file shows ``iteration`` (the job is inside its steps by then)."""
    path = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if rows and rows[-1]["iteration"] >= iteration:
                return
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"no iteration {iteration} within {limit_s}s")


def _children(pid: int) -> list[int]:
    return [int(kid) for kid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def ranks_of(pid: int) -> list[int]:
    """The rank processes a train command started, in rank order: its descendants without
    children of their own and with more than one thread (gloo's). On CPU they are the children
    of the forkserver the command started (``launch.start_method``), with spawn its own."""
    ranks, waiting = [], _children(pid)
    while waiting:
        kid = waiting.pop()
        grandchildren = _children(kid)
        status = Path(f"/proc/{kid}/status").read_text()
        if grandchildren:
            waiting += grandchildren
        elif int(re.search(r"Threads:\s+(\d+)", status).group(1)) > 1:
            ranks.append(kid)
    return sorted(ranks)


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_in_one_line_per_rank_naming_it_and_the_checkpoint(tmp_path: Path) -> None:
    process = start(tmp_path, 100_000)
    wait_for_iteration(tmp_path, 7, process)
    victim = ranks_of(process.pid)[1]
    os.kill(victim, signal.SIGKILL)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    last = lines[-1]
    # the launcher: which rank, how it ended, the checkpoint and the exact --load
    assert re.match(r"megatron-pp-ext train: error: rank \d ended \(killed by SIGKILL\)", last), err
    assert f"--load {tmp_path / 'ckpt'}" in last and "iter_" in last, last
    # the survivors each said what they were waiting for, in one line each
    survivors = [
        line for line in err.splitlines() if re.match(r"megatron-pp-ext train: rank \d: error:", line)
    ]
    assert survivors, err
    assert all("--load" in line for line in survivors), survivors
    # ... and named the rank that went silent (the heartbeats in the launcher's store: heartbeat.py)
    victim = re.match(r"megatron-pp-ext train: error: rank (\d)", last).group(1)
    assert all(f"rank {victim} went silent" in line for line in survivors), survivors
    # the checkpoint named is complete: the job resumes from it
    resumed = start(
        tmp_path, int(re.search(r"iter_(\d+)", last).group(1)) + 2, "--load", str(tmp_path / "ckpt")
    )
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly_then_the_run_resumes_exactly(tmp_path: Path) -> None:
    iterations = 16
    process = start(tmp_path, iterations)
    wait_for_iteration(tmp_path, 3, process)
    process.send_signal(signal.SIGTERM)  # a SLURM preemption reaches the launcher first
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "Traceback" not in err, err
    stopped = re.search(r"stopped by SIGTERM after iteration (\d+): saved (\S+); resume with", out + err)
    assert stopped, out + err
    at = int(stopped.group(1))
    assert at < iterations and Path(stopped.group(2)).is_dir() and f"iter_{at:07d}" in stopped.group(2)
    before = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert before[-1]["iteration"] == at
    # the same command with --load finishes the run; its losses are those of an uninterrupted run
    resumed = start(tmp_path, iterations, "--load", str(tmp_path / "ckpt"))
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    after = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    whole = start(fresh, iterations)
    whole.communicate(timeout=240)
    reference = [json.loads(line) for line in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in after] == list(range(1, iterations + 1))
    assert [r["loss"] for r in after] == [r["loss"] for r in reference]


SAVE_KILLED_AT = 10  # rank 0 dies renaming this iteration's checkpoint into place


def dies_renaming_the_checkpoint(rank: int, world_size: int, local_rank: int, settings) -> None:
    """train's own worker, except that rank 0 is killed (SIGKILL) at the moment it renames
    ``iter_{SAVE_KILLED_AT}.tmp`` into place: every rank has written its shards, and the
    checkpoint is not complete yet. Deterministic, unlike a kill timed from outside."""
    from megatron_pp_ext.training.worker import worker

    if rank == 0:
        rename = os.rename

        def dying(source, target) -> None:
            if Path(source).name == f"iter_{SAVE_KILLED_AT:07d}.tmp":
                os.kill(os.getpid(), signal.SIGKILL)
            rename(source, target)

        os.rename = dying
    worker(rank, world_size, local_rank, settings)


@pytest.mark.slow
def test_a_rank_killed_while_saving_leaves_the_last_checkpoint_whole(tmp_path: Path, capfd) -> None:
    from megatron_pp_ext import launch
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.megatron.checkpoint import read_tracker
    from megatron_pp_ext.training.worker import fatal_message

    ckpt = tmp_path / "ckpt"
    argv = [*JOB, "--train-iters", "12", "--save", str(ckpt), "--pp-p2p-timeout", "5"]
    settings = settings_from_argv(argv, world_size=None)
    with pytest.raises(launch.WorkerDied) as died:
        launch.run(dies_renaming_the_checkpoint, 4, settings, grace_s=settings.timeout + 10)
    assert re.match(r"rank 0 ended \(killed by SIGKILL\)", str(died.value)), died.value
    # the save cut short left its staging directory; the tracker still names iteration 5, whole
    assert read_tracker(ckpt) == 5
    assert (ckpt / f"iter_{SAVE_KILLED_AT:07d}.tmp").is_dir()
    assert not (ckpt / f"iter_{SAVE_KILLED_AT:07d}").exists()
    assert (ckpt / "iter_0000005" / "metadata.json").is_file()
    line = fatal_message(settings, died.value, others="the other ranks stopped")
    assert f"the last checkpoint is {ckpt / 'iter_0000005'}" in line and f"--load {ckpt}" in line, line
    # each survivor said in one line where it was: saving iteration 10's checkpoint
    err = capfd.readouterr().err
    survivors = re.findall(r"megatron-pp-ext train: rank (\d): error: (.*)", err)
    assert {rank for rank, _ in survivors} == {"1", "2", "3"}, err
    assert all("saving the checkpoint of iteration 10" in text for _, text in survivors), survivors
    assert "Traceback" not in err, err
    # the same command with --load resumes from iteration 5, saves 10 over the leftover, ends
    # (saving 12, the last)
    resumed = start(tmp_path, 12, "--load", str(ckpt))
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert read_tracker(ckpt) == 12 and not (ckpt / f"iter_{SAVE_KILLED_AT:07d}.tmp").exists()
    assert (ckpt / f"iter_{SAVE_KILLED_AT:07d}" / "metadata.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows][-7:] == list(range(6, 13)), rows
