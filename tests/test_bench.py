"""`megatron-pp-ext bench`: bad flags fail in one line; a minimal run gives the documented JSON and
our schedules agree with torch.distributed.pipelining's on the first iteration's loss."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from cli_runner import run_cli
from exactness import check as check_error
from exactness import training_tolerance


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(["bench", *args], timeout=timeout)


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
    """Also under --pp-emulate-nccl: our runs then launch in NCCL's order (runtime/launch_order.py).
    With --pp-offload full each schedule also runs with activation offload, timed in the same
    rounds as the schedule without it: the same step, a lower peak where units live long (V-ZB
    keeps chunk 0's units on rank 0 across the whole V)."""
    done = bench(
        "--schedules", "1f1b,v-zb", "--iterations", "1", "--warmup", "0", "--microbatches", "4", "--json",
        "--pp-emulate-nccl", "--pp-offload", "full",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["pp"] == 2 and results["microbatches"] == 4 and results["model_size"] == "tiny"
    assert results["emulate_nccl"] is True
    assert results["backend"] in ("gloo", "nccl")
    rows = [(row["schedule"], row["offload"]) for row in results["rows"]]
    assert rows == [("1f1b", "none"), ("1f1b", "full"), ("v-zb", "none"), ("v-zb", "full")]
    # one step of the tiny bench model (bench/job.py: 4 layers, widths 64 and 128, 32 tokens, b=2)
    tiny = SimpleNamespace(num_layers=4, hidden_size=64, ffn_hidden_size=128, seq_length=32, dtype="float32")
    limit = training_tolerance(tiny, microbatches=4, steps=1)
    for row, torch_class in zip(results["rows"], ["Schedule1F1B"] * 2 + ["ScheduleZBVZeroBubble"] * 2):
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
        if row["offload"] == "full":
            assert (
                row["ours"]["same_step_as_plain"] is True and row["ours"]["offload_overhead"]["rounds"] == 1
            )
    offloaded = results["rows"][3]["ours"]
    peaks, without = (
        offloaded["peak_activation_bytes"],
        results["rows"][3]["ours_plain"]["peak_activation_bytes"],
    )
    assert peaks[0] < 0.8 * without[0], (peaks, without)


def test_schedules_shim_changes_only_megatron_schedules_module() -> None:
    """cpu_shim.install_for_schedules: Megatron's schedules count tokens on the CPU, torch itself
    (and every other module) still refuses a CUDA tensor on a CPU-only build."""
    code = (
        "import torch\n"
        "from megatron.core.pipeline_parallel import schedules\n"
        "from megatron_pp_ext.megatron import cpu_shim\n"
        "assert cpu_shim.install_for_schedules() == (not torch.cuda.is_available())\n"
        "if not torch.cuda.is_available():\n"
        "    t = schedules.torch.zeros([], dtype=torch.int, device='cuda')\n"
        "    assert t.device.type == 'cpu' and t.dtype == torch.int\n"
        "    assert schedules.torch.ones is torch.ones and schedules.torch.cuda is torch.cuda\n"
        "    try:\n"
        "        torch.zeros([], device='cuda')\n"
        "    except (RuntimeError, AssertionError):\n"
        "        print('torch unchanged')\n"
        "else:\n"
        "    print('torch unchanged')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch unchanged" in done.stdout


@pytest.mark.slow
def test_against_megatron_same_step_paired_rounds() -> None:
    """Megatron's own 1F1B and interleaved 1F1B beside ours, and V-ZB and SlimPipe against the
    faster of them: the same first-step loss and gradient norm, ten paired rounds each."""
    done = bench(
        "--against", "megatron", "--schedules", "v-zb,slimpipe", "--iterations", "10", "--warmup", "0",
        "--microbatches", "4", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["against"] == "megatron"
    # Megatron's two schedules always run first: the others are timed against the faster
    assert [row["schedule"] for row in results["rows"]] == ["1f1b", "interleaved-1f1b", "v-zb", "slimpipe"]
    medians = {row["megatron_schedule"]: row["megatron"]["median_s"] for row in results["rows"][:2]}
    assert set(medians) == {"1F1B", "interleaved 1F1B"}
    faster = min(medians, key=medians.__getitem__)
    tiny = SimpleNamespace(num_layers=4, hidden_size=64, ffn_hidden_size=128, seq_length=32, dtype="float32")
    limit = training_tolerance(tiny, microbatches=4, steps=1)
    first = results["rows"][0]["check"]["megatron"]
    for row in results["rows"]:
        assert row["ours_skip"] is None and row["megatron_skip"] is None, row
        if row["schedule"] not in ("1f1b", "interleaved-1f1b"):
            assert row["megatron_schedule"] == faster
        spread = row["ours_over_megatron"]
        assert spread["rounds"] == 10 and 0 < spread["min"] <= spread["median"] <= spread["max"]
        for side in ("ours", "megatron"):
            assert len(row[side]["times_s"]) == 10
            peaks = row[side]["peak_activation_bytes"]
            assert len(peaks) == 2 and min(peaks) > 0
        check = row["check"]
        assert check["match"], check
        for key in ("loss", "grad_norm"):
            # every schedule computes the step of Megatron's 1F1B
            error = abs(check["ours"][key] - first[key]) / abs(first[key])
            check_error(error, limit, f"{row['schedule']} {key}")
    assert "4 sequence slices" in results["rows"][3]["notes"]


def bench_args(*args: str):
    from megatron_pp_ext.cli import build_parser

    return build_parser(["bench"]).parse_args(["bench", *args])


@pytest.mark.parametrize(
    ("args", "flag", "says"),
    [
        (["--pp-offload", "full,bogus"], "--pp-offload", "unknown policy"),
        (["--offload-modules", "core_attn"], "--offload-modules", "--fine-grained-activation-offloading"),
        (
            [
                "--fine-grained-activation-offloading",
                "--offload-modules",
                "core_attn",
                "--pp-offload",
                "full",
            ],
            "--fine-grained-activation-offloading",
            "--against megatron",
        ),  # fmt: skip
        (
            ["--against", "megatron", "--fine-grained-activation-offloading", "--pp-offload", "full"],
            "--fine-grained-activation-offloading",
            "--offload-modules",
        ),  # fmt: skip
        (
            [
                "--against",
                "megatron",
                "--fine-grained-activation-offloading",
                "--offload-modules",
                "core_attn",
            ],
            "--fine-grained-activation-offloading",
            "--pp-offload full",
        ),  # fmt: skip
        (["--emulate", "1,2,1", "--pp-offload", "full"], "--pp-offload", "drop it"),
    ],
)
def test_offload_flags_fail_in_one_line_naming_the_flag(args: list[str], flag: str, says: str) -> None:
    from megatron_pp_ext.commands.bench import check
    from megatron_pp_ext.errors import UsageError

    with pytest.raises(UsageError) as caught:
        check(bench_args(*args))
    assert caught.value.flag == flag and says in str(caught.value)


def test_fine_grained_offloading_refused_where_megatron_cannot_run_it() -> None:
    """megatron-core's fine-grained offloading needs CUDA streams and Transformer Engine's
    cpu_offload: without them the bench says which is missing before any process starts."""
    import importlib.util

    import torch

    from megatron_pp_ext.commands.bench import check
    from megatron_pp_ext.errors import UsageError

    args = bench_args(
        "--against", "megatron", "--pp-offload", "full", "--fine-grained-activation-offloading",
        "--offload-modules", "core_attn", "attn_proj",
    )  # fmt: skip
    if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine"):
        check(args)  # runs here
        return
    with pytest.raises(UsageError) as caught:
        check(args)
    assert caught.value.flag == "--fine-grained-activation-offloading"
    assert ("CUDA" in str(caught.value)) != torch.cuda.is_available()
    assert "Transformer Engine" in str(caught.value) or importlib.util.find_spec("transformer_engine")


def test_offload_rows_pair_each_policy_with_its_plain_schedule() -> None:
    """Each --pp-offload policy is a row of its own after the schedule without offload; the row
    keeps the plain schedule to time beside it, and auto is left to the ranks (k is measured)."""
    from megatron_pp_ext.bench.job import plan_row
    from megatron_pp_ext.commands.bench import offload_modes
    from megatron_pp_ext.schedule.ir import OpKind

    assert offload_modes("auto,full,auto") == ["none", "auto", "full"]
    rows = {
        mode: plan_row("interleaved-1f1b", 2, 4, "tiny", "megatron", offload=mode)
        for mode in offload_modes("full,auto")
    }
    assert rows["none"].plain is None and rows["none"].offload == "none"
    kinds = {mode: {op.kind for _, _, op in row.ours.all_ops()} for mode, row in rows.items()}
    assert OpKind.OFFLOAD in kinds["full"] and OpKind.OFFLOAD not in kinds["none"]
    assert OpKind.OFFLOAD not in kinds["auto"]  # resolved on each rank from its measured k
    for mode in ("full", "auto"):
        assert (
            rows[mode].plain is not None and rows[mode].plain.comm_digest() == rows["none"].ours.comm_digest()
        )
        assert {op.kind for _, _, op in rows[mode].plain.all_ops()} == kinds["none"]
