"""Measured activation peaks on real ranks against the simulator's prediction.

The simulator is calibrated from the model, not from the run: ``stage_op_memory`` measures, for
each virtual stage in isolation, the bytes one F keeps and the bytes its W still needs after B.
Those numbers go into a ``TableCosts``; the simulator then predicts each rank's peak under each
schedule, and the pipeline run on 4 gloo ranks must land within 15% of it.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches, tiny_model

SCHEDULES = ["1f1b", "zb-h1", "zb-h2", "v-half", "v-min", "v-zb"]
PP, MICROBATCHES, LAYERS = 4, 8, 8


def measure_worker(rank: int, world: int, names: list[str]) -> dict:
    from megatron_pp_ext.megatron.calibration import stage_op_memory
    from megatron_pp_ext.megatron.model import build_chunks, init_parallel_state
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    model = tiny_model(LAYERS)
    comm = PipeComm(timeout_s=120)
    batches = make_batches(model, MICROBATCHES)
    out: dict = {"peaks": {}, "probes": {}}
    for name in names:
        schedule = generate(name, world, MICROBATCHES)
        torch.manual_seed(0)
        chunks = build_chunks(model, schedule.placement, rank)
        runtime = PipelineRuntime(
            chunks, comm, (model.seq_length, MICRO_BATCH, model.hidden_size), torch.float32
        )
        result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
        out["peaks"][name] = result.peak_activation_bytes
        if rank == 0 and schedule.num_stages not in out["probes"]:
            probes = stage_op_memory(model, schedule.num_stages, micro_batch_size=MICRO_BATCH)
            out["probes"][schedule.num_stages] = [(p.forward, p.after_backward) for p in probes]
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return check_ok(run_ranks(measure_worker, PP, SCHEDULES, timeout=600))


def predicted_peaks(name: str, probes: list[tuple[int, int]]) -> list[float]:
    from megatron_pp_ext.schedule.costs import TableCosts, UniformCosts
    from megatron_pp_ext.schedule.generators import generate
    from megatron_pp_ext.schedule.simulate import simulate

    schedule = generate(name, PP, MICROBATCHES)
    costs = TableCosts(
        default=UniformCosts(num_stages=schedule.num_stages),
        activations={(stage,): float(forward) for stage, (forward, _) in enumerate(probes)},
        weight_shares={(stage,): float(share) for stage, (_, share) in enumerate(probes)},
    )
    return simulate(schedule, costs).peak_memory_per_rank


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEDULES)
def test_measured_peak_within_15_percent_of_simulator(measured: list[dict], name: str) -> None:
    from megatron_pp_ext.schedule.generators import generate

    stages = generate(name, PP, MICROBATCHES).num_stages
    predicted = predicted_peaks(name, measured[0]["probes"][stages])
    actual = [rank_result["peaks"][name] for rank_result in measured]
    for rank, (got, want) in enumerate(zip(actual, predicted)):
        assert abs(got - want) <= 0.15 * want, (
            f"{name} rank {rank}: measured {got} B, simulator {want:.0f} B "
            f"({got / want - 1:+.1%}); all ranks measured {actual}, predicted {[round(p) for p in predicted]}"
        )
