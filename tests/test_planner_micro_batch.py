"""``plan`` searches the micro-batch size (issue 26): a larger one where the cost model says it
helps, 1 where memory forbids more, a ``--micro-batch-size`` pin kept or refused in one line, and
the chosen size in what ``--emit`` writes.

What the cost model gives a larger micro-batch (``kernels.py``, ``costs.py``, ``step.py``): fewer
launch gaps, collective and p2p latencies per token, and longer first forwards and last backwards
for the data-parallel parameter gather and gradient reduce to hide behind; against that, fewer
microbatches to fill the pipeline and more activations per microbatch. GEMM efficiency does not
depend on the tokens per kernel (one calibrated constant), so short sequences at PP 1 are where
it shows."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from megatron_pp_ext import configs
from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import devices
from megatron_pp_ext.planner.pins import Pins
from megatron_pp_ext.planner.predict import predict
from megatron_pp_ext.planner.search import micro_batch_options, search
from megatron_pp_ext.planner.step import Problem, evaluate

# Llama-2 7B on one node of H100s, 64 sequences per step.
BASE = ["--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64"]
ONE_RANK_PER_LAYER = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                      "--pipeline-model-parallel-size", "1"]  # fmt: skip


def llama2_7b(seq_length: int) -> Problem:
    return Problem(configs.shape("llama2-7b"), seq_length, 8, devices.get_profile("h100-80gb"), 64)


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_sizes_are_powers_of_two_dividing_a_dp_rank_s_share_or_the_pin() -> None:
    problem = llama2_7b(2048)
    layout = next(Pins(tp=1, cp=1, pp=1).layouts(8, 8))  # DP 8: 8 sequences per rank
    assert micro_batch_options(problem, layout, Pins()) == [1, 2, 4, 8]
    assert micro_batch_options(replace(problem, global_batch=24), layout, Pins()) == [1]
    assert micro_batch_options(problem, layout, Pins(micro_batch=4)) == [4]


def test_the_search_picks_a_larger_micro_batch_where_it_helps() -> None:
    """At 2K tokens, TP1 PP1 DP8: no pipeline to fill, so micro-batch 2 only saves (launch gaps,
    and the gradient reduce hides behind a longer last backward); 4 would be faster still but
    does not fit 80 GB."""
    problem = llama2_7b(2048)
    best = search(problem, top=3).plans[0]
    c = best.candidate
    assert (c.layout.tp, c.layout.cp, c.layout.pp, c.layout.dp, c.schedule) == (1, 1, 1, 8, "1f1b")
    assert c.micro_batch == 2 and best.microbatches == 4 and best.fits
    one = evaluate(problem, replace(c, micro_batch=1), full=True)
    assert one.fits and one.microbatches == 8
    assert best.step_time < one.step_time
    four = evaluate(problem, replace(c, micro_batch=4), full=True, check_memory=False)
    assert four.step_time < best.step_time and not four.fits


def test_the_search_keeps_micro_batch_1_where_memory_forbids_more() -> None:
    """At 4K tokens the same layout holds 67 GiB with micro-batch 1; 2 would be faster but needs
    more than the 80 GB."""
    problem = llama2_7b(4096)
    best = search(problem, top=3, pins=Pins(tp=1, cp=1, pp=1)).plans[0]
    assert best.candidate.micro_batch == 1 and best.microbatches == 8
    two = evaluate(problem, replace(best.candidate, micro_batch=2), full=True, check_memory=False)
    assert two.step_time < best.step_time and not two.fits


@pytest.mark.parametrize("size", [1, 2])
def test_the_free_search_never_predicts_worse_than_a_pinned_micro_batch(size: int) -> None:
    problem = llama2_7b(2048)
    pinned = predict(problem, Pins(tp=1, cp=1, pp=1, schedule="1f1b", micro_batch=size))
    assert pinned.fits and pinned.candidate.micro_batch == size
    best = search(problem, top=3).plans[0]
    assert best.step_time <= pinned.step_time * (1 + 1e-9)


def test_a_pinned_micro_batch_is_kept(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_cli(capsys, *BASE, "--seq-length", "2048", "--micro-batch-size", "4", "--json")
    assert code == 0
    plans = json.loads(out)
    assert plans and all(p["micro_batch_size"] == 4 for p in plans)
    assert all(p["microbatches"] == 64 // (p["dp"] * 4) for p in plans)
    code, out, _ = run_cli(capsys, *BASE, "--seq-length", "2048", "--micro-batch-size", "4", "--top", "2")
    assert "pinned: --micro-batch-size" in out.splitlines()[0]


@pytest.mark.parametrize(
    ("pins", "why"),
    [
        (["--seq-length", "2048", "--micro-batch-size", "3"],
         "--micro-batch-size 3 does not divide the global batch of 64 sequences"),
        (["--seq-length", "2048", *ONE_RANK_PER_LAYER, "--micro-batch-size", "16"],
         "--micro-batch-size 16 does not divide the 8 sequences of a DP rank (global batch 64 over DP 8)"),
        (["--seq-length", "2048", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
        (["--seq-length", "32768", "--micro-batch-size", "64"],
         "with --micro-batch-size pinned: out of memory"),
    ],
    ids=["batch", "dp-share", "zero", "memory"],
)  # fmt: skip
def test_an_impossible_micro_batch_pin_is_refused_in_one_line(
    capsys: pytest.CaptureFixture, pins: list[str], why: str
) -> None:
    code, out, err = run_cli(capsys, *BASE, *pins)
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if not line.startswith("plan: simulated")]
    assert len(lines) == 1 and "--micro-batch-size" in lines[0] and why in lines[0], err


def test_the_table_and_the_emitted_flags_carry_the_chosen_micro_batch(capsys: pytest.CaptureFixture) -> None:
    args = [*BASE, "--seq-length", "2048"]
    code, out, _ = run_cli(capsys, *args, "--top", "1")
    header, _, first = out.splitlines()[1:4]
    assert code == 0 and dict(zip(header.split(), first.split()))["mb"] == "2"
    assert "4 microbatches of 2 per DP rank" in out
    code, flags, _ = run_cli(capsys, *args, "--emit", "flags")
    assert code == 0 and "--micro-batch-size 2 --global-batch-size 64" in flags
    code, script, _ = run_cli(capsys, *args, "--emit", "sbatch")
    assert code == 0 and '"${MICRO_BATCH_SIZE:=2}"' in script and "micro-batch 2" in script
    # read back as a run: the same plan, micro-batch size and all
    line = flags.strip() + " --vocab-size 32000"
    code, answer, _ = run_cli(capsys, "--from-args", line, "--gpus", "8", "--json")
    run = json.loads(answer)["run"]
    code, top, _ = run_cli(capsys, *args, "--json", "--top", "1")
    assert run["micro_batch_size"] == 2 and run["step_time_s"] == pytest.approx(
        json.loads(top)[0]["step_time_s"], rel=1e-6
    )


def test_from_args_keeps_the_line_s_micro_batch_and_the_alternative_searches_it(
    capsys: pytest.CaptureFixture,
) -> None:
    """A given run is predicted at its own --micro-batch-size (1 here); the best alternative is the
    free search, micro-batch size included."""
    pinned = [*BASE, "--seq-length", "2048", *ONE_RANK_PER_LAYER, "--pp-schedule", "1f1b",
              "--micro-batch-size", "1"]  # fmt: skip
    code, flags, _ = run_cli(capsys, *pinned, "--emit", "flags")
    assert code == 0 and "--micro-batch-size 1" in flags
    line = flags.strip() + " --vocab-size 32000"
    code, out, _ = run_cli(capsys, "--from-args", line, "--gpus", "8", "--json")
    assert code == 0
    answer = json.loads(out)
    run, alternative = answer["run"], answer["alternative"]
    assert run["micro_batch_size"] == 1 and run["microbatches"] == 8
    assert run["step_time_s"] == pytest.approx(
        predict(llama2_7b(2048), Pins(tp=1, cp=1, pp=1, schedule="1f1b", micro_batch=1)).step_time, rel=1e-9
    )
    assert alternative["micro_batch_size"] == 2 and alternative["step_time_s"] < run["step_time_s"]
    flags = shlex.split(" ".join(answer["alternative_flags"]))
    assert flags[flags.index("--micro-batch-size") + 1] == "2"
