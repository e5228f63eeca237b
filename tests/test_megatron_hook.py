"""The Megatron hook: megatron-core's get_forward_backward_func returns our schedule, including
in a module that imported it by name before the hook was installed (as Megatron-LM's
megatron/training/training.py does), and a training step called exactly like Megatron-LM calls it
gives the reference gradients."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, training_tolerance
from runtime_case import forward_step, loss_values, make_batches, rel_error, tiny_model

from megatron_pp_ext.megatron import hook


def _training_module() -> types.ModuleType:
    """A stand-in for megatron/training/training.py: it did
    ``from megatron.core.pipeline_parallel import get_forward_backward_func`` at import time."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    module = types.ModuleType("fake_megatron_training")
    module.get_forward_backward_func = get_forward_backward_func
    sys.modules[module.__name__] = module
    return module


def test_install_patches_every_reference_and_uninstall_restores() -> None:
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    training = _training_module()
    try:
        installed = hook.install(schedule="1f1b")
        for module in (pipeline_parallel, schedules, training):
            assert module.get_forward_backward_func() == installed.forward_backward_func
        hook.uninstall()
        for module in (pipeline_parallel, schedules, training):
            assert module.get_forward_backward_func is original
    finally:
        hook.uninstall()
        sys.modules.pop(training.__name__, None)


def test_add_args_parses_megatron_style_flags() -> None:
    parser = hook.add_args(argparse.ArgumentParser())
    args = parser.parse_args(["--pp-schedule", "1f1b", "--pp-seq-slices", "4", "--pp-p2p-timeout", "30"])
    options = hook.PipelineOptions.from_args(args)
    assert (options.schedule, options.slices, options.p2p_timeout) == ("1f1b", 4, 30.0)
    bad = parser.parse_args(["--pp-schedule", "no-such-schedule"])
    with pytest.raises(hook.OptionError, match="--pp-schedule: unknown schedule 'no-such-schedule'"):
        hook.install(bad)


def test_install_with_megatron_args_fails_early_naming_the_flag() -> None:
    args = argparse.Namespace(
        pp_schedule="1f1b",
        pp_chunks=3,
        pp_seq_slices=1,
        pipeline_model_parallel_size=4,
        global_batch_size=16,
        micro_batch_size=2,
        data_parallel_size=1,
    )
    try:
        with pytest.raises(hook.OptionError, match="--pp-chunks"):
            hook.install(args)
        args.pp_chunks = None
        args.global_batch_size = 0
        with pytest.raises(hook.OptionError, match="--global-batch-size"):
            hook.install(args)
    finally:
        hook.uninstall()


def megatron_step_worker(
    rank: int, world: int, schedule_name: str, microbatches: int, losses_on_last_rank: bool = False
) -> dict:
    from megatron.core import pipeline_parallel

    from megatron_pp_ext.megatron.model import build_chunks_from, build_reference, init_parallel_state
    from megatron_pp_ext.runtime import reference_step

    training = _training_module()  # imported get_forward_backward_func before the hook
    init_parallel_state(world)
    installed = hook.install(
        schedule=schedule_name,
        p2p_timeout=60,
        losses_on_last_rank=losses_on_last_rank,
        emulate_nccl=losses_on_last_rank,  # NCCL's creation rule on the pair the losses take
    )
    model_cfg = tiny_model(num_layers=2 * world)
    torch.manual_seed(3)
    reference = build_reference(model_cfg)
    batches = make_batches(model_cfg, microbatches, seed=11)
    ref_losses = loss_values(reference_step(reference, forward_step, iter(batches), microbatches))
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}

    schedule = installed.schedule(world, microbatches)
    model, names = build_chunks_from(reference, model_cfg, schedule.placement, rank)

    # Exactly Megatron-LM's train_step call.
    forward_backward_func = training.get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in model],
        model=model,
        num_microbatches=microbatches,
        seq_length=model_cfg.seq_length,
        micro_batch_size=2,
        decoder_seq_length=model_cfg.seq_length,
        forward_only=False,
        adjust_tensor_shapes_fn=None,
    )
    ran = installed.last_result.op_count
    also_core = pipeline_parallel.get_forward_backward_func() == installed.forward_backward_func
    hook.uninstall()
    return {
        "is_loss_rank": installed.last_result.is_loss_rank,
        "loss_error": max(abs(a - b) for a, b in zip(loss_values(losses_reduced), ref_losses))
        if losses_reduced
        else None,
        "loss_count": len(losses_reduced),
        "grad_error": max(rel_error(p.grad, ref_grads[names[id(p)]]) for c in model for p in c.parameters()),
        "ops_run": ran,
        "expected_ops": {
            kind: sum(1 for op in schedule.ranks[rank] if op.kind.value == kind)
            for kind in ("F", "B", "W", "BW")
        },
        "core_patched": also_core,
        "lazy_creations": installed.last_creation.lazy,  # first uses no warm-up created
    }


def test_v_shape_losses_reach_the_last_rank_over_a_pair_created_before_the_step() -> None:
    """pretrain_gpt.py's path (``losses_on_last_rank``): V-Half computes the loss on rank 0 and
    the hook sends the loss dicts to the last rank, where Megatron-LM's loop reads them, over the
    world group's pair of the two. NCCL creates that pair at its first use: the hook creates it
    before the step, so under emulation nothing is first used unwarmed."""
    world, microbatches = 2, 3
    results = check_ok(run_ranks(megatron_step_worker, world, "v-half", microbatches, True, timeout=180))
    assert results[0]["is_loss_rank"] and results[0]["loss_count"] == 0
    assert results[1]["loss_count"] == microbatches
    check(
        results[1]["loss_error"],
        training_tolerance(tiny_model(num_layers=2 * world), microbatches, 1),
        "loss",
    )
    assert [r["lazy_creations"] for r in results] == [[], []]


@pytest.mark.parametrize("schedule_name", ["1f1b", "zb-h1", "v-half"])
def test_megatron_training_step_runs_our_schedule(schedule_name: str) -> None:
    world, microbatches = 2, 3
    results = check_ok(run_ranks(megatron_step_worker, world, schedule_name, microbatches, timeout=180))
    loss_ranks = [r for r in results if r["is_loss_rank"]]
    assert len(loss_ranks) == 1 and loss_ranks[0]["loss_count"] == microbatches
    limit = training_tolerance(tiny_model(num_layers=2 * world), microbatches, 1)  # the worker's
    check(loss_ranks[0]["loss_error"], limit, "loss")
    for rank, result in enumerate(results):
        assert result["core_patched"]
        check(result["grad_error"], limit, f"rank {rank}: gradient")
        for kind, count in result["expected_ops"].items():
            assert result["ops_run"].get(kind, 0) == count, f"rank {rank} ran {result['ops_run']}"
