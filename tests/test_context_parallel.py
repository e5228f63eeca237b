"""Context parallelism (CP) with the pipeline schedules, on gloo processes, against one process.

The layout: every slice (or the whole sequence, for unsliced schedules) is cut into 2*CP pieces
and CP rank r holds pieces r and 2CP-1-r (Megatron's load-balanced layout, per slice).

* Layout and rotary positions, in one process: pieces, positions, the gather order, and the
  rotary embedding of a rank's tokens at their global positions (also for a slice's offset).
* The CP attention on 2 processes: slices forward in order and backward in reverse (K/V of the
  current slice all-gathered, gradients reduce-scattered), with uneven slices, GQA, each backend
  and SlimPipe's delegation of the oldest slices; outputs and dq/dk/dv of each rank's tokens
  against plain causal attention over the whole sequence.
* CP2 x PP2 (and TP2 x SP x CP2 on one stage) on 4 processes through megatron-core's DDP and
  ``finalize_model_grads``: losses (summed over the CP ranks), every finalized ``main_grad``, the
  grad norm and the parameters after 2 AdamW steps against the whole model without a pipeline in
  one process (at the same TP); random loss masks, so the CP ranks hold different token counts
  and the loss normalisation has to use the count of all of them. Tolerances follow the suite's
  rule (``exactness.py``); one case in float64, where it is 1e-12 or tighter, so no fp32
  rounding can hide an error.
"""

from __future__ import annotations

import dataclasses
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
from exactness import check, check_worst, tolerance, training_tolerance
from runtime_case import MICRO_BATCH, make_batches, rel_error

from megatron_pp_ext.attention.cp_layout import (
    local_positions,
    piece_length,
    pieces_of,
    take_local,
    to_gathered_order,
    to_global_order,
)

STEPS = 2

# ---- the layout, in one process ----------------------------------------------------------------


def test_each_rank_holds_an_early_and_a_late_piece() -> None:
    assert [pieces_of(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(0, 8, 2, 0) == [0, 1, 6, 7]
    assert local_positions(16, 8, 2, 1) == [18, 19, 20, 21]  # a slice starting at 16
    with pytest.raises(ValueError, match="multiple of 6"):
        piece_length(8, 3)
    with pytest.raises(ValueError, match="out of range"):
        pieces_of(2, 2)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_gathered_runs_come_back_in_sequence_order(cp: int) -> None:
    seq = torch.arange(2 * cp * 3 * 5).reshape(2 * cp * 3, 5)  # 3 tokens a piece, dim 0
    local = [take_local(seq, 0, cp, r) for r in range(cp)]
    for r, part in enumerate(local):
        assert part[:, 0].div(5, rounding_mode="floor").tolist() == local_positions(0, len(seq), cp, r)
    gathered = torch.cat(local)
    assert torch.equal(to_global_order(gathered, 0, cp), seq)
    assert torch.equal(to_gathered_order(seq, 0, cp), gathered)


class _FakeGroup:
    """What the rotary embedding reads of a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(("cp", "offset"), [(2, 0), (2, 24), (4, 8)])
def test_rotary_positions_are_the_global_positions_of_the_ranks_tokens(cp: int, offset: int) -> None:
    from megatron_pp_ext.megatron.model import DeviceRotaryEmbedding

    rotary = DeviceRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    length = 4 * cp
    whole = rotary.get_emb(offset + length)  # positions 0 .. offset + length - 1
    for rank in range(cp):
        got = rotary(length, offset, cp_group=_FakeGroup(cp, rank))
        want = whole[local_positions(offset, length, cp, rank)]
        assert torch.equal(got, want)
    assert torch.equal(rotary(length, offset), whole[offset:])  # no CP group: every position


# ---- the CP attention on 2 processes -----------------------------------------------------------

ATTENTION_CASES = [
    # (backend, slice lengths, delegate the oldest slice of slices >= 1)
    ("math", (16,), False),  # an unsliced sequence: one slice
    ("math", (8, 16, 4, 12), False),  # uneven slices
    ("math", (8, 16, 4, 12), True),
    ("torch_flash", (8, 16, 4, 12), True),
    ("sdpa", (4, 12, 8), False),
]


def attention_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_pp_ext.attention import LayerCache
    from megatron_pp_ext.attention.backends import choose_backend
    from megatron_pp_ext.attention.cp_attention import context_parallel_attention
    from megatron_pp_ext.attention.math_kernel import MathKernel
    from megatron_pp_ext.attention.remote import InProcessRemote

    class Counter:
        current_delegation = None
        local = remote = 0

        def count_pairs(self, local: int, remote: int) -> None:
            self.local += local
            self.remote += remote

    def bhsd(x: torch.Tensor) -> torch.Tensor:
        return x.permute(1, 2, 0, 3)

    results = {}
    for backend_name, lengths, delegate in ATTENTION_CASES:
        generator = torch.Generator().manual_seed(len(results))
        seq, batch, heads, kv_heads, dim, scale = sum(lengths), 2, 4, 2, 8, 0.3
        q, dout = (
            torch.randn(seq, batch, heads, dim, generator=generator, dtype=torch.float64) for _ in "qo"
        )
        k, v = (
            torch.randn(seq, batch, kv_heads, dim, generator=generator, dtype=torch.float64) for _ in "kv"
        )
        # the reference: plain causal attention over the whole sequence, fp64
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want, _ = MathKernel().forward(*(bhsd(t) for t in leaves), True, scale)
        want = want.permute(2, 0, 1, 3)
        want.backward(dout)
        # this rank's pieces of every slice, fp32
        backend = choose_backend(backend_name, bhsd(q).float(), bhsd(k).float())
        cache, counter = LayerCache("test"), Counter()
        starts = [sum(lengths[:j]) for j in range(len(lengths) + 1)]

        def mine(x: torch.Tensor, j: int, starts: list[int] = starts) -> torch.Tensor:
            """This rank's pieces of slice j of a whole-sequence tensor."""
            return take_local(x[starts[j] : starts[j + 1]], 0, world, rank)

        inputs, outputs = [], []
        for j in range(len(lengths)):
            counter.current_delegation = InProcessRemote(1) if delegate and j else None
            qkv = [mine(t, j).float().requires_grad_() for t in (q, k, v)]
            outputs.append(
                context_parallel_attention(*qkv, cache, j, scale, backend, dist.group.WORLD, counter)
            )
            inputs.append(qkv)
        for j in reversed(range(len(lengths))):  # each slice's backward on its own, last first
            counter.current_delegation = InProcessRemote(1) if delegate and j else None
            outputs[j].backward(mine(dout, j).float())
        errors = []
        for j, (qj, kj, vj) in enumerate(inputs):
            errors.append(rel_error(outputs[j].detach(), mine(want.detach(), j)))
            for got, leaf in ((qj, leaves[0]), (kj, leaves[1]), (vj, leaves[2])):
                errors.append(rel_error(got.grad, mine(leaf.grad, j)))
        finished = cache.finished
        # a forward-only pass (evaluation): the same outputs, without autograd
        counter.current_delegation = None
        cache = LayerCache("forward only")
        with torch.no_grad():
            for j, (qj, kj, vj) in enumerate(inputs):
                out = context_parallel_attention(qj, kj, vj, cache, j, scale, backend, dist.group.WORLD)
                errors.append(rel_error(out, mine(want.detach(), j)))
        results[(backend_name, lengths, delegate)] = {
            "error": max(errors),
            "backend": backend.name,
            "finished": finished,
            "pairs": (counter.local, counter.remote),
        }
    return results


@pytest.fixture(scope="module")
def attention_results() -> list[dict]:
    return check_ok(run_ranks(attention_worker, 2, timeout=300))


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}-{len(c[1])}slices-{c[2]}")
def test_cp_attention_equals_causal_attention_over_the_whole_sequence(attention_results, case) -> None:
    backend, lengths, delegate = case
    for rank, results in enumerate(attention_results):
        result = results[case]
        assert result["backend"] == backend
        # attention over every key of the sequence, then its backward sums over them again
        limit = tolerance("float32", 2 * sum(lengths))
        check(result["error"], limit, f"rank {rank}: attention output or gradient")
        assert result["finished"], "the K/V cache was not emptied by the backward"
    # balanced: every rank computes the same number of query-key pairs (Megatron's layout)
    pairs = [sum(results[case]["pairs"]) for results in attention_results]
    assert pairs[0] == pairs[1] > 0
    assert (attention_results[0][case]["pairs"][1] > 0) == delegate


# ---- CP2 x PP2 training steps ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    schedule: str
    microbatches: int = 2
    slices: int = 1
    seq_length: int = 32
    redistribution: float = 0.0
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        parts = [self.schedule, f"k{self.slices}", f"s{self.seq_length}", self.dtype]
        parts += ["redistribution"] if self.redistribution else []
        parts += ["per-token"] if self.extra.get("calculate_per_token_loss") else []
        return "-".join(parts)


CP2_PP2 = [
    Case("seq1f1b", slices=4, seq_length=48),  # balanced slices of 16, 8, 16, 8 tokens
    Case("seq1f1b", slices=4, seq_length=48, dtype="float64"),  # no rounding to hide an error in
    Case("1f1b", microbatches=3, seq_length=16),  # unsliced: CP attention with one slice
    Case("zb-h1", slices=2),  # the B/W split: the reduce-scatter runs in B
    Case("slimpipe", slices=4, redistribution=0.5),
    Case("seq1f1b", slices=2, extra={"calculate_per_token_loss": True}),
]
# TP2 (sequence parallel) x CP2, one pipeline stage: a rank's quarter of each slice
TP2_SP_CP2 = [Case("seq1f1b", slices=2), Case("1f1b", seq_length=16)]
# CP2 x DP2, one stage: DDP reduces over DP x CP (overlapped, distributed-optimizer layout)
CP2_DP2 = [Case("seq1f1b", slices=2)]


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    sequence_parallel: bool = False
    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False

    @property
    def dp(self) -> int:
        return 4 // (self.tp * self.cp * self.pp)


# 4 processes each: name -> (layout, cases)
LAUNCHES = {
    "cp2-pp2": (Layout(tp=1, cp=2, pp=2), CP2_PP2),
    "tp2-sp-cp2": (Layout(tp=2, cp=2, pp=1, sequence_parallel=True), TP2_SP_CP2),
    "cp2-dp2": (Layout(tp=1, cp=2, pp=1, overlap_grad_reduce=True, distributed_optimizer=True), CP2_DP2),
}


def _model(case: Case, sequence_parallel: bool):
    from megatron_pp_ext.megatron.model import ModelConfig

    return ModelConfig(
        num_layers=5,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,  # GQA
        ffn_hidden_size=64,
        vocab_size=64,
        seq_length=case.seq_length,
        dtype=case.dtype,
        extra={**case.extra, "sequence_parallel": sequence_parallel},
    )


def _reference_losses(reference, batches: list[dict], per_token: bool) -> tuple[list[list[float]], float]:
    """Loss sums and counts per microbatch of the one-process model (backward done), and the
    token count that finalize_model_grads divides by with ``calculate_per_token_loss``."""
    from megatron_pp_ext.megatron.steps import forward_step
    from megatron_pp_ext.runtime import reference_step

    reports = reference_step(reference, forward_step, iter(batches), len(batches))
    rows = [report["lm loss"].tolist() for report in reports]
    tokens = sum(row[1] for row in rows)
    if per_token:
        for param in reference.parameters():
            param.grad /= tokens
    return rows, tokens


def cp_worker(rank: int, world: int, layout: Layout, cases: list[Case]) -> dict:
    from megatron.core import parallel_state

    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.ddp import zero_grad_buffers
    from megatron_pp_ext.megatron.hook import PipelineOptions
    from megatron_pp_ext.megatron.model import build_reference, init_parallel_state
    from megatron_pp_ext.megatron.optimizer import OptimizerSettings, gather_grad_shards
    from megatron_pp_ext.megatron.steps import forward_step, on_this_cp_rank
    from megatron_pp_ext.runtime import PipeComm, forward_backward

    cpu_shim.install()
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    init_parallel_state(pp, tp, cp)
    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = parallel_state.get_context_parallel_rank()
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    pipeline = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    comm = PipeComm(pipeline, timeout_s=60)
    settings = OptimizerSettings(lr=1e-3, clip_grad=0.0)
    report: dict = {"cp_rank": cp_rank, "dp_rank": dp_rank, "dp": dp}
    for case in cases:
        entry: dict = {}
        report[case.name] = entry
        try:
            options = PipelineOptions(
                schedule=case.schedule, slices=case.slices, attn_redistribution=case.redistribution
            )
            schedule = options.schedule_for(pp, case.microbatches)
            model_cfg = _model(case, layout.sequence_parallel)
            torch.manual_seed(1234)
            reference = build_reference(model_cfg)  # every token in this process (at the same TP)
            pipeline = compose_pipeline(
                reference,
                model_cfg,
                schedule,
                comm,
                settings,
                layout.overlap_grad_reduce,
                layout.distributed_optimizer,
                case.redistribution,
            )
            model, runtime, optimizer, ref_optimizer = (
                pipeline.model,
                pipeline.runtime,
                pipeline.optimizer,
                pipeline.ref_optimizer,
            )
            assert all(chunk.module.config.context_parallel_size == cp for chunk in model)
            per_token = bool(case.extra.get("calculate_per_token_loss"))
            grad_errors: dict[str, float] = {}
            loss_errors: list[float] = []
            norm_errors: list[float] = []
            for step in range(STEPS):
                batches = make_batches(model_cfg, case.microbatches * dp, seed=1000 * step + 7)
                mine = [batches[i * dp + dp_rank] for i in range(case.microbatches)]  # Megatron's order
                # the model's own cut of a batch is Megatron-LM's get_batch_on_this_cp_rank: our layout
                cut = on_this_cp_rank(dict(mine[0]), model[0])
                assert torch.equal(cut["tokens"], take_local(mine[0]["tokens"], 1, cp, cp_rank))
                zero_grad_buffers(model)
                losses = forward_backward(
                    runtime,
                    schedule,
                    forward_step_func=forward_step,
                    data_iterator=[iter(mine) for _ in model],
                    model=model,
                    num_microbatches=case.microbatches,
                    seq_length=model_cfg.seq_length,
                    micro_batch_size=MICRO_BATCH,
                )
                ref_optimizer.zero_grad(set_to_none=True)
                gather_grad_shards(model)
                ref_rows, _ = _reference_losses(reference, batches, per_token)
                reduce_sequence_parallel_grads(reference)
                record_grad_errors(pipeline, grad_errors)
                if runtime.last_result.is_loss_rank:
                    # each CP rank reports its own tokens: their sums are the microbatch's
                    local = torch.stack([item["lm loss"].double() for item in losses])
                    torch.distributed.all_reduce(local, group=cp_group)
                    entry["local_counts"] = [float(item["lm loss"][1]) for item in losses]
                    for got, want in zip(local.tolist(), ref_rows[dp_rank::dp]):
                        loss_errors.append(abs(got[0] - want[0]) / abs(want[0]))
                        assert got[1] == want[1], (got, want)
                norm = optimizer.step()
                ref_norm = reference_norm(reference)
                norm_errors.append(abs(norm - ref_norm) / ref_norm)
                ref_optimizer.step()
            entry["grad_errors"] = grad_errors
            entry["loss_errors"] = loss_errors
            entry["norm_errors"] = norm_errors
            entry["param_errors"] = param_errors(pipeline)
            entry["is_loss_rank"] = runtime.last_result.is_loss_rank
            entry["sequence_share"] = runtime.sequence_share
            attention = runtime.last_result.attention
            entry["attention"] = None if attention is None else attention.totals()
        except Exception as error:
            import traceback

            entry["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    comm.close()
    report["lazy_creations"] = comm.creation.lazy  # first uses the warm-up missed
    return report


@functools.cache
def _launch(name: str) -> tuple:
    """One world of 4 processes runs every case of a layout (about 20 s on 2 cores)."""
    return tuple(check_ok(run_ranks(cp_worker, 4, *LAUNCHES[name], timeout=600)))


def _check(launch: str, case: Case) -> None:
    layout = LAUNCHES[launch][0]
    reports = _launch(launch)
    assert all(r["dp"] == layout.dp for r in reports)
    assert sorted(r["cp_rank"] for r in reports) == [0, 0, 1, 1]
    entries = [r[case.name] for r in reports]
    errors = [f"rank {rank}: {e['error']}" for rank, e in enumerate(entries) if "error" in e]
    assert not errors, "\n".join(errors)
    model = _model(case, layout.sequence_parallel)
    limit = training_tolerance(model, case.microbatches, STEPS, MICRO_BATCH, layout.dp)
    for rank, entry in enumerate(entries):
        check_worst(entry["grad_errors"], limit, f"rank {rank}: gradient of")
        check(max(entry["norm_errors"]), limit, f"rank {rank}: grad norm")
        check_worst(entry["param_errors"], limit, f"rank {rank}: after {STEPS} steps, parameter")
        share = layout.cp * (layout.tp if layout.sequence_parallel else 1)
        assert entry["sequence_share"] == share  # what a message carries of a slice
    loss_ranks = [(r, e) for r, e in zip(reports, entries) if e["is_loss_rank"]]
    assert len(loss_ranks) == layout.tp * layout.cp * layout.dp  # the last stage of every pipeline
    # the loss itself goes through Megatron's cross-entropy in float32, in either dtype
    in_float32 = dataclasses.replace(model, dtype="float32")
    loss_limit = training_tolerance(in_float32, case.microbatches, STEPS, MICRO_BATCH, layout.dp)
    for rank, (_, entry) in enumerate(loss_ranks):
        assert entry["loss_errors"], f"loss rank {rank} reported no loss"
        check(max(entry["loss_errors"]), loss_limit, f"loss rank {rank}: loss")
    # random loss masks: the CP ranks hold different token counts (so the normalisation is tested)
    counts = {r["cp_rank"]: e["local_counts"] for r, e in loss_ranks if r["dp_rank"] == 0}
    assert counts[0] != counts[1]
    if case.redistribution:
        assert sum(e["attention"][2] for e in entries) > 0, "redistribution moved no attention"


@pytest.mark.parametrize("case", CP2_PP2, ids=lambda c: c.name)
def test_cp2_pp2_equals_one_process(case: Case) -> None:
    _check("cp2-pp2", case)


@pytest.mark.parametrize("case", TP2_SP_CP2, ids=lambda c: c.name)
def test_tp2_sp_cp2_equals_the_unpipelined_model_at_tp2(case: Case) -> None:
    _check("tp2-sp-cp2", case)


@pytest.mark.parametrize("case", CP2_DP2, ids=lambda c: c.name)
def test_cp2_dp2_equals_one_process(case: Case) -> None:
    _check("cp2-dp2", case)


def test_cp_needs_slices_that_cut_into_2cp_pieces() -> None:
    from types import SimpleNamespace

    from megatron_pp_ext.runtime.context_parallel import check_cp_slices

    config = SimpleNamespace(context_parallel_size=2, sequence_parallel=False, tensor_model_parallel_size=1)
    check_cp_slices([8, 4, 12], config)
    with pytest.raises(ValueError, match="slice 1 .* not a multiple of 4"):
        check_cp_slices([8, 6], config)
    sp = SimpleNamespace(context_parallel_size=2, sequence_parallel=True, tensor_model_parallel_size=4)
    check_cp_slices([16], sp)
    with pytest.raises(ValueError, match="sequence parallelism"):
        check_cp_slices([12], sp)  # 6 tokens a CP rank cannot be cut over TP 4


def test_hook_refuses_slices_that_context_parallelism_cannot_cut() -> None:
    import argparse

    from megatron_pp_ext.megatron import hook

    args = argparse.Namespace(
        pp_schedule="slimpipe",
        pp_seq_slices=16,
        pipeline_model_parallel_size=4,
        global_batch_size=16,
        micro_batch_size=2,
        data_parallel_size=1,
        seq_length=128,  # slices of 8 tokens
        num_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        context_parallel_size=8,
        sequence_parallel=False,
        tensor_model_parallel_size=1,
    )
    try:
        with pytest.raises(hook.OptionError, match="--pp-seq-slices: slice 0 .* not a multiple of 16"):
            hook.install(args)
        args.context_parallel_size = 4  # 8 tokens: 8 pieces of 1
        hook.install(args)
    finally:
        hook.uninstall()


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_the_warm_up_creates_every_communicator_the_steps_use(launch) -> None:
    """Under NCCL a communicator first used inside a step would be created there, blocking until
    its members arrive (runtime/creation.py): the runtime's warm-up leaves none for the step."""
    for rank, report in enumerate(_launch(launch)):
        assert report["lazy_creations"] == [], f"rank {rank}: {report['lazy_creations'][:3]}"
