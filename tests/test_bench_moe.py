"""`megatron-pp-ext bench --against megatron` on the mixture-of-experts bench model with expert
parallelism (issue 46): ``--model-size moe-tiny --expert-model-parallel-size 2`` runs PP 2 x EP 2
(two data-parallel pipelines, 4 gloo ranks), and ``--overlap-moe-expert-parallel-comm`` times each
of our schedules paired beside itself unpaired, and megatron-core's combined 1F1B beside its
interleaved 1F1B. Every job computes the same first step (the bench's own check); paired jobs run
pairs. Behaviour only: no wall-clock is asserted."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from types import SimpleNamespace

import pytest
from exactness import check as check_error
from exactness import training_tolerance

PAIR_FLAG = "--overlap-moe-expert-parallel-comm"
EP_FLAG = "--expert-model-parallel-size"
MOE = ("--against", "megatron", "--model-size", "moe-tiny")
NAMES = ["1f1b", "interleaved-1f1b", "dualpipev"]
MICROBATCHES, ROUNDS = 4, 2


def bench_args(*flags: str) -> argparse.Namespace:
    from megatron_pp_ext.cli import build_parser

    return build_parser(["bench"]).parse_args(["bench", *flags])


@pytest.mark.parametrize(
    ("flags", "flag", "says"),
    [
        ([EP_FLAG, "2"], EP_FLAG, "no experts"),
        ([PAIR_FLAG], PAIR_FLAG, "no experts"),
        ([*MOE, EP_FLAG, "3"], EP_FLAG, "must divide the 4 experts"),
        ([*MOE, EP_FLAG, "0"], EP_FLAG, "at least 1"),
        (["--model-size", "moe-tiny", EP_FLAG, "2"], "--model-size", "--against megatron"),
        ([*MOE, PAIR_FLAG], PAIR_FLAG, f"{EP_FLAG} 2"),
        ([*MOE, EP_FLAG, "2", PAIR_FLAG, "--pp-offload", "full"], PAIR_FLAG, "--pp-offload"),
        (["--emulate", "1,2,1", EP_FLAG, "2"], EP_FLAG, "drop it"),
    ],
)
def test_expert_flags_refused_in_one_line_naming_the_flag(flags: list[str], flag: str, says: str) -> None:
    from megatron_pp_ext.commands.bench import check
    from megatron_pp_ext.errors import UsageError

    with pytest.raises(UsageError) as caught:
        check(bench_args(*flags))
    message = str(caught.value)
    assert caught.value.flag == flag and says in message and "\n" not in message, message


def test_moe_overlap_flags_pass_the_checks_and_leave_emulation_alone() -> None:
    """The flag alone pairs the real model; with --emulate it stays the emulation's."""
    from megatron_pp_ext.commands.bench import check, emulating

    args = bench_args(*MOE, EP_FLAG, "2", PAIR_FLAG)
    check(args)
    assert not emulating(args)
    assert emulating(bench_args("--emulate", "8,8,8", PAIR_FLAG))


def test_rows_plan_ours_paired_and_megatron_s_combined_1f1b() -> None:
    """Each schedule paired as train pairs it (its pairs in ``meta``, lowered, NCCL-safe);
    Megatron's combined 1F1B only beside its interleaved 1F1B; sliced schedules not paired."""
    from megatron_pp_ext.bench.job import BenchSettings, plan_row
    from megatron_pp_ext.schedule import pairs

    rows = {name: plan_row(name, 2, 8, "moe-tiny", "megatron", overlap=True) for name in [*NAMES, "seq1f1b"]}
    assert pairs.count(rows["dualpipev"].paired) > 0 and pairs.count(rows["dualpipev"].ours) == 0
    assert rows["interleaved-1f1b"].megatron_combined.overlap
    assert rows["1f1b"].megatron_combined is None and rows["dualpipev"].megatron_combined is None
    assert rows["seq1f1b"].paired is None and "sequence slices" in rows["seq1f1b"].paired_skip
    settings = BenchSettings(2, 8, 1, 0, "moe-tiny", [], "", ep=2, overlap=True)
    assert settings.world == 4 and settings.model["extra"]["expert_model_parallel_size"] == 2
    assert plan_row("1f1b", 2, 8, "moe-tiny", "megatron").paired is None  # without the flag


@functools.cache
def _run() -> dict:
    """The bench on 4 processes: PP 2 x EP 2, ours paired and unpaired, ROUNDS paired rounds."""
    from megatron_pp_ext import launch
    from megatron_pp_ext.bench.job import BenchSettings, ordered_names, plan_row
    from megatron_pp_ext.bench.worker import worker

    rows = [
        plan_row(name, 2, MICROBATCHES, "moe-tiny", "megatron", overlap=True)
        for name in ordered_names(NAMES, "megatron")
    ]
    settings = BenchSettings(
        2, MICROBATCHES, ROUNDS, 0, "moe-tiny", rows, "", timeout=120, quiet=True, against="megatron", ep=2,
        overlap=True,
    )  # fmt: skip
    settings_for = lambda path: dataclasses.replace(settings, output=path)
    return json.loads(launch.run_for_results(worker, settings.world, settings_for))


@pytest.mark.slow
def test_every_job_computes_megatron_s_first_step_and_paired_jobs_run_pairs() -> None:
    results = _run()
    assert (results["pp"], results["ep"], results["world"]) == (2, 2, 4)
    assert [row["schedule"] for row in results["rows"]] == NAMES
    model = SimpleNamespace(num_layers=4, hidden_size=64, ffn_hidden_size=128, seq_length=32, dtype="float32")
    limit = training_tolerance(model, MICROBATCHES, steps=1, data_parallel=2)
    reference = results["rows"][0]["megatron"]
    for row in results["rows"]:
        for skip in ("ours_skip", "megatron_skip", "ours_paired_skip"):
            assert row[skip] is None, (row["schedule"], skip, row[skip])
        for key in ("check", "ours_paired_check"):
            assert row[key]["match"], (row["schedule"], key, row[key])
        jobs = ["ours", "ours_paired", "megatron"] + ["megatron_combined"] * ("megatron_combined" in row)
        for job in jobs:
            data = row[job]
            assert len(data["times_s"]) == ROUNDS and len(data["peak_activation_bytes"]) == 4, job
            for key in ("loss", "grad_norm"):  # the step of Megatron's 1F1B, whatever the schedule
                first, theirs = data[f"first_{key}"], reference[f"first_{key}"]
                check_error(abs(first - theirs) / abs(theirs), limit, f"{row['schedule']} {job} {key}")
        assert not any(row["ours"]["pairs"]), row["ours"]["pairs"]  # unpaired
        assert row["paired_over_unpaired"]["rounds"] == ROUNDS
    paired = {row["schedule"]: row["ours_paired"]["pairs"] for row in results["rows"]}
    for name in ("1f1b", "dualpipev"):
        assert sum(paired[name]) > 0, (name, paired[name])


@pytest.mark.slow
def test_megatron_s_combined_1f1b_runs_on_cpu_beside_its_interleaved_1f1b() -> None:
    """megatron-core's combined 1F1B (cpu_shim gives combined_1f1b.py host streams): it runs,
    computes the step of Megatron's interleaved 1F1B, and is our paired interleaved 1F1B's baseline."""
    from megatron_pp_ext.bench import report

    row = _run()["rows"][1]
    assert row["megatron_combined_schedule"] == "interleaved combined-1f1b"
    assert row["megatron_combined_skip"] is None and row["megatron_combined_check"]["match"]
    assert row["ours_paired_baseline"] == "megatron_combined"
    assert row["megatron_combined_over_megatron"]["rounds"] == ROUNDS
    lines = report.table_rows(_run())
    assert [line["schedule"] for line in lines] == [name + tail for name in NAMES for tail in ("", " paired")]
    assert lines[3]["megatron schedule"] == "interleaved combined-1f1b"
    assert "Megatron combined/plain" in lines[3]["notes"] and "MISMATCH" not in lines[3]["notes"]
