"""Pipeline schedules composed with tensor, sequence and data parallelism, on real gloo processes,
through megatron-core's own DistributedDataParallel and ``finalize_model_grads``.

Each launch is one world of 4 processes laid out by Megatron's ``parallel_state`` (TP x PP x DP)
and runs several cases in turn. For every case each rank builds the whole model without a
pipeline at the same TP size (its reference: same weights, same TP shards), wraps its own
pipeline chunks (copies of the reference's layers) in Megatron's DDP, and runs 3 training steps
of both side by side: the schedule through ``forward_backward`` (which calls
``finalize_model_grads``), the reference over the same global batch (every data-parallel share)
in one process. Compared at every step: the losses on the loss rank, every finalized gradient
(``main_grad``) and the global gradient norm; after 3 AdamW steps, the parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
from compose_case import (
    compose_pipeline,
    param_errors,
    record_grad_errors,
    reduce_sequence_parallel_grads,
    reference_norm,
)
from dist_utils import check_ok, run_ranks
from exactness import check, check_worst, training_tolerance
from runtime_case import (
    MICRO_BATCH,
    forward_step,
    loss_values,
    make_batches,
)

STEPS = 3


@dataclass(frozen=True)
class Case:
    schedule: str
    microbatches: int = 3  # per data-parallel rank; not a multiple of p
    slices: int = 1
    redistribution: float = 0.0
    offload: str = "none"
    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        parts = [self.schedule]
        parts += [f"k{self.slices}"] if self.slices > 1 else []
        parts += ["redistribution"] if self.redistribution else []
        parts += [f"offload-{self.offload}"] if self.offload != "none" else []
        return "-".join(parts)


# TP2 x PP2 with sequence parallelism (DP 1): Megatron's DDP without overlap.
TP_SP = [
    Case("1f1b"),
    Case("zb-h1"),
    Case("v-zb", microbatches=4),
    Case("slimpipe", microbatches=2, slices=4, redistribution=0.5),
]
# PP2 x DP2: overlapped grad reduce with the distributed optimizer's bucket layout.
DP = [
    Case("interleaved-1f1b", overlap_grad_reduce=True, distributed_optimizer=True),
    Case("zb-h2", overlap_grad_reduce=True, distributed_optimizer=True),
    Case("dualpipev", microbatches=4, overlap_grad_reduce=True, distributed_optimizer=True),
    Case("zb-h1", offload="full", overlap_grad_reduce=True),
]
LAUNCHES = {"tp2-sp-pp2": (2, True, TP_SP), "pp2-dp2": (1, False, DP)}


def _model(num_layers: int, sequence_parallel: bool, seq_length: int):
    from megatron_pp_ext.megatron.model import ModelConfig

    return ModelConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        vocab_size=64,
        seq_length=seq_length,
        extra={"sequence_parallel": sequence_parallel},
    )


def _schedule(case: Case, pp: int):
    from megatron_pp_ext.megatron.hook import PipelineOptions

    options = PipelineOptions(
        schedule=case.schedule,
        slices=case.slices,
        offload=case.offload,
        attn_redistribution=case.redistribution,
    )
    return options.schedule_for(pp, case.microbatches)


def compose_worker(rank: int, world: int, tp: int, sequence_parallel: bool, cases: list[Case]) -> dict:
    from megatron.core import parallel_state

    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.ddp import zero_grad_buffers
    from megatron_pp_ext.megatron.model import build_reference, init_parallel_state
    from megatron_pp_ext.megatron.optimizer import OptimizerSettings, gather_grad_shards
    from megatron_pp_ext.runtime import PipeComm, forward_backward, reference_step

    cpu_shim.install()
    pp = 2
    init_parallel_state(pp, tp)
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    pipeline = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    comm = PipeComm(pipeline, timeout_s=60)
    settings = OptimizerSettings(lr=1e-3, clip_grad=0.0)
    report: dict[str, dict] = {"dp": dp, "tp": parallel_state.get_tensor_model_parallel_world_size()}
    for case in cases:
        entry: dict = {}
        report[case.name] = entry
        try:
            schedule = _schedule(case, pp)
            sliced = schedule.slices > 1
            model_cfg = _model(2 * pp + 1, sequence_parallel, 32 if sliced else 16)
            torch.manual_seed(1234)
            reference = build_reference(model_cfg)
            pipeline = compose_pipeline(
                reference,
                model_cfg,
                schedule,
                comm,
                settings,
                case.overlap_grad_reduce,
                case.distributed_optimizer,
                case.redistribution,
                sliced,
            )
            model, runtime, optimizer, ref_optimizer = (
                pipeline.model,
                pipeline.runtime,
                pipeline.optimizer,
                pipeline.ref_optimizer,
            )
            m = schedule.microbatches
            grad_errors: dict[str, float] = {}
            loss_errors: list[float] = []
            norm_errors: list[float] = []
            for step in range(STEPS):
                batches = make_batches(model_cfg, m * dp, seed=1000 * step + 7)
                mine = [batches[i * dp + dp_rank] for i in range(m)]  # Megatron's sampler order
                # the pipeline
                zero_grad_buffers(model)
                losses = forward_backward(
                    runtime,
                    schedule,
                    forward_step_func=forward_step,
                    data_iterator=[iter(mine) for _ in model],
                    model=model,
                    num_microbatches=m,
                    seq_length=model_cfg.seq_length,
                    micro_batch_size=MICRO_BATCH,
                )
                gather_grad_shards(model)
                # the reference: the whole global batch in one process
                ref_optimizer.zero_grad(set_to_none=True)
                ref_losses = loss_values(reference_step(reference, forward_step, iter(batches), m * dp))
                reduce_sequence_parallel_grads(reference)
                record_grad_errors(pipeline, grad_errors)
                if runtime.last_result.is_loss_rank:
                    got = loss_values(losses)
                    want = [ref_losses[i * dp + dp_rank] for i in range(m)]
                    loss_errors += [abs(a - b) / abs(b) for a, b in zip(got, want)]
                    entry["loss_count"] = (len(got), len(want))
                norm = optimizer.step()
                ref_norm = reference_norm(reference)
                norm_errors.append(abs(norm - ref_norm) / ref_norm)
                ref_optimizer.step()
            entry["grad_errors"] = grad_errors
            entry["loss_errors"] = loss_errors
            entry["norm_errors"] = norm_errors
            entry["param_errors"] = param_errors(pipeline)
            entry["is_loss_rank"] = runtime.last_result.is_loss_rank
            offload = runtime.last_result.offload
            entry["offloaded_bytes"] = 0 if offload is None else offload.offloaded_bytes
            entry["pipeline_rank"] = comm.rank
            entry["sequence_share"] = runtime.sequence_share
            entry["attention"] = (
                None if runtime.last_result.attention is None else runtime.last_result.attention.totals()
            )
        except Exception as error:
            import traceback

            entry["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    comm.close()
    report["lazy_creations"] = comm.creation.lazy  # first uses the warm-up missed
    return report


@functools.cache
def _launch(name: str) -> tuple:
    tp, sequence_parallel, cases = LAUNCHES[name]
    return tuple(check_ok(run_ranks(compose_worker, 4, tp, sequence_parallel, cases, timeout=600)))


def _check(launch: str, case: Case) -> list[dict]:
    reports = _launch(launch)
    entries = [r[case.name] for r in reports]
    errors = [f"rank {rank}: {e['error']}" for rank, e in enumerate(entries) if "error" in e]
    assert not errors, "\n".join(errors)
    _, sequence_parallel, _ = LAUNCHES[launch]
    model = _model(5, sequence_parallel, 32 if case.slices > 1 else 16)  # the worker's, at pp 2
    limit = training_tolerance(model, case.microbatches, STEPS, MICRO_BATCH, reports[0]["dp"])
    for rank, entry in enumerate(entries):
        check_worst(entry["grad_errors"], limit, f"rank {rank}: gradient of")
        check(max(entry["norm_errors"]), limit, f"rank {rank}: grad norm")
        check_worst(entry["param_errors"], limit, f"rank {rank}: after {STEPS} steps, parameter")
    loss_ranks = [e for e in entries if e["is_loss_rank"]]
    # one loss rank per pipeline: TP ranks of the last stage all hold the loss
    assert len(loss_ranks) == 2
    for entry in loss_ranks:
        assert entry["loss_count"][0] == entry["loss_count"][1] > 0
        check(max(entry["loss_errors"]), limit, "loss")
    return entries


@pytest.mark.slow
@pytest.mark.parametrize("case", TP_SP, ids=lambda c: c.name)
def test_tp2_sp_pp2(case: Case) -> None:
    reports = _launch("tp2-sp-pp2")
    assert all(r["tp"] == 2 and r["dp"] == 1 for r in reports)
    entries = _check("tp2-sp-pp2", case)
    assert all(e["sequence_share"] == 2 for e in entries)  # messages carry half the sequence
    if case.redistribution:
        handed_away = sum(e["attention"][2] for e in entries)
        assert handed_away > 0, "redistribution moved no attention"


@pytest.mark.slow
@pytest.mark.parametrize("case", DP, ids=lambda c: c.name)
def test_pp2_dp2(case: Case) -> None:
    reports = _launch("pp2-dp2")
    assert all(r["tp"] == 1 and r["dp"] == 2 for r in reports)
    entries = _check("pp2-dp2", case)
    if case.offload != "none":
        # the first stage's units live longest: there the copies always pay off
        assert all(e["offloaded_bytes"] > 0 for e in entries if e["pipeline_rank"] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_the_warm_up_creates_every_communicator_the_steps_use(launch) -> None:
    """Under NCCL a communicator first used inside a step would be created there, blocking until
    its members arrive (runtime/creation.py): the runtime's warm-up leaves none for the step."""
    for rank, report in enumerate(_launch(launch)):
        assert report["lazy_creations"] == [], f"rank {rank}: {report['lazy_creations'][:3]}"
