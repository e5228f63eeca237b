"""``plan`` on Megatron's layout flags (issue 26): pins, impossible pins refused in one line,
``--from-args`` and ``--from-sbatch`` predicting a given run, the published table, and the free
search never predicting worse than a pinned layout it could have chosen."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from cli_runner import run_main

from megatron_pp_ext.planner.published import predict, problem_of, published_runs
from megatron_pp_ext.planner.search import search

REPO = Path(__file__).resolve().parent.parent

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh with its arrays expanded.
GPT3_EXAMPLE = (
    "torchrun --nproc_per_node 8 --nnodes 1 --master_addr localhost --master_port 6000 pretrain_gpt.py "
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size 1536 "
    "--rampup-batch-size 16 16 5859375 --train-iters 500000 --weight-decay 0.1 --fp16 --lr 6.0e-5 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path /data/x_text_document "
    "--vocab-file /data/gpt2-vocab.json --merge-file /data/gpt2-merges.txt --split 949,50,1"
)


def test_pins_fix_their_dimensions_and_the_rest_is_searched(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_main(
        capsys,
        ["plan", "--model", "llama2-70b", "--gpus", "64", "--seq-length", "8192", "--json", "--top", "5",
         "--tensor-model-parallel-size", "4", "--pp-schedule", "interleaved-1f1b"],
    )  # fmt: skip
    assert code == 0
    plans = json.loads(out)
    assert plans and all(p["tp"] == 4 and p["schedule"] == "interleaved-1f1b" for p in plans)
    assert len({(p["pp"], p["vpp"], p["cp"]) for p in plans}) > 1  # the rest varies


@pytest.mark.parametrize(
    ("pins", "flag", "why"),
    [
        (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size",
         "does not divide the 64 attention heads"),
        (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "3"],
         "--pipeline-model-parallel-size",
         "= 24 does not divide --gpus 64"),
        (["--pipeline-model-parallel-size", "1", "--num-virtual-stages-per-pipeline-rank", "2"],
         "--num-virtual-stages-per-pipeline-rank", "need --pipeline-model-parallel-size > 1"),
        (["--pp-schedule", "1f1b", "--pp-seq-slices", "4"], "--pp-seq-slices", "runs whole sequences"),
        (["--recompute-num-layers", "2"], "--recompute-num-layers", "--recompute-method block"),
        (["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"],
         "--tensor-model-parallel-size", "out of memory"),
    ],
)  # fmt: skip
def test_impossible_pins_are_refused_in_one_line(
    capsys: pytest.CaptureFixture, pins: list[str], flag: str, why: str
) -> None:
    code, out, err = run_main(capsys, ["plan", "--model", "llama2-70b", "--gpus", "64", *pins])
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and why in lines[0], err


def test_from_args_predicts_megatron_s_gpt3_example(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_main(
        capsys, ["plan", "--from-args", GPT3_EXAMPLE, "--gpus", "1536", "--gpu", "a100-80gb", "--json"]
    )
    assert code == 0
    answer = json.loads(out)
    run = answer["run"]
    # exactly the line's layout, with Megatron's defaults where it is silent
    assert (run["tp"], run["cp"], run["pp"], run["dp"], run["vpp"]) == (8, 1, 16, 12, 1)
    assert run["schedule"] == "1f1b" and run["global_batch_size"] == 1536 and run["micro_batch_size"] == 1
    assert (
        not run["sequence_parallel"] and not run["distributed_optimizer"] and not run["overlap_grad_reduce"]
    )
    assert any("rampup" in note for note in answer["notes"])
    alternative = answer["alternative"]
    assert alternative is not None and alternative["step_time_s"] < run["step_time_s"]
    assert answer["speedup"] == pytest.approx(run["step_time_s"] / alternative["step_time_s"])
    assert "--tensor-model-parallel-size" in answer["alternative_flags"]


def test_from_args_text_shows_the_run_then_the_alternative(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_main(
        capsys, ["plan", "--from-args", GPT3_EXAMPLE, "--gpus", "1536", "--gpu", "a100-80gb"]
    )
    assert code == 0
    assert "the run: TP8 CP1 PP16 DP12 no-SP no-distopt 1f1b" in out
    assert re.search(r"best alternative: .* \(\d+\.\d\dx the run's throughput\)", out)
    assert (
        "TFLOP/s per GPU" in out
        and "memory per GPU" in out
        and "  flags: --tensor-model-parallel-size" in out
    )


@pytest.mark.parametrize(
    ("extra", "flag", "why"),
    [
        ([], "--tensor-model-parallel-size", "= 128 does not divide the 8 GPUs"),  # the example's one node
        (["--gpus", "1536", "--model", "llama2-7b"], "--model", "leave --model out"),
    ],
)
def test_from_args_that_cannot_run_is_refused_in_one_line(
    capsys: pytest.CaptureFixture, extra: list[str], flag: str, why: str
) -> None:
    code, out, err = run_main(capsys, ["plan", "--from-args", GPT3_EXAMPLE, *extra])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and flag in err and why in err, err


@pytest.mark.parametrize(
    ("line", "flag"),
    [
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096", "--vocab-size"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 32000", "--seq-length"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 "
         "--moe-router-topk 2", "--moe-router-topk"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 "
         "--num-experts 8 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather",
         "--moe-token-dispatcher-type"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 "
         "--num-experts 8 --moe-layer-freq '([0]*2+[1]*2)'", "--moe-layer-freq"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 "
         "--num-experts 8 --moe-layer-freq '__import__(\"os\")'", "--moe-layer-freq"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 32000 "
         "--num-experts 8 --moe-router-topk 9", "--num-experts"),
        ("--num-layers $L --hidden-size 4096", "--from-args"),
        ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
         "--vocab-size 32000", "--gpus"),
    ],
)  # fmt: skip
def test_from_args_names_what_the_line_lacks(capsys: pytest.CaptureFixture, line: str, flag: str) -> None:
    code, _, err = run_main(capsys, ["plan", "--from-args", line])
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err


SBATCH = sorted((REPO / "scripts" / "slurm").glob("*.sbatch"))


def _sbatch_defaults(path: Path) -> dict[str, str]:
    """The layout variables the file sets (``: "${TP:=8}"``)."""
    return dict(re.findall(r"\$\{(\w+):=([^}]*)\}", path.read_text()))


@pytest.mark.parametrize("path", SBATCH, ids=[p.stem for p in SBATCH])
def test_from_sbatch_predicts_each_of_our_scripts(capsys: pytest.CaptureFixture, path: Path) -> None:
    code, out, err = run_main(
        capsys, ["plan", "--from-sbatch", str(path), "--json", "--max-simulations", "8"]
    )
    answer = json.loads(out)
    run = answer["run"]
    assert code == (0 if run["fits"] else 2), err
    values = _sbatch_defaults(path)
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", path.read_text()).group(1))
    assert run["tp"] * run["cp"] * run["pp"] * run["dp"] == nodes * 8
    assert (run["tp"], run["pp"]) == (int(values["TP"]), int(values["PP"]))
    assert run["schedule"] == values["PP_SCHEDULE"]
    if "PP_SEQ_SLICES" in values and values["PP_SEQ_SLICES"]:
        assert run["slices"] == int(values["PP_SEQ_SLICES"])
    assert run["step_time_s"] > 0 and run["memory_gib"] > 0


def test_from_sbatch_of_a_missing_file_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    code, _, err = run_main(capsys, ["plan", "--from-sbatch", str(tmp_path / "none.sbatch")])
    assert code == 2 and "--from-sbatch" in err and "cannot read" in err


# The accuracy table of docs/planner.md, pinned: predicted seconds per step of each published row
# (a change to the cost model that moves a row shows here and must update the docs).
PREDICTED = {
    ("Korthikanti", "gpt-22b"): 1.079,
    ("Korthikanti", "gpt-175b"): 13.479,
    ("Korthikanti", "gpt-530b"): 37.278,
    ("Korthikanti", "gpt-1t"): 74.562,
    ("Narayanan", "gpt-145b"): 25.127,
    ("Narayanan", "gpt-310b"): 36.949,
    ("Narayanan", "gpt-530b"): 54.429,
    ("Narayanan", "gpt-1t"): 100.693,
    ("Megatron-LM", "gpt-1.7b"): 0.411,
    ("Megatron-LM", "gpt-7.1b"): 0.783,
    ("Megatron-LM", "gpt-16b"): 0.865,
    ("Megatron-LM", "gpt-32b"): 0.861,
    ("Megatron-LM", "gpt-70b"): 1.885,
    ("Megatron-LM", "gpt-119b"): 3.143,
    ("Megatron-LM", "gpt-177b"): 4.641,
    ("Megatron-LM", "gpt-314b"): 8.018,
    ("Megatron-LM", "gpt-462b"): 11.975,
}
RUNS = [run for run in published_runs() if run.shape.name != "llama3-405b"]


@pytest.mark.parametrize("run", RUNS, ids=[f"{r.source.split()[0]}-{r.shape.name}" for r in RUNS])
def test_published_runs_are_predicted_as_pinned(run) -> None:  # noqa: ANN001
    plan = predict(run)
    c = plan.candidate
    assert (c.layout.tp, c.layout.cp, c.layout.pp, c.layout.dp) == (
        run.layout.tp,
        1,
        run.layout.pp,
        run.layout.dp,
    )
    assert (c.schedule, c.vpp, c.recompute, c.tp_comm_overlap) == (
        run.schedule,
        run.vpp,
        run.recompute,
        run.tp_comm_overlap,
    )
    assert plan.microbatches == run.global_batch // (run.layout.dp * run.micro_batch)
    assert plan.simulated_microbatches == plan.microbatches  # every microbatch replayed
    assert plan.step_time == pytest.approx(PREDICTED[(run.source.split()[0], run.shape.name)], rel=0.005)
    error = plan.step_time / run.published_step - 1
    assert abs(error) < 0.15, f"{run.shape.name}: {error:+.1%}"


SEARCHABLE = [r for r in RUNS if r.layout.gpus <= 384]


@pytest.mark.parametrize("run", SEARCHABLE, ids=[f"{r.source.split()[0]}-{r.shape.name}" for r in SEARCHABLE])
def test_the_free_search_never_predicts_worse_than_a_pinned_layout_it_could_choose(run) -> None:  # noqa: ANN001
    pinned = predict(run)
    assert pinned.fits
    result = search(problem_of(run), top=3, pins=run.pins().environment())
    assert result.plans and result.plans[0].step_time <= pinned.step_time * (1 + 1e-9)


def test_llama3_rows_are_reported_as_not_fitting_by_our_accounting() -> None:
    """The two Llama 3 405B rows ran; by our activation accounting (no recomputation, interleaved
    with 2 chunks) they need more than 80 GB, which docs/planner.md says rather than hides."""
    for run in published_runs():
        if run.shape.name == "llama3-405b":
            assert not predict(run).fits


UNEVEN = (
    "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 30 --hidden-size 4096 --num-attention-heads 32 "
    "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 64 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --vocab-size 32000 --bf16 --swiglu"
)


@pytest.mark.parametrize(
    "flags, layers, vpp",
    [
        ("--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6", [6, 9, 9, 6], 1),
        ("--decoder-first-pipeline-num-layers 6", [6, 8, 8, 8], 1),
        ("--decoder-last-pipeline-num-layers 3", [9, 9, 9, 3], 1),
        # with chunks: each rank's count over its chunks (stage = chunk x 4 + rank)
        (
            "--decoder-last-pipeline-num-layers 6 --num-virtual-stages-per-pipeline-rank 2",
            [4, 4, 4, 3] * 2,
            2,
        ),
        ("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", [7, 8, 8, 7], 1),
        (
            "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
            "--num-layers-per-virtual-pipeline-stage 2",
            [1] + [2] * 14 + [1],
            4,
        ),
        ("--pipeline-model-parallel-layout 'E|t*10|t*10|t*10,L'", [0, 10, 10, 10], 1),
        ("--pipeline-model-parallel-layout 'Et*3|(t*4|)*6,t*3L'", [3] + [4] * 6 + [3], 2),
    ],
)
def test_from_args_predicts_megatron_s_layer_split_flags(
    capsys: pytest.CaptureFixture, flags: str, layers: list[int], vpp: int
) -> None:
    """megatron-core's split under each of its flags (``schedule/layer_split.py``, checked against
    megatron-core in test_layer_split.py) is the split the prediction runs."""
    code, out, err = run_main(
        capsys, ["plan", "--from-args", f"{UNEVEN} {flags}", "--json", "--max-simulations", "1"]
    )
    assert code == 0, err
    run = json.loads(out)["run"]
    assert run["stage_layers"] == layers and sum(layers) == 30
    assert run["vpp"] == vpp and run["schedule"] == ("1f1b" if vpp == 1 else "interleaved-1f1b")


def test_from_args_refuses_uneven_stages_megatron_core_refuses(capsys: pytest.CaptureFixture) -> None:
    for flags, flag in (
        ("--decoder-first-pipeline-num-layers 7", "--decoder-first-pipeline-num-layers"),
        (
            "--decoder-last-pipeline-num-layers 3 --num-virtual-stages-per-pipeline-rank 2",
            "--decoder-last-pipeline-num-layers",
        ),
        (
            "--decoder-last-pipeline-num-layers 6 --num-layers-per-virtual-pipeline-stage 2",
            "--num-layers-per-virtual-pipeline-stage",
        ),
        ("--account-for-embedding-in-pipeline-split", "--account-for-embedding-in-pipeline-split"),
        ("--pipeline-model-parallel-layout 'Et*14|t*16L'", "--pipeline-model-parallel-layout"),
        ("--pipeline-model-parallel-layout 'Et*7|t*8|t*8|t*7L|'", "--pipeline-model-parallel-layout"),
        ("--pipeline-model-parallel-layout 'Et*7|t*8|t*8|t*6mL'", "--pipeline-model-parallel-layout"),
        # pretrain_gpt.py refuses a layout under a V: megatron-core places its stages round-robin
        (
            "--pipeline-model-parallel-layout 'Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*3L' --pp-schedule v-half",
            "--pipeline-model-parallel-layout",
        ),
        (
            "--pipeline-model-parallel-layout 'Et*7|t*8|t*8|t*7L' --num-virtual-stages-per-pipeline-rank 2",
            "--pipeline-model-parallel-layout",
        ),
    ):
        code, _, err = run_main(capsys, ["plan", "--from-args", f"{UNEVEN} {flags}"])
        assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err


def test_the_search_splits_layers_unevenly_as_megatron_can_and_emits_the_flags(
    capsys: pytest.CaptureFixture,
) -> None:
    """32 layers on PP7 (a pin refused before: no even split): Megatron's
    --decoder-first/last-pipeline-num-layers make it possible; the search predicts it with such a
    split (the output layer's rank lighter), --emit flags writes the flags, and they read back
    through --from-args to the same prediction."""
    base = ["--model", "llama2-7b", "--gpus", "7", "--seq-length", "4096", "--schedules", "1f1b"]
    base += ["--global-batch-size", "28", "--pipeline-model-parallel-size", "7"]
    code, top, err = run_main(capsys, ["plan", *base, "--json", "--top", "1"])
    assert code == 0, err
    best = json.loads(top)[0]
    assert best["pp"] == 7 and best["stage_layers"] == [4, 5, 5, 5, 5, 5, 3]
    code, flags, _ = run_main(capsys, ["plan", *base, "--emit", "flags"])
    assert "--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 3" in flags
    code, out, err = run_main(
        capsys, ["plan", "--from-args", flags.strip() + " --vocab-size 32000", "--gpus", "7", "--json"]
    )
    assert code == 0, err
    run = json.loads(out)["run"]
    assert run["stage_layers"] == best["stage_layers"]
    assert run["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-6)
    # the same line without the split: Megatron refuses 32 layers over 7 ranks; the error says how
    even = re.sub(r" --decoder-(first|last)-pipeline-num-layers \d+", "", flags.strip())
    code, _, err = run_main(capsys, ["plan", "--from-args", even + " --vocab-size 32000", "--gpus", "7"])
    assert code == 2 and "--decoder-first-pipeline-num-layers 3" in err and len(err.strip().splitlines()) == 1


def test_the_search_lightens_the_output_layer_s_rank_where_that_beats_the_even_split() -> None:
    """Llama 3 8B (a 128K vocabulary: the output layer is about two layers' work) on TP2 x PP4:
    32 layers divide evenly, but 8/9/9/6 (--decoder-first/last-pipeline-num-layers 8 and 6) takes
    the last rank's extra work off the critical path; the search finds it, predicted faster than
    the even split of the same plan."""
    from dataclasses import replace

    from megatron_pp_ext.planner.devices import get_profile
    from megatron_pp_ext.planner.pins import Pins
    from megatron_pp_ext.planner.step import Problem, evaluate
    from megatron_pp_ext.schedule.models import get_model

    problem = Problem(get_model("llama3-8b"), 8192, 8, get_profile("h100-80gb"), 64)
    result = search(problem, top=1, schedules=["1f1b"], pins=Pins(tp=2, pp=4))
    best = result.plans[0]
    assert best.candidate.layers == (8, 9, 9, 6)
    even = evaluate(problem, replace(best.candidate, layers=None, split=None), full=True)
    assert even.step_time > best.step_time * 1.05


def test_from_args_reads_its_own_flags_the_way_plan_emits_them(capsys: pytest.CaptureFixture) -> None:
    """Round trip: plan's --emit flags, given back through --from-args, predict the same plan
    (read back the way Megatron reads them: every pin from the line)."""
    base = ["--model", "llama3-8b", "--gpus", "16", "--seq-length", "8192", "--global-batch-size", "64"]
    code, flags, _ = run_main(capsys, ["plan", *base, "--emit", "flags"])
    assert code == 0
    code, top, _ = run_main(capsys, ["plan", *base, "--json", "--top", "1"])
    best = json.loads(top)[0]
    # --emit flags leaves the tokenizer to the user; its vocabulary comes with it
    line = flags.strip() + " --vocab-size 128256"
    code, out, _ = run_main(capsys, ["plan", "--from-args", line, "--gpus", "16", "--json"])
    assert code == 0, shlex.split(flags)
    run = json.loads(out)["run"]
    for key in ("tp", "cp", "pp", "dp", "vpp", "schedule", "slices", "offload", "recompute"):
        assert run[key] == best[key], key
    assert run["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-6)


def test_vocabulary_parallelism_pinned_spreads_the_output_layer(capsys: pytest.CaptureFixture) -> None:
    """--pp-vocab-parallel as a pin: the plans carry it, the last rank no longer holds the 128K
    output layer (smaller static memory), and the busiest-rank imbalance it caused (the bubble)
    shrinks; the flags it emits read back to the same plan."""
    base = ["--model", "llama3-8b", "--gpus", "32", "--seq-length", "8192", "--pp-schedule", "1f1b",
            "--pipeline-model-parallel-size", "8", "--json", "--top", "1"]  # fmt: skip
    _, plain, _ = run_main(capsys, ["plan", *base])
    code, spread, _ = run_main(capsys, ["plan", *base, "--pp-vocab-parallel", "vocab-2"])
    assert code == 0
    plain_plan, vocab_plan = json.loads(plain)[0], json.loads(spread)[0]
    assert plain_plan["vocab_parallel"] == "none" and vocab_plan["vocab_parallel"] == "vocab-2"
    static = lambda plan: sum(plan["memory_parts_gib"][k] for k in ("weights", "gradients", "optimizer"))  # noqa: E731
    assert static(vocab_plan) < static(plain_plan)
    assert vocab_plan["bubble"] < plain_plan["bubble"]
    assert vocab_plan["step_time_s"] < plain_plan["step_time_s"]
    code, flags, _ = run_main(
        capsys, ["plan", *base[:-3], "--pp-vocab-parallel", "vocab-2", "--emit", "flags"]
    )
    assert "--pp-vocab-parallel vocab-2" in flags
    code, out, _ = run_main(
        capsys, ["plan", "--from-args", flags.strip() + " --vocab-size 128256", "--gpus", "32", "--json"]
    )
    run = json.loads(out)["run"]
    assert run["vocab_parallel"] == "vocab-2"
    assert run["step_time_s"] == pytest.approx(vocab_plan["step_time_s"], rel=1e-6)
