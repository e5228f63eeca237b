"""Mixture-of-experts models under our schedules equal megatron-core's own schedule, on real
processes (gloo): a tiny GPTModel whose every layer is megatron-core's MoE layer (router, 4
experts, top-2, a shared expert, the allgather dispatcher) with the load-balancing loss and the
z-loss on. Each rank runs the whole model under megatron-core's ``forward_backward_no_pipelining``
(which sets the auxiliary losses' scale), then every schedule family on its own chunks with the
same weights: losses and every gradient, the routers' included, must agree.

The auxiliary losses reach the router through ``MoEAuxLossAutoScaler``, whose backward reads a
scale the schedule sets (a class attribute, not the graph); each run starts from scale 1, so a
runtime that does not set it is caught (``test_an_unset_scale_is_caught`` shows the size).

Sequence-sliced schedules (Seq1F1B, SlimPipe) give the unsliced model's gradients too: their
routers use the sequence's tokens per expert and weigh each slice's z-loss by its share of the
tokens (``megatron/sliced_router.py``); with megatron-core's own router (one loss per slice) the
routers' gradients are off (``test_per_slice_statistics_are_caught``). A load-balancing type whose
statistics are not the sequence's is refused in one line.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from dist_utils import check_ok, run_ranks
from exactness import check, check_worst, training_tolerance
from runtime_case import forward_step, loss_values, make_batches, megatron_reference, rel_error, tiny_model

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "v-half", "v-zb", "dualpipev"]
CASES = {
    2: 3,
    3: 4,
}  # pipeline size -> microbatches (not a multiple of p; raised where a schedule needs more)
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.1,
    moe_z_loss_coeff=1e-3,
    moe_token_dispatcher_type="allgather",
)
UNSCALED = "1f1b without the scale"
PER_SLICE = "seq1f1b/k2 with megatron-core's router"
SLICED = {2: [("seq1f1b", 2), ("slimpipe", 2)], 3: [("seq1f1b", 2)]}  # (schedule, slices) per p


def moe_model(pp: int):
    return dataclasses.replace(tiny_model(num_layers=2 * pp + 1), extra=MOE)


def _schedule(name: str, pp: int, microbatches: int):
    from megatron_pp_ext.schedule.generators import SCHEDULES as REGISTRY
    from megatron_pp_ext.schedule.generators import generate

    spec = REGISTRY[name]
    needed = spec.min_microbatches(pp, spec.default_vpp, 1)
    return generate(name, pp, max(microbatches, needed), vpp=spec.default_vpp, slices=1)


def moe_worker(rank: int, world: int, microbatches: int) -> dict:
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.model import build_chunks_from, init_parallel_state
    from megatron_pp_ext.runtime import stage
    from megatron_pp_ext.runtime.executor import PipelineRuntime
    from megatron_pp_ext.runtime.p2p import PipeComm

    init_parallel_state(world)
    cpu_shim.install_for_schedules()
    model_cfg = moe_model(world)
    comm = PipeComm(timeout_s=60)
    references: dict[int, tuple] = {}
    report: dict[str, dict] = {}
    runs = [(name, name) for name in SCHEDULES] + [(UNSCALED, "1f1b")]
    for label, name in runs:
        schedule = _schedule(name, world, microbatches)
        m = schedule.microbatches
        if m not in references:
            batches = make_batches(model_cfg, m, seed=100 + m)
            references[m] = (batches, *megatron_reference(model_cfg, batches, m))
        batches, reference, ref_grads, ref_losses = references[m]
        chunks, names_of = build_chunks_from(reference, model_cfg, schedule.placement, rank)
        runtime = PipelineRuntime(
            chunks, comm, (model_cfg.seq_length, 2, model_cfg.hidden_size), torch.float32
        )
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # as a fresh process has it
        setter = stage.set_auxiliary_loss_scales
        if label == UNSCALED:
            stage.set_auxiliary_loss_scales = lambda *args: None
        try:
            result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
        finally:
            stage.set_auxiliary_loss_scales = setter
        report[label] = _compared(chunks, names_of, result, ref_grads, ref_losses, m)
    sliced = [(f"{name}/k{k}", name, k) for name, k in SLICED[world]]
    for label, name, slices in [*sliced, (PER_SLICE, "seq1f1b", 2)]:
        report[label] = _sliced_run(
            model_cfg, world, microbatches, references, comm, rank, name, slices, label
        )
    report["refusal"] = _sliced_refusal(model_cfg, world, comm, rank)
    return report


def _sliced_run(model_cfg, world, microbatches, references, comm, rank, name, slices, label) -> dict:
    """One step of a sliced schedule on chunks with the reference's weights, against megatron-
    core's unsliced run of the same microbatches."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from megatron_pp_ext.megatron import sliced as sliced_module
    from megatron_pp_ext.megatron.model import build_chunks_from
    from megatron_pp_ext.runtime.executor import PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    schedule = generate(name, world, microbatches, slices=slices)
    m = schedule.microbatches
    if m not in references:
        batches = make_batches(model_cfg, m, seed=100 + m)
        references[m] = (batches, *megatron_reference(model_cfg, batches, m))
    batches, reference, ref_grads, ref_losses = references[m]
    slice_routers = sliced_module.slice_routers
    if label == PER_SLICE:
        sliced_module.slice_routers = lambda *args: 0
    try:
        chunks, names_of = build_chunks_from(reference, model_cfg, schedule.placement, rank, sliced=True)
    finally:
        sliced_module.slice_routers = slice_routers
    runtime = PipelineRuntime(chunks, comm, (model_cfg.seq_length, 2, model_cfg.hidden_size), torch.float32)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
    return _compared(chunks, names_of, result, ref_grads, ref_losses, m)


def _compared(chunks, names_of, result, ref_grads, ref_losses, microbatches: int) -> dict:
    """A step's gradients (by name) and losses against the reference's."""
    params = [p for c in chunks for p in c.parameters()]
    entry: dict = {
        "microbatches": microbatches,
        "missing": [names_of[id(p)] for p in params if p.grad is None],
        "grad_errors": {
            names_of[id(p)]: rel_error(p.grad, ref_grads[names_of[id(p)]])
            for p in params
            if p.grad is not None
        },
        "is_loss_rank": result.is_loss_rank,
    }
    if result.is_loss_rank:
        losses = loss_values(result.losses)
        entry["loss_error"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return entry


def _sliced_refusal(model_cfg, world: int, comm, rank: int) -> str:
    """A load-balancing type whose statistics are not the sequence's: refused before any op."""
    from megatron_pp_ext.megatron.model import build_chunks
    from megatron_pp_ext.runtime.executor import PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    per_sequence = dataclasses.replace(
        model_cfg, extra={**model_cfg.extra, "moe_router_load_balancing_type": "seq_aux_loss"}
    )
    schedule = generate("seq1f1b", world, world, slices=2)
    chunks = build_chunks(per_sequence, schedule.placement, rank, sliced=True)
    runtime = PipelineRuntime(chunks, comm, (model_cfg.seq_length, 2, model_cfg.hidden_size), torch.float32)
    batches = make_batches(model_cfg, world)
    try:
        runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
    except ValueError as error:
        return str(error)
    return "ran"


@functools.cache
def _launch(world: int) -> tuple:
    return tuple(check_ok(run_ranks(moe_worker, world, CASES[world], timeout=300)))


def _tolerance(world: int, microbatches: int) -> float:
    return training_tolerance(moe_model(world), microbatches, 1)


def _check_equal(world: int, reports: list[dict]) -> None:
    limit = _tolerance(world, reports[0]["microbatches"])
    for rank, r in enumerate(reports):
        assert not r["missing"], f"rank {rank}: no gradient for {r['missing']}"
        routers = {n: e for n, e in r["grad_errors"].items() if ".router." in n}
        assert routers, f"rank {rank}: no router among {list(r['grad_errors'])[:5]}"
        check_worst(r["grad_errors"], limit, f"rank {rank}: gradient of")
    loss_ranks = [r for r in reports if r["is_loss_rank"]]
    assert len(loss_ranks) == 1
    check(loss_ranks[0]["loss_error"], limit, "loss")


@pytest.mark.parametrize("world", sorted(CASES))
@pytest.mark.parametrize("name", SCHEDULES)
def test_moe_schedule_equals_megatron_s_own(world: int, name: str) -> None:
    _check_equal(world, [r[name] for r in _launch(world)])


@pytest.mark.parametrize(
    "world, label", [(p, f"{name}/k{k}") for p, runs in SLICED.items() for name, k in runs]
)
def test_sliced_moe_schedule_equals_megatron_s_unsliced_one(world: int, label: str) -> None:
    """Aux loss and z-loss on, each slice routing its own tokens: the sequence's losses."""
    _check_equal(world, [r[label] for r in _launch(world)])


def test_per_slice_statistics_are_caught() -> None:
    """megatron-core's router in a sliced chunk (one load-balancing loss and one z-loss mean per
    slice) is off by far more than the tolerance: the sliced comparison above can fail."""
    world = min(CASES)
    reports = [r[PER_SLICE] for r in _launch(world)]
    limit = _tolerance(world, reports[0]["microbatches"])
    worst = max(e for r in reports for n, e in r["grad_errors"].items() if ".router." in n)
    assert worst > 100 * limit, worst


def test_an_unset_scale_is_caught() -> None:
    """Without the scale (the runtime before megatron's contract covered it) the routers'
    gradients are off by far more than the tolerance: the comparison above can fail."""
    world = min(CASES)
    reports = [r[UNSCALED] for r in _launch(world)]
    limit = _tolerance(world, reports[0]["microbatches"])
    worst = max(e for r in reports for n, e in r["grad_errors"].items() if ".router." in n)
    assert worst > 100 * limit, worst


def test_sliced_schedules_refuse_per_sequence_load_balancing_in_one_line() -> None:
    for rank, report in enumerate(_launch(min(CASES))):
        refusal = report["refusal"]
        assert refusal.startswith("--moe-router-load-balancing-type seq_aux_loss"), (rank, refusal)
        assert "per slice" in refusal and "\n" not in refusal
