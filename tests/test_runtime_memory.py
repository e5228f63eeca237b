"""Activation accounting during a real 1F1B run agrees with the per-op probe.

In 1F1B rank r holds min(p - r, m) microbatches' forward activations at its peak, so its measured
peak should be that many times the bytes one F of its stage keeps (``measure_op_memory`` on the
same chunk in isolation), plus little (gradients and messages in flight).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches, tiny_model


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
