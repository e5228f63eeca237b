"""Vocabulary-parallel schedules (``add_vocab_passes``) run by the executor on real gloo processes
equal the unpartitioned single-process model: the loss of every microbatch, every gradient of the
stages' layers, and the vocabulary shards' gradients gathered (``gather_full(..., grad=True)``)
against the reference's word-embedding and output-layer gradients. Then a forward-only step of the
same schedule gives the same losses. One launch per pipeline size runs every case in turn
(process start-up dominates on two cores).

Run with ``-s`` to print the errors measured.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, check_worst, train_tolerance, training_tolerance
from runtime_case import forward_step, loss_values, make_batches, rel_error, tiny_model, vocab_setup_from

VARIANTS = ("vocab-1", "vocab-2")
# pipeline size -> (microbatches, schedules); m is not a multiple of p
CASES = {2: (3, ("1f1b", "zb-h1", "v-half")), 3: (4, ("1f1b", "zb-h1", "v-half"))}
TP_CASE = (3, ("1f1b", "v-half"))  # TP = 2 x PP = 2, with and without sequence parallelism
# sequence slices at p = 2 with calculate_per_token_loss (reference too): name -> slices
SLICED_CASE = (3, (("seq1f1b", 2), ("slimpipe", 4)))


def _vocab_schedule(name: str, pp: int, microbatches: int, variant: str, slices: int = 1):
    from megatron_pp_ext.schedule.generators import generate
    from megatron_pp_ext.schedule.vocab import add_vocab_passes

    return add_vocab_passes(generate(name, pp, microbatches, slices=slices), variant)


def vocab_worker(
    rank: int,
    world: int,
    microbatches: int,
    names: tuple[str, ...],
    tp: int = 1,
    sp_modes: tuple = (False,),
    slices: tuple = (),
) -> dict:
    """Every case of one launch; at TP > 1 the reference and chunks hold Megatron's TP shards, the
    vocabulary shard is loaded from them (``load_tp_shards``) and each TP rank checks its rows.
    ``slices``: (name, k) pairs of sequence-sliced schedules, run with calculate_per_token_loss
    (the reference too) instead of ``names``."""
    import dataclasses

    from megatron.core import parallel_state

    from megatron_pp_ext.megatron.model import build_reference, init_parallel_state
    from megatron_pp_ext.runtime.p2p import PipeComm
    from megatron_pp_ext.runtime.reference import reference_step
    from megatron_pp_ext.runtime.vocab_parallel import VocabGroups

    pp = world // tp
    if tp > 1:
        from megatron_pp_ext.megatron import cpu_shim

        cpu_shim.install()  # Megatron's TP layers ask for torch.cuda.current_device()
    init_parallel_state(pp, tp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pipeline = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    comm = PipeComm(ranks=pipeline, timeout_s=60)
    groups = VocabGroups.create()  # one set of channel groups for every case of this launch
    report: dict[str, dict] = {}
    for sequence_parallel in sp_modes:
        model_cfg = tiny_model(num_layers=2 * pp + 1)
        if sequence_parallel:
            model_cfg = dataclasses.replace(model_cfg, extra={**model_cfg.extra, "sequence_parallel": True})
        if slices:
            extra = {**model_cfg.extra, "calculate_per_token_loss": True}
            model_cfg = dataclasses.replace(model_cfg, seq_length=32, extra=extra)  # 4 slices of 8
        torch.manual_seed(1234)
        reference = build_reference(model_cfg)
        batches = make_batches(model_cfg, microbatches, seed=11)
        ref_losses = loss_values(reference_step(reference, forward_step, iter(batches), microbatches))
        ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        rows = model_cfg.vocab_size // tp  # this TP rank's rows of Megatron's tables
        case = {
            "model": model_cfg,
            "reference": reference,
            "batches": batches,
            "losses": ref_losses,
            "grads": ref_grads,
            "rows": slice(tp_rank * rows, (tp_rank + 1) * rows),
            "pp": pp,
            "pp_rank": pp_rank,
            "comm": comm,
            "groups": groups,
            "sequence_parallel": sequence_parallel,
        }
        for name, k in slices or [(name, 1) for name in names]:
            for variant in VARIANTS:
                entry: dict = {}
                report[_case(name, variant, sequence_parallel, k)] = entry
                try:
                    _run_case(entry, name, variant, case, k)
                except Exception as error:  # report, do not stop the other cases
                    import traceback

                    entry["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"
    report["lazy_creations"] = comm.creation.lazy  # first uses the warm-up missed
    return report


def _case(name: str, variant: str, sequence_parallel: bool = False, slices: int = 1) -> str:
    return f"{name}/{variant}" + ("/sp" if sequence_parallel else "") + (f"/k{slices}" if slices > 1 else "")


def _run_case(entry: dict, name: str, variant: str, case: dict, slices: int = 1) -> None:
    """One schedule and variant against the reference, into ``entry``."""
    from megatron_pp_ext.megatron.model import build_chunks_from
    from megatron_pp_ext.runtime.executor import PipelineRuntime

    model_cfg, reference, batches = case["model"], case["reference"], case["batches"]
    ref_losses, ref_grads, mine, rank = case["losses"], case["grads"], case["rows"], case["pp_rank"]
    microbatches = len(batches)
    schedule = _vocab_schedule(name, case["pp"], microbatches, variant, slices)
    chunks, names_of = build_chunks_from(reference, model_cfg, schedule.placement, rank, sliced=slices > 1)
    setup = vocab_setup_from(
        reference,
        model_cfg,
        chunks,
        schedule.placement,
        rank,
        variant,
        case["groups"],
        sequence_parallel=case["sequence_parallel"],
    )
    shape = (model_cfg.seq_length, 2, model_cfg.hidden_size)
    runtime = PipelineRuntime(chunks, case["comm"], shape, model_cfg.torch_dtype, vocab=setup)
    result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
    layers = [p for c in chunks for p in c.parameters() if id(p) in names_of]
    entry["missing"] = [names_of[id(p)] for p in layers if p.grad is None]
    errors = {names_of[id(p)]: rel_error(p.grad, ref_grads[names_of[id(p)]]) for p in layers}
    errors["vocab embedding"] = rel_error(
        setup.vp.gather_full("embedding", grad=True)[mine], ref_grads["embedding.word_embeddings.weight"]
    )
    errors["vocab output"] = rel_error(
        setup.vp.gather_full("output", grad=True)[mine], ref_grads["output_layer.weight"]
    )
    entry["grad_errors"] = errors
    entry["is_loss_rank"] = result.is_loss_rank
    if result.is_loss_rank:
        losses = loss_values(result.losses)
        entry["loss_count"] = len(losses)
        entry["loss_error"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    evaluated = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks], forward_only=True)
    if result.is_loss_rank:
        values = loss_values(evaluated.losses)
        entry["eval_count"] = len(values)
        entry["eval_error"] = max(abs(a - b) / abs(b) for a, b in zip(values, ref_losses))
    setup.vp.close()


@functools.cache
def _launch(world: int, tp: int = 1, sliced: bool = False) -> tuple:
    if sliced:
        microbatches, cases = SLICED_CASE
        found = run_ranks(vocab_worker, world, microbatches, (), 1, (False,), cases, timeout=120)
        return tuple(check_ok(found))
    if tp > 1:
        microbatches, names = TP_CASE
        found = run_ranks(vocab_worker, world, microbatches, names, tp, (False, True), timeout=300)
        return tuple(check_ok(found))
    microbatches, names = CASES[world]
    return tuple(check_ok(run_ranks(vocab_worker, world, microbatches, names, timeout=120)))


def _check(
    world: int, name: str, variant: str, tp: int = 1, sequence_parallel: bool = False, slices: int = 1
) -> None:
    reports = [r[_case(name, variant, sequence_parallel, slices)] for r in _launch(world, tp, slices > 1)]
    errors = [f"rank {rank}: {r['error']}" for rank, r in enumerate(reports) if "error" in r]
    assert not errors, "\n".join(errors)
    microbatches = TP_CASE[0] if tp > 1 else SLICED_CASE[0] if slices > 1 else CASES[world][0]
    model = tiny_model(num_layers=2 * (world // tp) + 1)  # the worker's
    if slices > 1:
        model = dataclasses.replace(model, seq_length=32)
    limit = training_tolerance(model, microbatches, 1)
    worst_all = 0.0
    for rank, r in enumerate(reports):
        assert not r["missing"], f"rank {rank}: no gradient for {r['missing']}"
        worst_all = max(worst_all, *r["grad_errors"].values())
        check_worst(r["grad_errors"], limit, f"rank {rank}: gradient of")
    loss_ranks = [r for r in reports if r["is_loss_rank"]]
    assert len(loss_ranks) == tp  # the TP ranks of the last stage
    for loss in loss_ranks:
        assert loss["loss_count"] == loss["eval_count"] == microbatches
        check(loss["loss_error"], limit, "loss")
        check(loss["eval_error"], limit, "evaluation loss")
    loss_error = max(r["loss_error"] for r in loss_ranks)
    eval_error = max(r["eval_error"] for r in loss_ranks)
    where = f"tp={tp}{' sp' if sequence_parallel else ''} " if tp > 1 else ""
    where += f"k={slices} per-token " if slices > 1 else ""
    print(
        f"{where}p={world // tp} {name} {variant}: max grad rel error {worst_all:.2e}, loss "
        f"{loss_error:.2e}, forward-only loss {eval_error:.2e}"
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", CASES[2][1])
def test_vocab_parallel_exact_p2(name: str, variant: str) -> None:
    _check(2, name, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", CASES[3][1])
def test_vocab_parallel_exact_p3(name: str, variant: str) -> None:
    _check(3, name, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("name", "slices"), SLICED_CASE[1])
def test_vocab_parallel_exact_sliced_per_token_loss(name: str, slices: int, variant: str) -> None:
    """Sequence-sliced schedules (one unit per (microbatch, slice)) with calculate_per_token_loss,
    against the reference with the same loss."""
    _check(2, name, variant, slices=slices)


@pytest.mark.slow
def test_vocab_parallel_exact_tp2_pp2() -> None:
    """4 processes, one launch: both variants, 1F1B and V-Half, with and without SP; the shards
    are set up from Megatron's TP-sharded tables."""
    for sequence_parallel in (False, True):
        for name in TP_CASE[1]:
            for variant in VARIANTS:
                _check(4, name, variant, tp=2, sequence_parallel=sequence_parallel)


# ---- megatron-pp-ext train --pp-vocab-parallel ------------------------------------------------


def _train(*args: str, timeout: float = 300):
    import os

    from cli_runner import run_cli

    return run_cli(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--pp-schedule", "seq1f1b", "--pp-seq-slices", "2"], "--calculate-per-token-loss"),
    ],
)
def test_train_refuses_what_the_runtime_does_not_run(args: list[str], words: str) -> None:
    done = _train("--pp-vocab-parallel", "vocab-1", *args, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "--pp-vocab-parallel" in last and words in last, last
    assert "train:" not in done.stdout


@pytest.mark.slow
@pytest.mark.heavy
def test_train_with_vocab_parallelism_gives_the_same_losses(tmp_path) -> None:
    """2 iterations at PP=2 against 1F1B without vocabulary parallelism (same global batch):
    vocab-1 with ZB-H1 and optimizer post-validation; vocab-2 with V-Half over DP=2 with the
    distributed optimizer, overlapped gradient reduction (the shards go through Megatron's DDP
    like any parameter) and selective activation offload; vocab-1 with SlimPipe k=2, full offload
    and --calculate-per-token-loss; vocab-2 with V-Half over CP=2. Same losses and gradient norms,
    and the offloading runs moved bytes to the host."""
    import json

    common = ["--pipeline-model-parallel-size", "2", "--train-iters", "2", "--global-batch-size", "8"]
    runs = {
        "none": ["--pp-schedule", "1f1b"],
        "vocab-1-zbh1-post-validation": (
            "--pp-schedule zb-h1 --pp-vocab-parallel vocab-1 --pp-post-validation"
        ).split(),
        "vocab-2-vhalf-dp2-offload": (
            "--pp-schedule v-half --pp-vocab-parallel vocab-2 --data-parallel-size 2 "
            "--use-distributed-optimizer --overlap-grad-reduce --pp-offload selective"
        ).split(),
        "vocab-1-slimpipe-offload-per-token": (
            "--pp-schedule slimpipe --pp-seq-slices 2 --pp-vocab-parallel vocab-1 --pp-offload full "
            "--calculate-per-token-loss"
        ).split(),
        # each CP rank embeds, and runs S and T on, its two pieces of every sequence
        "vocab-2-vhalf-cp2": (
            "--pp-schedule v-half --pp-vocab-parallel vocab-2 --context-parallel-size 2"
        ).split(),
    }
    rows = {}
    for name, extra in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        done = _train(*common, "--num-layers", "4", *extra, "--metrics", str(metrics), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        rows[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows["none"]) == 2
    limit = train_tolerance(steps=2, global_batch=8, num_layers=4)
    for name in runs.keys() - {"none"}:
        for got, want in zip(rows[name], rows["none"], strict=True):
            for key in ("loss", "grad_norm"):
                check(abs(got[key] - want[key]) / abs(want[key]), limit, f"{name} {key}")
            assert ("offload" in name) == bool(got["offloaded_bytes"]), (name, got)


def test_sliced_vocab_parallelism_needs_per_token_loss() -> None:
    """Without calculate_per_token_loss a slice's g is unknown at its F: the schedule options and
    the runtime refuse sliced schedules, naming --calculate-per-token-loss."""
    from types import SimpleNamespace

    from megatron_pp_ext.megatron.hook import OptionError, PipelineOptions
    from megatron_pp_ext.runtime.vocab_ops import VocabRuntimeError, VocabStep

    options = PipelineOptions(schedule="seq1f1b", slices=2, vocab_parallel="vocab-1")
    with pytest.raises(OptionError, match="--calculate-per-token-loss"):
        options.schedule_for(2, 4)
    args = SimpleNamespace(pp_schedule="seq1f1b", pp_seq_slices=2, pp_vocab_parallel="vocab-2")
    refused = PipelineOptions.from_args(args)
    allowed = PipelineOptions.from_args(SimpleNamespace(**vars(args), calculate_per_token_loss=True))
    with pytest.raises(OptionError, match="--calculate-per-token-loss"):
        refused.schedule_for(2, 4)
    schedule = allowed.schedule_for(2, 4)
    assert schedule.slices == 2 and schedule.vocab_parallel == "vocab-2"
    runners = {1: SimpleNamespace(config=SimpleNamespace(calculate_per_token_loss=False))}
    with pytest.raises(VocabRuntimeError, match="--calculate-per-token-loss"):
        VocabStep(
            None,
            schedule,
            1,
            runners,
            [],
            None,
            None,
            None,
            None,
            forward_only=False,
            collect_non_loss_data=False,
        )


@pytest.mark.parametrize("world", [2, 3])
def test_the_warm_up_creates_every_communicator_the_steps_use(world) -> None:
    """Under NCCL a communicator first used inside a step would be created there, blocking until
    its members arrive (runtime/creation.py): the runtime's warm-up leaves none for the step."""
    for rank, report in enumerate(_launch(world)):
        assert report["lazy_creations"] == [], f"rank {rank}: {report['lazy_creations'][:3]}"
