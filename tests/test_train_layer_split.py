"""``train`` under Megatron-LM's layer-split flags (``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split``, ``--pipeline-model-parallel-layout``): the
settings carry megatron-core's split (``schedule/layer_split.py``), a split it refuses fails before
any process starts naming the flag, and on real gloo processes each rank builds the layers the
split gives it and the step computes the loss and gradients of the model without a pipeline."""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, check_worst, training_tolerance
from runtime_case import rel_error

from megatron_pp_ext.commands.train import settings_from_argv
from megatron_pp_ext.errors import UsageError
from megatron_pp_ext.schedule.layer_split import EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LOSS_FLAG
from megatron_pp_ext.training.settings import TrainSettings

# a tiny model the byte-level data fits (vocabulary 256)
MODEL = ["--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention"]
MODEL += ["--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16"]
MODEL += ["--micro-batch-size", "2", "--microbatches", "4", "--train-iters", "1", "--seed", "7"]
INTERLEAVED = "--pp-schedule interleaved-1f1b"
LAYOUT = "--pipeline-model-parallel-layout"
VIRTUAL = "--num-virtual-stages-per-pipeline-rank"


def settings_of(line: str) -> TrainSettings:
    """The settings of ``train`` with the tiny model and ``line``'s flags (a layout has no spaces)."""
    return settings_from_argv([*MODEL, *line.split()])


@pytest.mark.parametrize(
    "line, split",
    [
        ("--pp 3 --num-layers 7 --decoder-first-pipeline-num-layers 1", (1, 3, 3)),
        ("--pp 3 --num-layers 7 --decoder-last-pipeline-num-layers 3", (2, 2, 3)),
        ("--pp 2 --num-layers 3 --account-for-embedding-in-pipeline-split", (1, 2)),
        ("--pp 2 --num-layers 3 --account-for-loss-in-pipeline-split", (2, 1)),
        (f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL {INTERLEAVED}", (1, 2, 1, 2)),
        # the layout sets the chunks per rank; our --pp-chunks may repeat it
        (f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL {INTERLEAVED} --pp-chunks 2", (1, 2, 1, 2)),
        # the schedule's own chunks per rank (a V: 2) share each rank's count
        ("--pp 2 --num-layers 6 --decoder-first-pipeline-num-layers 2 --pp-schedule v-half", (1, 2, 1, 2)),
        # a V with a layout: train's builder places virtual stages, not Megatron's round-robin ranks
        (
            f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL --pp-schedule v-half",
            (1, 2, 1, 2),
        ),
        # end stages of the embedding or the loss alone
        (f"--pp 2 --num-layers 8 {LAYOUT} E|t*4|t*4|L {INTERLEAVED}", (0, 4, 4, 0)),
        (
            "--pp 2 --num-layers 2 --account-for-embedding-in-pipeline-split "
            f"--account-for-loss-in-pipeline-split {INTERLEAVED}",
            (0, 1, 1, 0),
        ),
        ("--pp 2 --num-layers 6", None),  # no flag: train's own even split
    ],
)
def test_settings_carry_megatron_cores_split(line: str, split: tuple[int, ...] | None) -> None:
    assert settings_of(line).layers_per_stage == split


def test_the_layout_sets_the_chunks_per_rank() -> None:
    settings = settings_of(f"--pp 2 --num-layers 6 {LAYOUT} Et|t|t|t|t|tL {INTERLEAVED}")
    assert settings.pipeline.chunks == 3 and settings.layers_per_stage == (1,) * 6


@pytest.mark.parametrize(
    "line, flag, words",
    [
        ("--pp 4 --num-layers 8 --decoder-last-pipeline-num-layers 3", LAST_FLAG, "cannot share evenly"),
        ("--pp 1 --num-layers 8 --decoder-first-pipeline-num-layers 3", FIRST_FLAG, "at least 2"),
        (
            f"--pp 2 --num-layers 6 --decoder-first-pipeline-num-layers 3 {INTERLEAVED}",
            FIRST_FLAG,
            "does not divide over the 2 model chunks",
        ),
        ("--pp 2 --num-layers 4 --account-for-embedding-in-pipeline-split", EMBEDDING_FLAG, "do not divide"),
        (
            f"--pp 2 --num-layers 4 {FIRST_FLAG} 2 {LOSS_FLAG}",
            LOSS_FLAG,
            "cannot be combined",
        ),
        (f"--pp 2 --num-layers 5 {LAYOUT} Ett|ttL", LAYOUT, "has 4 decoder layers"),
        (f"--pp 2 --num-layers 4 {LAYOUT} Ett|tt|L", LAYOUT, "not a multiple"),
        # several chunks per rank from the layout need a schedule that runs them
        (f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL", LAYOUT, "add --pp-schedule interleaved-1f1b"),
        (f"--pp 2 --num-layers 6 {LAYOUT} Ettt|tttL --pp-schedule v-half", LAYOUT, "v-half runs 2"),
        (
            f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL {INTERLEAVED} --pp-chunks 3",
            "--pp-chunks",
            f"3 disagrees with {LAYOUT}",
        ),
        # Megatron-LM refuses its chunk flag beside a layout, even when they agree
        (
            f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL {INTERLEAVED} {VIRTUAL} 3",
            VIRTUAL,
            "refuses the pair",
        ),
        (f"--pp 2 --num-layers 6 {LAYOUT} Et|tt|t|ttL {INTERLEAVED} {VIRTUAL} 2", VIRTUAL, "leave it out"),
        # a middle stage without layers would hold no parameter
        (
            f"--pp 2 --num-layers 4 {LAYOUT} Et||tt|tL {INTERLEAVED}",
            LAYOUT,
            r"virtual stage 1 of \[1, 0, 2, 1\] has no decoder layer",
        ),
    ],
)
def test_refused_splits_name_the_flag(line: str, flag: str, words: str) -> None:
    with pytest.raises(UsageError, match=words) as caught:
        settings_of(line)
    assert caught.value.flag == flag


def test_a_refused_split_exits_2_before_any_process_starts(monkeypatch, capsys) -> None:
    from megatron_pp_ext import cli, launch

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "run", no_launch)
    line = "--pp 3 --num-layers 7 --decoder-first-pipeline-num-layers 2"  # 5 over 2 ranks
    assert cli.main(["train", *MODEL, *line.split()]) == 2
    assert "--decoder-first-pipeline-num-layers" in capsys.readouterr().err


# ---- on real processes -------------------------------------------------------------------------


def split_worker(rank: int, world: int, line: str) -> dict:
    """Build the run's job, compare its step with the model without a pipeline (the same seeded
    weights and batches): the loss on the loss rank and every gradient of this rank's chunks."""
    from megatron_pp_ext.megatron.model import build_reference, layer_offsets, reference_name, split_layers
    from megatron_pp_ext.megatron.steps import forward_step
    from megatron_pp_ext.runtime.reference import reference_step
    from megatron_pp_ext.training.job import TrainJob
    from megatron_pp_ext.training.model import layer_list

    settings = settings_from_argv([*MODEL, *line.split()], world)
    job = TrainJob(rank, settings, torch.device("cpu"), None)
    try:
        config, schedule = job.model_config, job.schedule
        layers = split_layers(config.num_layers, schedule.num_stages, layer_list(settings))
        offsets = layer_offsets(layers)
        stages = schedule.placement.stages_of(rank)
        losses = job.forward_backward(job.data.iterators("train", 0), forward_only=False)
        grads = {}
        for stage, chunk in zip(stages, job.model):
            chunk.finish_grad_sync()
            for name, param in chunk.module.named_parameters():
                grads[reference_name(name, offsets[stage])] = param.main_grad.detach().clone()
        torch.manual_seed(settings.seed)  # the seeded model every stage copied its layers from
        reference = build_reference(config, use_te=False)
        expected = reference_step(
            reference, forward_step, job.data.iterators("train", 0)[0], settings.microbatches
        )
        ref_grads = dict(reference.named_parameters())
        return {
            "split": settings.layers_per_stage,
            "built": {stage: len(chunk.module.decoder.layers) for stage, chunk in zip(stages, job.model)},
            "grad_errors": {name: rel_error(grad, ref_grads[name].grad) for name, grad in grads.items()},
            "loss_errors": [rel_error(got["lm loss"], want["lm loss"]) for got, want in zip(losses, expected)]
            if job.is_loss_rank
            else None,
            "limit": training_tolerance(config, settings.microbatches, 1, settings.micro_batch_size),
            "names": sorted(grads),
            "reference_names": sorted(ref_grads),
        }
    finally:
        job.close()


def check_exact(world: int, line: str, split: tuple[int, ...]) -> None:
    """``train`` with ``line`` on ``world`` ranks: the split, the layers each virtual stage built,
    and the step's loss and gradients against the model without a pipeline."""
    reports = check_ok(run_ranks(split_worker, world, line, timeout=240))
    seen: dict[int, int] = {}
    for rank, report in enumerate(reports):
        assert report["split"] == split
        seen.update(report["built"])  # each virtual stage built the layers the split gives it
        check_worst(report["grad_errors"], report["limit"], f"rank {rank} gradient of")
        if report["loss_errors"] is not None:
            check(max(report["loss_errors"]), report["limit"], "loss")
    assert [seen[stage] for stage in range(len(split))] == list(split)
    assert sum(1 for report in reports if report["loss_errors"]) == 1
    every = sorted(name for report in reports for name in report["names"])
    assert every == reports[0]["reference_names"]  # every parameter once, on one rank


@pytest.mark.slow
def test_1f1b_with_a_first_stage_of_one_layer_is_exact() -> None:
    check_exact(3, "--pp 3 --num-layers 7 --decoder-first-pipeline-num-layers 1", (1, 3, 3))


@pytest.mark.slow
def test_interleaved_1f1b_with_an_uneven_layout_is_exact() -> None:
    check_exact(2, f"--pp 2 --num-layers 6 {LAYOUT} Et|ttt|t|tL {INTERLEAVED}", (1, 3, 1, 1))


@pytest.mark.slow
def test_a_v_with_a_layout_of_embedding_and_loss_stages_without_layers_is_exact() -> None:
    """A V puts virtual stages 0 and 3 on rank 0: the layout's split goes by virtual stage (train
    builds each where the schedule places it), and those two hold no decoder layer."""
    check_exact(2, f"--pp 2 --num-layers 4 {LAYOUT} E|tt|tt|L --pp-schedule v-half", (0, 2, 2, 0))
