"""`megatron-pp-ext bench`: bad flags fail in one line; a minimal run gives the documented JSON and
our schedules agree with torch.distributed.pipelining's on the first iteration's loss."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from exactness import check as check_error
from exactness import training_tolerance


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_pp_ext", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--schedules", "no-such"], "--schedules"),
        (["--pp", "1"], "--pp"),
        (["--iterations", "0"], "--iterations"),
    ],
)
def test_bad_flags_fail_before_launch(args: list[str], flag: str) -> None:
    done = bench(*args, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert flag in last and "error" in last
    assert "bench:" not in done.stderr.replace("megatron-pp-ext bench:", "")  # no progress bar


@pytest.mark.slow
def test_minimal_bench_json_and_loss_check() -> None:
    """Also under --pp-emulate-nccl: our runs then launch in NCCL's order (runtime/launch_order.py)."""
    done = bench(
        "--schedules", "1f1b,v-zb", "--iterations", "1", "--warmup", "0", "--microbatches", "4", "--json",
        "--pp-emulate-nccl",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["pp"] == 2 and results["microbatches"] == 4 and results["model_size"] == "tiny"
    assert results["emulate_nccl"] is True
    assert results["backend"] in ("gloo", "nccl")
    assert [row["schedule"] for row in results["rows"]] == ["1f1b", "v-zb"]
    # one step of the tiny bench model (bench/job.py: 4 layers, widths 64 and 128, 32 tokens, b=2)
    tiny = SimpleNamespace(num_layers=4, hidden_size=64, ffn_hidden_size=128, seq_length=32, dtype="float32")
    limit = training_tolerance(tiny, microbatches=4, steps=1)
    for row, torch_class in zip(results["rows"], ["Schedule1F1B", "ScheduleZBVZeroBubble"]):
        assert row["torch_class"] == torch_class
        assert row["ours_skip"] is None and row["torch_skip"] is None, row
        for side in ("ours", "torch"):
            data = row[side]
            assert len(data["times_s"]) == 1 and data["median_s"] > 0
            assert len(data["peak_activation_bytes"]) == 2 and min(data["peak_activation_bytes"]) > 0
        assert row["ratio"] > 0
        check = row["check"]
        assert check["match"], check
        for key in ("loss", "grad_norm"):
            ours, theirs = check["ours"][key], check["torch"][key]
            check_error(abs(ours - theirs) / abs(theirs), limit, f"{row['schedule']} {key}")
