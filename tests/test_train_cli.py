"""`megatron-pp-ext train`: bad input fails before any process starts, with the flag named;
the main job trains (loss falls) and reports per-rank step time and activation peaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def train(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_pp_ext", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--pp-schedule", "no-such"], "--pp-schedule"),
        (["--num-layers", "3"], "--num-layers"),  # 4 stages need at least 4 layers
        (["--microbatches", "0"], "--microbatches"),
        (["--pp-chunks", "3"], "--pp-chunks"),
        (["--config", "no-such-config"], "--config"),
    ],
)
def test_bad_input_fails_before_training(args: list[str], flag: str) -> None:
    done = train(*args, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert flag in last and "error" in last, done.stderr[-2000:]
    assert "train:" not in done.stdout  # no progress bar: nothing started


def test_world_size_from_the_launcher_must_match_pp() -> None:
    done = train("--pp", "4", env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, timeout=120)
    assert done.returncode == 2
    assert "--pp" in done.stderr and "2 processes" in done.stderr


@pytest.mark.slow
def test_main_job_trains_and_reports(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    done = train("--iterations", "12", "--metrics", str(metrics), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["iteration"] for row in rows] == list(range(1, 13))
    first, last = rows[0]["loss"], sum(row["loss"] for row in rows[-3:]) / 3
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    for rank in range(4):
        assert f"rank {rank}: step" in done.stdout and "peak activation" in done.stdout
