"""Overlapped pairs (``--overlap-moe-expert-parallel-comm``) on real processes: the forward of one
microbatch and the backward of another run as one unit through megatron-core's schedule plan, the
expert all-to-alls on a communication thread (``runtime/expert_overlap.py``). A tiny GPTModel of
a dense first layer (megatron-core's no-op dispatch and combine nodes in the plan) then MoE layers
(4 experts, top-2, a shared expert, the alltoall dispatcher, the load-balancing and z-losses on)
over PP 2 x EP 2 (DP 2, 4 gloo ranks): every schedule that pairs gives, paired, the
gradients and losses of the same schedule unpaired and of megatron-core's own run of the whole
model without a pipeline; under NCCL's rules too (``--pp-emulate-nccl``: the pair's all-to-alls
on the expert group and the pipeline's messages must not wait on each other's order)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, check_worst, training_tolerance
from runtime_case import forward_step, loss_values, make_batches, megatron_reference, rel_error, tiny_model

PP, WORLD, MICROBATCHES = 2, 4, 5  # m not a multiple of p
PAIRING = ["1f1b", "interleaved-1f1b", "zb-h2", "v-zb", "dualpipev"]
NCCL = ["dualpipev", "v-zb"]  # also under NCCL's rules
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_layer_freq=[0] + [1] * (2 * PP),  # a dense first layer
    moe_aux_loss_coeff=0.1,
    moe_z_loss_coeff=1e-3,
    moe_token_dispatcher_type="alltoall",
    expert_model_parallel_size=2,
)


def moe_model():
    return dataclasses.replace(tiny_model(num_layers=2 * PP + 1), extra=MOE)


def _schedule(name: str, paired: bool):
    from megatron_pp_ext.schedule.generators import SCHEDULES, generate
    from megatron_pp_ext.schedule.pairing import pair

    spec = SCHEDULES[name]
    m = max(MICROBATCHES, spec.min_microbatches(PP, spec.default_vpp, 1))
    schedule = generate(name, PP, m, vpp=spec.default_vpp, slices=1)
    return pair(schedule) if paired else schedule


def overlap_worker(rank: int, world: int, names: list[str], nccl: list[str]) -> dict:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.model import build_chunks_from, init_parallel_state
    from megatron_pp_ext.runtime.executor import PipelineRuntime
    from megatron_pp_ext.runtime.p2p import PipeComm

    init_parallel_state(PP, ep_size=2)
    cpu_shim.install_for_schedules()
    model_cfg = moe_model()
    pipeline = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    comms = {False: PipeComm(pipeline, timeout_s=60, emulate_nccl=False)}
    if nccl:
        comms[True] = PipeComm(pipeline, timeout_s=60, emulate_nccl=True)
    data_rank = parallel_state.get_data_parallel_rank()
    references: dict[int, tuple] = {}
    report: dict = {}
    runs = [(name, paired, False) for name in names for paired in (False, True)]
    runs += [(name, True, True) for name in nccl]
    for name, paired, emulate in runs:
        schedule = _schedule(name, paired)
        m = schedule.microbatches
        if m not in references:
            batches = make_batches(model_cfg, m, seed=100 + 10 * data_rank + m)
            references[m] = (batches, *megatron_reference(model_cfg, batches, m))
        batches, reference, ref_grads, ref_losses = references[m]
        chunks, names_of = build_chunks_from(reference, model_cfg, schedule.placement, comms[False].rank)
        runtime = PipelineRuntime(
            chunks, comms[emulate], (model_cfg.seq_length, 2, model_cfg.hidden_size), torch.float32
        )
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
        params = [p for c in chunks for p in c.parameters()]
        entry = {
            "pairs": len((schedule.meta.get("pairs") or [[]] * PP)[comms[False].rank]),
            "pairs_run": result.pairs,
            "comm_nodes": runtime.lane().nodes if paired else 0,
            "missing": [names_of[id(p)] for p in params if p.grad is None],
            "grads": {
                names_of[id(p)]: p.grad.detach().clone().tolist() for p in params if p.grad is not None
            },
            "grad_errors": {
                names_of[id(p)]: rel_error(p.grad, ref_grads[names_of[id(p)]])
                for p in params
                if p.grad is not None
            },
            "is_loss_rank": result.is_loss_rank,
            "losses": loss_values(result.losses) if result.is_loss_rank else [],
            "ref_losses": ref_losses,
            "microbatches": m,
        }
        report[(name, paired, emulate)] = entry
    for comm in comms.values():
        comm.close()
    return report


@functools.cache
def _launch() -> tuple:
    return tuple(check_ok(run_ranks(overlap_worker, WORLD, PAIRING, NCCL, timeout=600)))


def _tolerance(microbatches: int) -> float:
    return training_tolerance(moe_model(), microbatches, 1)


@pytest.mark.parametrize("name", PAIRING)
def test_paired_schedule_equals_unpaired_and_megatron_s_own(name: str) -> None:
    reports = _launch()
    assert sum(r[(name, True, False)]["pairs"] for r in reports) > 0, "no pair to run"
    for rank, report in enumerate(reports):  # every pair ran as one unit, its all-to-alls on the lane
        row = report[(name, True, False)]
        assert row["pairs_run"] == row["pairs"], (rank, row["pairs_run"], row["pairs"])
        # each MoE layer's F and B: dispatch and combine, forward and backward
        assert row["comm_nodes"] > 0 and row["comm_nodes"] % 2 == 0, (rank, row["comm_nodes"])
        assert report[(name, False, False)]["pairs_run"] == 0
    for paired in (False, True):
        rows = [r[(name, paired, False)] for r in reports]
        limit = _tolerance(rows[0]["microbatches"])
        for rank, row in enumerate(rows):
            assert not row["missing"], f"rank {rank}: no gradient for {row['missing']}"
            assert any(".router." in n for n in row["grad_errors"]), rank
            assert any(".experts." in n for n in row["grad_errors"]), rank
            assert any(".shared_experts." in n for n in row["grad_errors"]), rank
            check_worst(row["grad_errors"], limit, f"rank {rank} paired={paired}: gradient of")
        for row in rows:
            if row["is_loss_rank"]:
                worst = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], row["ref_losses"]))
                check(worst, limit, f"loss paired={paired}")
    for rank, report in enumerate(reports):  # paired against unpaired, parameter by parameter
        paired, unpaired = report[(name, True, False)]["grads"], report[(name, False, False)]["grads"]
        errors = {n: rel_error(torch.tensor(paired[n]), torch.tensor(unpaired[n])) for n in unpaired}
        check_worst(errors, _tolerance(MICROBATCHES), f"rank {rank}: paired against unpaired, gradient of")


@pytest.mark.parametrize("name", NCCL)
def test_paired_schedule_under_nccl_rules_equals_megatron_s_own(name: str) -> None:
    rows = [r[(name, True, True)] for r in _launch()]
    limit = _tolerance(rows[0]["microbatches"])
    for rank, row in enumerate(rows):
        assert not row["missing"], f"rank {rank}: no gradient for {row['missing']}"
        check_worst(row["grad_errors"], limit, f"rank {rank} under NCCL's rules: gradient of")


class _SlowNode:
    """A communication node whose peer never joins: its forward blocks until released."""

    name = "moe_dispatch"

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def forward(self, value: int) -> int:
        self.release.wait(10)
        return value


def test_a_node_whose_all_to_all_never_completes_fails_the_op_naming_it() -> None:
    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.runtime.expert_overlap import CommLane

    cpu_shim.install()
    lane = CommLane(on_host=True, timeout_s=0.2)
    node = _SlowNode()
    try:
        future = lane.run(node.forward, 7)
        with pytest.raises(
            TimeoutError, match=r"moe_dispatch node did not complete within 0.2 s \(--pp-p2p-timeout\)"
        ):
            lane.result(future, node.forward)
        assert lane.nodes == 1
    finally:
        node.release.set()
        lane.close()
    quick = _SlowNode()
    quick.release.set()
    assert lane.result(CommLane(on_host=True).run(quick.forward, 3), quick.forward) == 3
