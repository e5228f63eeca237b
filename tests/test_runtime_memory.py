"""Activation accounting during a real 1F1B run agrees with the per-op probe.

In 1F1B rank r holds min(p - r, m) microbatches' forward activations at its peak, so its measured
peak should be that many times the bytes one F of its stage keeps (``measure_op_memory`` on the
same chunk in isolation), plus little (gradients and messages in flight).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, loss_values, make_batches, tiny_model


def peak_worker(rank: int, world: int, microbatches: int) -> dict:
    from megatron_pp_ext.megatron.model import build_stage, init_parallel_state, split_layers
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime, measure_op_memory
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    model = tiny_model(2 * world)
    schedule = generate("1f1b", world, microbatches)
    layers = split_layers(model.num_layers, world)
    chunk = build_stage(model, rank, layers)
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    runtime = PipelineRuntime([chunk], PipeComm(timeout_s=60), shape, torch.float32)
    batches = make_batches(model, microbatches)
    result = runtime.step(schedule, forward_step, iter(batches))

    def run_forward(c: torch.nn.Module, last: bool = rank == world - 1) -> torch.Tensor:
        output, loss = forward_step(iter(batches[:1]), c)
        return loss(output)[0] if last else output

    probe = measure_op_memory(chunk, run_forward, None if rank == 0 else torch.randn(shape))
    return {"peak": result.peak_activation_bytes, "probe": probe.__dict__}


@pytest.mark.slow
def test_1f1b_peak_matches_probe_p4() -> None:
    world, microbatches = 4, 6
    results = check_ok(run_ranks(peak_worker, world, microbatches, timeout=120))
    for rank, result in enumerate(results):
        in_flight = min(world - rank, microbatches)
        ratio = result["peak"] / result["probe"]["forward"]
        assert in_flight - 0.05 <= ratio <= in_flight + 0.25, (rank, result, ratio)
        assert 0 < result["probe"]["after_backward"] < result["probe"]["forward"]
        assert result["probe"]["after_weight"] == 0


def unmeasured_worker(rank: int, world: int) -> dict:
    """The same steps with and without the meter, and which linears the step gives a store."""
    from megatron_pp_ext.megatron.model import build_stage, init_parallel_state, split_layers
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    model = tiny_model(2 * world)
    chunk = build_stage(model, rank, split_layers(model.num_layers, world))
    shape = (model.seq_length, MICRO_BATCH, model.hidden_size)
    batches = make_batches(model, 4)
    comm = PipeComm(timeout_s=60)
    report: dict = {}
    for name in ("1f1b", "zb-h1"):
        for measured in (True, False):
            chunk.zero_grad(set_to_none=True)
            runtime = PipelineRuntime([chunk], comm, shape, torch.float32, measure_memory=measured)
            result = runtime.step(generate(name, world, 4), forward_step, iter(batches))
            stores = {
                getattr(m, "wgrad_store", None) is not None
                for m in chunk.modules()
                if hasattr(m, "wgrad_store")
            }
            report[f"{name}/{measured}"] = {
                "peak": result.peak_activation_bytes,
                "losses": loss_values(result.losses) if result.is_loss_rank else None,
                "grads": [p.grad.clone() for p in chunk.parameters()],  # compared here: tensors
                # do not travel back through the result queue
                "stores": sorted(stores),
            }
    for name in ("1f1b", "zb-h1"):
        on, off = report[f"{name}/True"], report[f"{name}/False"]
        off["grads_equal"] = all(torch.equal(a, b) for a, b in zip(on.pop("grads"), off.pop("grads")))
    return report


@pytest.mark.slow
def test_a_step_pays_only_for_what_it_uses() -> None:
    """Without the meter (``measure_memory=False``: the pretrain_gpt.py hook's default) a step
    gives the same losses and gradients and reports no peak; a schedule without W ops (1F1B)
    runs Megatron's own linears, one with W ops (ZB-H1) the weight-gradient store's."""
    for report in check_ok(run_ranks(unmeasured_worker, 2, timeout=120)):
        for name in ("1f1b", "zb-h1"):
            on, off = report[f"{name}/True"], report[f"{name}/False"]
            assert on["peak"] > 0 and off["peak"] is None
            assert on["losses"] == off["losses"]
            assert off["grads_equal"]
        assert report["1f1b/True"]["stores"] == [False] and report["zb-h1/True"]["stores"] == [True]
