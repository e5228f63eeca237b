"""`megatron-pp-ext train`: bad input fails before any process starts, with the flag named;
the main job trains (loss falls) and reports per-rank step time and activation peaks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from cli_runner import run_cli
from exactness import check, train_tolerance


def train(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(["train", *args], env={**os.environ, **(env or {})}, timeout=timeout)


def train_fresh(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """In an interpreter of its own: what it prints while importing megatron-core counts."""
    command = [sys.executable, "-m", "megatron_pp_ext", "train", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


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


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--sequence-parallel"], "--sequence-parallel", "needs --tensor-model-parallel-size > 1"),
        (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size", "does not divide"),
        (["--context-parallel-size", "0"], "--context-parallel-size", "at least 1"),
        (["--context-parallel-size", "3"], "--seq-length", "2 x --context-parallel-size 3"),  # 128 % 6
        (  # slices of 8 tokens cannot be cut into 2 x 8 pieces
            ["--context-parallel-size", "8", "--pp-schedule", "slimpipe", "--pp-seq-slices", "16"],
            "--pp-seq-slices",
            "2 x --context-parallel-size 8",
        ),
        (["--global-batch-size", "7"], "--global-batch-size", "multiple of --micro-batch-size"),
        (
            ["--seq-length", "127", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "--seq-length",
            "not divisible",
        ),
        (["--data-parallel-size", "0"], "--data-parallel-size", "at least 1"),
    ],
)
def test_bad_parallel_layouts_fail_before_training(args: list[str], flag: str, words: str) -> None:
    done = train(*args, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert flag in last and words in last, last


def test_world_size_from_the_launcher_must_be_a_multiple_of_tp_x_pp() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0"}
    done = train("--pipeline-model-parallel-size", "4", env=env, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "--pipeline-model-parallel-size" in last and "6 processes" in last, last
    done = train("--pp", "2", "--data-parallel-size", "2", env=env, timeout=120)
    assert done.returncode == 2
    assert "--data-parallel-size" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.heavy
def test_tensor_sequence_context_and_data_parallel_runs_give_the_pipeline_only_losses(tmp_path) -> None:
    """The same global batch at TP1 x PP2, TP2 x PP2 with sequence parallelism, PP2 x DP2 with
    the distributed optimizer's layout and overlapped reduce, and CP2 x PP2 with Seq1F1B (2
    slices, each cut over the CP ranks): the same losses, step by step."""
    common = ["--pp-schedule", "zb-h1", "--train-iters", "2", "--global-batch-size", "8", "--num-layers", "4"]
    layouts = {
        "tp1": ["--pipeline-model-parallel-size", "2"],
        "tp2-sp": [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "2",
        ],
        "dp2": [
            "--pipeline-model-parallel-size",
            "2",
            "--data-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
        ],
        "cp2-seq1f1b": [
            "--context-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--pp-schedule",
            "seq1f1b",
            "--pp-seq-slices",
            "2",
        ],
    }
    losses = {}
    for name, layout in layouts.items():
        metrics = tmp_path / f"{name}.jsonl"
        done = train(*common, *layout, "--metrics", str(metrics), timeout=600)  # the layout's flags win
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["tp1"]) == 2
    assert "cp=2" in done.stdout  # the last run: CP2 x PP2
    limit = train_tolerance(steps=2, global_batch=8, num_layers=4)
    for name in ("tp2-sp", "dp2", "cp2-seq1f1b"):
        for step, (got, want) in enumerate(zip(losses[name], losses["tp1"], strict=True)):
            check(abs(got - want) / abs(want), limit, f"{name} step {step + 1} loss")


@pytest.mark.slow
def test_tensorboard_logs_have_megatron_lm_tags_and_every_rank(tmp_path) -> None:
    """--tensorboard-dir (Megatron's flag): per iteration Megatron-LM's tags with the values the
    metrics file has, the validation loss at --eval-interval; at the end each pipeline rank's
    bubble and peak activation memory. And
    --log-interval (Megatron's): one Megatron-LM-style line every N iterations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs, metrics = tmp_path / "tb", tmp_path / "metrics.jsonl"
    done = train(
        "--train-iters", "3", "--tensorboard-dir", str(logs), "--metrics", str(metrics),
        "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
        "--log-validation-ppl-to-tensorboard",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "lm loss:" in line]
    assert len(lines) == 1 and " iteration        2/       3 | consumed samples:" in lines[0], lines
    events = EventAccumulator(str(logs))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    megatron_tags = {"lm loss", "learning-rate", "grad-norm", "iteration-time", "batch-size"}
    assert megatron_tags | {f"{tag} vs samples" for tag in megatron_tags - {"iteration-time"}} <= tags
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for tag, key in (("lm loss", "loss"), ("grad-norm", "grad_norm"), ("iteration-time", "step_time")):
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        assert logged == [(row["iteration"], pytest.approx(row[key], rel=1e-6)) for row in rows], tag
    # the validation loss after iteration 2, as Megatron-LM tags it
    validated = [(row["iteration"], row["validation_loss"]) for row in rows if "validation_loss" in row]
    assert len(validated) == 1 and validated[0][0] == 2, rows
    (logged,) = events.Scalars("lm loss validation")
    assert (logged.step, logged.value) == (2, pytest.approx(validated[0][1], rel=1e-6))
    assert "lm loss validation vs samples" in tags
    (ppl,) = events.Scalars("lm loss validation ppl")
    assert (ppl.step, ppl.value) == (2, pytest.approx(math.exp(validated[0][1]), rel=1e-6))
    for rank in range(4):  # the default config's pipeline
        for tag in ("pipeline-bubble", "mem-activation-peak-mib"):
            (last,) = events.Scalars(f"{tag}/rank {rank}")
            assert last.step == 3 and last.value >= 0


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


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--save-interval", "2"], "--save-interval", "needs --save"),
        (["--ckpt-step", "3"], "--ckpt-step", "needs --load"),
        (["--load", "{tmp}", "--ckpt-step", "7"], "--ckpt-step", "not a complete checkpoint"),
    ],
)
def test_bad_checkpoint_flags_fail_before_training(tmp_path, args: list[str], flag: str, words: str) -> None:
    done = train(*(arg.format(tmp=tmp_path) for arg in args), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert flag in last and words in last, last


@pytest.mark.slow
def test_save_then_load_resumes_with_one_command(tmp_path) -> None:
    """`--save DIR --save-interval N`, then the same command with `--load DIR` and more
    iterations: it goes on from the saved iteration, with Megatron's directory layout."""
    metrics, saves = tmp_path / "metrics.jsonl", tmp_path / "checkpoints"
    common = ["--pp", "2", "--num-layers", "4", "--seq-length", "32", "--microbatches", "4"]
    common += [
        "--pp-schedule",
        "v-zb",
        "--save",
        str(saves),
        "--save-interval",
        "2",
        "--metrics",
        str(metrics),
    ]
    done = train(*common, "--train-iters", "2", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (saves / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (saves / "iter_0000002" / "metadata.json").is_file()
    done = train(*common, "--train-iters", "3", "--load", str(saves), "--pp-schedule", "1f1b", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at iteration 2, written by v-zb pp=2" in done.stdout, done.stdout[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2, 3]  # the resumed run appends
    assert (saves / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_more_ranks_than_gpus_is_refused_in_one_line(monkeypatch, capsys) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", from inside NCCL): `train`
    refuses before it starts them, naming the counts and the fix; a rank that a launcher put on
    a node with too few GPUs refuses before it touches CUDA."""
    import torch

    from megatron_pp_ext import launch
    from megatron_pp_ext.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["train", "--pp", "2", "--train-iters", "1"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--pipeline-model-parallel-size" in last and "2 ranks on this node" in last, last
    assert "has 1 GPU: NCCL needs one GPU per rank" in last and "--nproc-per-node 1" in last, last
    assert "--distributed-backend gloo" in last, last  # the way to share one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(launch.LaunchError, match=r"\(rank 1, local rank 1\) but it has 1 GPU"):
        launch.init_distributed(1, 2, 1, 10.0)
    launch.check_gpus(8, 8)  # one each: fine
    launch.check_gpus(3, 0)  # no GPU: gloo, any number


def test_distributed_backend_gloo_shares_a_gpu_for_pipeline_and_data_parallelism(monkeypatch, capsys) -> None:
    """Megatron's ``--distributed-backend``: gloo on a one-GPU machine lets ranks share it (no
    ranks-versus-GPUs refusal; pipeline messages, DDP's reductions and post-validation are staged
    through host memory) but refuses, before any rank starts, the layouts whose collectives gloo
    cannot run on CUDA tensors; nccl on a machine without GPUs is refused."""
    import torch

    from megatron_pp_ext import launch
    from megatron_pp_ext.cli import main

    assert main(["train", "--distributed-backend", "nccl", "--train-iters", "1"]) == 2  # this CPU machine
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--distributed-backend" in last and "no" in last and "GPU" in last, last
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for layout, named in (
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
        (["--context-parallel-size", "2"], "--context-parallel-size 2"),
        (["--pp-vocab-parallel", "vocab-1"], "--pp-vocab-parallel"),
    ):
        args = ["train", "--pp", "2", "--distributed-backend", "gloo", "--train-iters", "1", *layout]
        assert main(args) == 2, layout
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "--distributed-backend" in last and named in last, last
    launched = []
    monkeypatch.setattr(launch, "run", lambda *args, **kwargs: launched.append(kwargs))
    for layout in ([], ["--data-parallel-size", "2"]):  # 2 and 4 ranks on 1 GPU: not refused
        assert (
            main(["train", "--pp", "2", "--distributed-backend", "gloo", "--train-iters", "1", *layout]) == 0
        )
        assert launched.pop()["backend"] == "gloo"


def test_transformer_engine_is_used_where_it_can_run_the_schedule(monkeypatch, capsys) -> None:
    """`--transformer-impl` (Megatron's flag): TE needs to import on a GPU, and for schedules with
    a B/W split a TE that defers weight gradients to W (2.3.0, ``delay_wgrad_compute``), else one
    line naming the version; by default TE is taken where it imports and can run the schedule,
    else the local layers."""
    import dataclasses

    from te_double import stand_in_te_version

    from megatron_pp_ext.cli import main
    from megatron_pp_ext.commands import train as train_command
    from megatron_pp_ext.megatron import layer_spec

    assert main(["train", "--transformer-impl", "transformer_engine", "--train-iters", "1"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--transformer-impl" in last and "needs Transformer Engine importable and a GPU" in last, last

    monkeypatch.setattr(layer_spec, "te_available", lambda: True)
    stand_in_te_version(monkeypatch, "2.2.0")
    argv = ["--pp-schedule", "zb-h1", "--transformer-impl", "transformer_engine"]
    with pytest.raises(
        train_command.UsageError, match=r"zb-h1 defers weight gradients .* from 2\.3\.0 .* 2\.2\.0"
    ):
        train_command.settings_from_argv(argv)
    train_command.settings_from_argv(["--pp-schedule", "1f1b", "--transformer-impl", "transformer_engine"])
    settings = train_command.settings_from_argv(["--pp-schedule", "zb-h1"])
    assert settings.use_te(splits_backward=True) is False and settings.use_te(splits_backward=False) is True
    stand_in_te_version(monkeypatch, "2.3.0")
    assert train_command.settings_from_argv(argv).transformer_impl == "transformer_engine"
    assert settings.use_te(splits_backward=True) is True
    local = dataclasses.replace(settings, transformer_impl="local")
    assert local.use_te(splits_backward=False) is False
    monkeypatch.setattr(layer_spec, "te_available", lambda: False)
    assert settings.use_te(splits_backward=False) is False


@pytest.mark.slow
def test_the_main_job_starts_quietly_and_verbose_shows_megatron_warnings() -> None:
    """The README's main job prints at most 5 lines on stderr before (and here, through) its
    steps: megatron-core's known import warnings are filtered in every process (quiet.py);
    ``--verbose`` shows them again."""
    quiet = train_fresh("--pp-schedule", "zb-h1", "--train-iters", "2", timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    lines = quiet.stderr.strip().splitlines()
    assert len(lines) <= 5, quiet.stderr[-3000:]
    assert "Apex is not installed" not in quiet.stderr
    verbose = train_fresh("--pp-schedule", "zb-h1", "--train-iters", "2", "--verbose", timeout=300)
    assert verbose.returncode == 0 and "Apex is not installed" in verbose.stderr, verbose.stderr[-2000:]
