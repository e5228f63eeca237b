"""Sequence-sliced schedules on real gloo processes equal the unsliced model without a pipeline.

The reference is the whole GPTModel with plain SDPA attention, run microbatch by microbatch in
one process. The pipeline runs chunks built with the sliced layer spec; each microbatch is cut
into k slices (uniform or FLOP-balanced), messages carry one slice, the K/V of earlier slices
stay in each chunk's cache, and the loss is normalised over the whole microbatch. Loss, its
report and every gradient must match the reference (fp32, relative error < 1e-5), over two
steps in a row (caches and data feeders start clean every step). One launch per pipeline size
runs a compact set of (schedule, k, partition) cases; the p=2 launch also runs a step through
the Megatron hook (``get_forward_backward_func`` with Megatron-LM's arguments).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, training_tolerance
from runtime_case import MICRO_BATCH, forward_step, loss_values, make_batches, rel_error, tiny_model

SEQ = 128
# pipeline size -> (microbatches, [(schedule, slices, partition), ...]): every k in {2, 4, 8}
# and both partitions on every p; Seq1F1B, SlimPipe, ZB and V-shape families on each.
CASES = {
    2: (
        3,
        [
            ("seq1f1b", 4, "balanced"),
            ("slimpipe", 8, "uniform"),
            ("zb-h1", 2, "balanced"),
            ("v-half", 4, "uniform"),
            ("slimpipe-interleaved", 2, "uniform"),
        ],
    ),
    3: (
        4,
        [
            ("seq1f1b", 8, "balanced"),
            ("slimpipe", 2, "uniform"),
            ("zb-h2", 4, "uniform"),
            ("v-zb", 2, "balanced"),
            ("seq1f1b-interleaved", 2, "balanced"),
        ],
    ),
    4: (
        5,
        [
            ("seq1f1b", 2, "balanced"),
            ("slimpipe", 8, "uniform"),
            ("slimpipe-interleaved", 4, "balanced"),
            ("zb-h1", 4, "uniform"),
            ("v-min", 8, "balanced"),
        ],
    ),
}
STEPS = 2


def model_config(world: int):
    return dataclasses.replace(tiny_model(num_layers=2 * world + 1), seq_length=SEQ)  # GQA: 4 heads, 2 KV


def _reference(model_cfg, batches, microbatches: int):
    from megatron_pp_ext.megatron.model import build_reference
    from megatron_pp_ext.runtime.reference import reference_step

    torch.manual_seed(1234)
    reference = build_reference(model_cfg)
    outputs = reference_step(reference, forward_step, iter(batches), microbatches)
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    return reference, grads, outputs


def sliced_worker(rank: int, world: int) -> dict:
    from megatron_pp_ext.megatron.model import build_chunks_from, init_parallel_state
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    microbatches, cases = CASES[world]
    model_cfg = model_config(world)
    batches = make_batches(model_cfg, microbatches, seed=7)
    reference, ref_grads, ref_outputs = _reference(model_cfg, batches, microbatches)
    ref_losses = loss_values(ref_outputs)
    comm = PipeComm(timeout_s=60)
    report: dict[str, dict] = {}
    for name, slices, partition in cases:
        key = f"{name}/k{slices}/{partition}"
        entry: dict = {}
        try:
            schedule = generate(name, world, microbatches, slices=slices)
            schedule.meta["partition"] = partition
            chunks, names = build_chunks_from(reference, model_cfg, schedule.placement, rank, sliced=True)
            runtime = PipelineRuntime(
                chunks, comm, (SEQ, MICRO_BATCH, model_cfg.hidden_size), model_cfg.torch_dtype
            )
            errors = []
            for _ in range(STEPS):
                for chunk in chunks:
                    chunk.zero_grad(set_to_none=True)
                result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
                params = [p for c in chunks for p in c.parameters()]
                missing = [names[id(p)] for p in params if p.grad is None]
                assert not missing, f"no gradient for {missing}"
                grad_error = max(rel_error(p.grad, ref_grads[names[id(p)]]) for p in params)
                loss_error = None
                if result.is_loss_rank:
                    losses = loss_values(result.losses)
                    assert len(losses) == microbatches, f"{len(losses)} loss reports"
                    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                    tokens = [float(item["lm loss"][1]) for item in result.losses]
                    assert tokens == [float(item["lm loss"][1]) for item in ref_outputs]
                errors.append((grad_error, loss_error))
            entry = {
                "grad_error": max(e[0] for e in errors),
                "loss_error": errors[-1][1],
                "is_loss_rank": result.is_loss_rank,
                "lengths": list(runtime_lengths(chunks[0])),
                "peak": result.peak_activation_bytes,
            }
        except Exception as error:  # report, let the other cases run
            import traceback

            entry = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"}
        report[key] = entry
    if world == 2:
        report["hook"] = hook_step(rank, world, reference, ref_grads, ref_losses, batches, model_cfg)
    report["lazy_creations"] = comm.creation.lazy  # first uses the warm-up missed
    return report


def runtime_context(chunk: torch.nn.Module):
    from megatron_pp_ext.megatron.sliced import slice_context_of

    return slice_context_of(chunk)


def runtime_lengths(chunk: torch.nn.Module) -> tuple[int, ...]:
    return runtime_context(chunk).slicing()


def hook_step(rank, world, reference, ref_grads, ref_losses, batches, model_cfg) -> dict:
    """A Megatron-LM-style training step through the hook with a sliced schedule."""
    from megatron.core import pipeline_parallel

    from megatron_pp_ext.megatron import hook
    from megatron_pp_ext.megatron.model import build_chunks_from

    installed = hook.install(schedule="slimpipe", slices=4, slice_partition="balanced", p2p_timeout=60)
    try:
        microbatches = len(batches)
        schedule = installed.schedule(world, microbatches)
        model, names = build_chunks_from(reference, model_cfg, schedule.placement, rank, sliced=True)
        losses = pipeline_parallel.get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in model],
            model=model,
            num_microbatches=microbatches,
            seq_length=model_cfg.seq_length,
            micro_batch_size=MICRO_BATCH,
            decoder_seq_length=model_cfg.seq_length,
            forward_only=False,
        )
        evaluated = pipeline_parallel.get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in model],
            model=model,
            num_microbatches=microbatches,
            seq_length=model_cfg.seq_length,
            micro_batch_size=MICRO_BATCH,
            forward_only=True,
        )
        return {
            "eval_error": max(abs(a - b) / abs(b) for a, b in zip(loss_values(evaluated), ref_losses))
            if evaluated
            else None,
            "caches_left": [runtime_context(c).cached_microbatches() for c in model],
            "partition": schedule.meta["partition"],
            "lengths": list(runtime_lengths(model[0])),
            "grad_error": max(
                rel_error(p.grad, ref_grads[names[id(p)]]) for c in model for p in c.parameters()
            ),
            "loss_error": max(abs(a - b) / abs(b) for a, b in zip(loss_values(losses), ref_losses))
            if losses
            else None,
        }
    finally:
        hook.uninstall()


@functools.cache
def _launch(world: int) -> tuple:
    return tuple(check_ok(run_ranks(sliced_worker, world, timeout=300)))


def _check(world: int, key: str) -> None:
    reports = [r[key] for r in _launch(world)]
    errors = [f"rank {rank}: {r['error']}" for rank, r in enumerate(reports) if "error" in r]
    assert not errors, "\n".join(errors)
    limit = training_tolerance(model_config(world), CASES[world][0], 1)  # each step from the same weights
    for rank, r in enumerate(reports):
        check(r["grad_error"], limit, f"rank {rank}: gradient")
    loss_ranks = [r for r in reports if r["is_loss_rank"]]
    assert len(loss_ranks) == 1, loss_ranks
    check(loss_ranks[0]["loss_error"], limit, "loss")
    lengths = reports[0]["lengths"]
    assert sum(lengths) == SEQ and len(lengths) == int(key.split("/")[1][1:])
    if key.endswith("uniform"):
        assert len(set(lengths)) == 1
    else:  # balanced: later slices see more keys, so they are shorter (cuts rounded to 8 tokens)
        assert lengths[0] > lengths[-1], lengths


def _keys(world: int) -> list[str]:
    return [f"{name}/k{k}/{partition}" for name, k, partition in CASES[world][1]]


@pytest.mark.parametrize("key", _keys(2))
def test_sliced_exact_p2(key: str) -> None:
    _check(2, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _keys(3))
def test_sliced_exact_p3(key: str) -> None:
    _check(3, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _keys(4))
def test_sliced_exact_p4(key: str) -> None:
    _check(4, key)


def test_megatron_hook_runs_a_sliced_schedule_exactly_and_forward_only() -> None:
    reports = [r["hook"] for r in _launch(2)]
    limit = training_tolerance(model_config(2), CASES[2][0], 1)
    for rank, r in enumerate(reports):
        assert r["partition"] == "balanced" and sum(r["lengths"]) == SEQ
        check(r["grad_error"], limit, f"rank {rank}: gradient")
        assert r["caches_left"] == [[]], (rank, r)  # no K/V cache outlives a step
    check([r["loss_error"] for r in reports if r["loss_error"] is not None][0], limit, "loss")
    check([r["eval_error"] for r in reports if r["eval_error"] is not None][0], limit, "evaluation loss")


@pytest.mark.parametrize("world", [2])
def test_the_warm_up_creates_every_communicator_the_steps_use(world) -> None:
    """Under NCCL a communicator first used inside a step would be created there, blocking until
    its members arrive (runtime/creation.py): the runtime's warm-up leaves none for the step."""
    for rank, report in enumerate(_launch(world)):
        assert report["lazy_creations"] == [], f"rank {rank}: {report['lazy_creations'][:3]}"
