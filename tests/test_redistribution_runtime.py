"""SlimPipe's attention workload redistribution on real ranks.

In one process: sliced attention that hands its oldest K/V slices to a (here in-process) partner
equals plain causal attention in output and every gradient, and refuses autograd-only backends. On
gloo processes: SlimPipe steps with ``attn_redistribution`` on give the loss and ALL gradients of
the unsliced, unpipelined reference (fp32, within the suite's rule ``exactness.py``; the tiny model
has GQA, 4 heads over 2 KV heads), over two steps in a row (each light op serves its partner on
its rank's main thread); what one rank hands away is exactly what its partners served; per lock-step slot the
attention work across ranks is more even than without; the Megatron hook takes the flag; a partner
that fails is named, and the rank waiting on it names the op and the partner.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time

import pytest
import torch
from cli_runner import run_cli
from dist_utils import RankFailure, check_ok, run_ranks
from exactness import check, step_terms, tolerance, training_tolerance
from runtime_case import MICRO_BATCH, forward_step, loss_values, make_batches, rel_error, tiny_model
from test_sliced_attention import TinyAttention, reference_layer

from megatron_pp_ext.attention import SliceContext, attach_slice_context
from megatron_pp_ext.attention.remote import InProcessRemote

SEQ = 128
CAP = 0.5
STEPS = 2
# pipeline size -> (microbatches, slices, caps run): p=4 also runs without, for the balance test
CASES = {2: (3, 4, (CAP,)), 3: (4, 8, (CAP,)), 4: (5, 8, (0.0, CAP))}


# ---- one process: the attention side -------------------------------------------------------------
@pytest.mark.parametrize("backend", ["math", "torch_flash", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_delegated_oldest_slices_give_full_attention_and_gradients(backend, dtype, seed) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 6) for _ in range(rng.randint(2, 5))]
    torch.manual_seed(seed)
    seq, hidden, batch = sum(lengths), 5, 2
    layer = TinyAttention(hidden, 4, 2, 4, backend, dtype)  # GQA
    ctx = SliceContext(lengths, seq_length=seq)
    attach_slice_context(layer, ctx)
    ctx.delegating = True
    x, dy = torch.randn(seq, batch, hidden, dtype=dtype), torch.randn(seq, batch, hidden, dtype=dtype)
    outs, leaves, handed = {}, {}, 0
    for j in range(len(lengths)):  # forward in order, each slice delegating a random count
        start, end = ctx.slice_bounds(j, 0)
        leaves[j] = x[start:end].detach().requires_grad_()
        ctx.current_delegation = InProcessRemote(rng.randint(0, j))
        handed += ctx.current_delegation.oldest_slices
        with ctx.running(0, j):
            outs[j] = layer(leaves[j], torch.arange(start, end))
    for j in reversed(range(len(lengths))):  # backward in reverse, delegating independently
        start, end = ctx.slice_bounds(j, 0)
        ctx.current_delegation = InProcessRemote(rng.randint(0, j))
        handed += ctx.current_delegation.oldest_slices
        torch.autograd.backward(outs[j], dy[start:end])
    ctx.current_delegation = None
    assert ctx.cached_microbatches() == []
    weight_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    whole = x.clone().requires_grad_()
    want = reference_layer(layer, whole)
    torch.autograd.backward(want, dy)
    # one layer: weight gradients sum over every token; a row contracts over keys or 4 heads of 4
    tol = tolerance(dtype, step_terms(seq * batch, 1, max(seq, 16)))
    check(rel_error(torch.cat([outs[j] for j in range(len(lengths))]), want), tol, "output")
    check(rel_error(torch.cat([leaves[j].grad for j in range(len(lengths))]), whole.grad), tol, "input grad")
    for got, param in zip(weight_grads, layer.parameters()):
        check(rel_error(got, param.grad), tol, "weight grad")
    # every query-key pair counted once per pass, here or handed away: S(S+1)/2 per pass
    assert ctx.pairs_local + ctx.pairs_remote == 3 * batch * seq * (seq + 1) // 2
    assert (ctx.pairs_remote > 0) == (handed > 0)


def test_autograd_backends_refuse_redistribution_naming_the_flag() -> None:
    layer = TinyAttention(5, 4, 2, 4, "sdpa", torch.float32)
    ctx = SliceContext([3, 3], seq_length=6)
    attach_slice_context(layer, ctx)
    ctx.delegating = True
    with ctx.running(0, 0), pytest.raises(ValueError, match="--pp-attn-redistribution"):
        layer(torch.randn(3, 1, 5), torch.arange(3))


# ---- gloo processes ------------------------------------------------------------------------------
def model_config(world: int):
    return dataclasses.replace(tiny_model(num_layers=2 * world + 1), seq_length=SEQ)


def runtime_worker(rank: int, world: int) -> dict:
    from megatron_pp_ext.megatron.model import build_chunks_from, build_reference, init_parallel_state
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.runtime.reference import reference_step
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    microbatches, slices, caps = CASES[world]
    model_cfg = model_config(world)
    batches = make_batches(model_cfg, microbatches, seed=7)
    torch.manual_seed(1234)
    reference = build_reference(model_cfg)
    ref_outputs = reference_step(reference, forward_step, iter(batches), microbatches)
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    ref_losses = loss_values(ref_outputs)
    comm = PipeComm(timeout_s=60)
    schedule = generate("slimpipe", world, microbatches, slices=slices)
    report: dict = {}
    for cap in caps:
        chunks, names = build_chunks_from(reference, model_cfg, schedule.placement, rank, sliced=True)
        runtime = PipelineRuntime(
            chunks,
            comm,
            (SEQ, MICRO_BATCH, model_cfg.hidden_size),
            model_cfg.torch_dtype,
            attn_redistribution=cap,
        )
        grad_errors, seconds = [], []
        for _ in range(STEPS):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            start = time.perf_counter()
            result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
            seconds.append(time.perf_counter() - start)
            params = [p for c in chunks for p in c.parameters()]
            assert all(p.grad is not None for p in params)
            grad_errors.append(max(rel_error(p.grad, ref_grads[names[id(p)]]) for p in params))
        loss_error = None
        if result.is_loss_rank:
            losses = loss_values(result.losses)
            assert len(losses) == microbatches
            loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        plan = runtime.redistribution.plan(schedule, [SEQ // slices] * slices)
        report[cap] = {
            "grad_error": max(grad_errors),
            "loss_error": loss_error,
            "counts": result.attention,
            "plan": {op: (d.partner, d.oldest_slices) for (r, op), d in plan.items() if r == rank},
            "seconds": seconds[-1],
        }
    if world == 2:
        report["hook"] = hook_step(rank, world, reference, ref_grads, ref_losses, batches, model_cfg)
    report["lazy_creations"] = comm.creation.lazy  # first uses the warm-up missed
    return report


def hook_step(rank, world, reference, ref_grads, ref_losses, batches, model_cfg) -> dict:
    """A Megatron-LM-style step and a forward-only pass through the hook with the flag on."""
    from megatron.core import pipeline_parallel

    from megatron_pp_ext.megatron import hook
    from megatron_pp_ext.megatron.model import build_chunks_from

    installed = hook.install(
        schedule="slimpipe", slices=4, p2p_timeout=60, attn_redistribution=CAP, slice_partition="uniform"
    )
    try:
        schedule = installed.schedule(world, len(batches))
        model, names = build_chunks_from(reference, model_cfg, schedule.placement, rank, sliced=True)
        arguments = dict(
            forward_step_func=forward_step,
            model=model,
            num_microbatches=len(batches),
            seq_length=model_cfg.seq_length,
            micro_batch_size=MICRO_BATCH,
        )
        losses = pipeline_parallel.get_forward_backward_func()(
            data_iterator=[iter(batches) for _ in model], forward_only=False, **arguments
        )
        delegated = sum(installed.last_result.attention.delegated.values())
        evaluated = pipeline_parallel.get_forward_backward_func()(
            data_iterator=[iter(batches) for _ in model], forward_only=True, **arguments
        )
        relative = lambda got: max(abs(a - b) / abs(b) for a, b in zip(loss_values(got), ref_losses))
        return {
            "grad_error": max(
                rel_error(p.grad, ref_grads[names[id(p)]]) for c in model for p in c.parameters()
            ),
            "loss_error": relative(losses) if losses else None,
            "eval_error": relative(evaluated) if evaluated else None,
            "delegated": delegated,
        }
    finally:
        hook.uninstall()


@functools.cache
def _launch(world: int) -> tuple:
    return tuple(check_ok(run_ranks(runtime_worker, world, timeout=300)))


def _check_exact(world: int, cap: float) -> None:
    reports = [r[cap] for r in _launch(world)]
    limit = training_tolerance(model_config(world), CASES[world][0], 1)  # each step from the same weights
    for rank, r in enumerate(reports):
        check(r["grad_error"], limit, f"rank {rank}: gradient")
    loss_errors = [r["loss_error"] for r in reports if r["loss_error"] is not None]
    assert len(loss_errors) == 1, loss_errors
    check(loss_errors[0], limit, "loss")
    if cap:
        assert any(r["plan"] for r in reports), "the plan moved nothing: the test tests nothing"
    # what each rank handed to a partner is exactly what that partner served for it
    for source, r in enumerate(reports):
        for partner in range(world):
            handed = sum(
                n for op, n in r["counts"].delegated.items() if r["plan"].get(op, (None,))[0] == partner
            )
            assert reports[partner]["counts"].served.get(source, 0) == handed, (source, partner)


def test_redistribution_exact_p2_k4() -> None:
    _check_exact(2, CAP)


@pytest.mark.slow
def test_redistribution_exact_p3_k8() -> None:
    _check_exact(3, CAP)


@pytest.mark.slow
def test_redistribution_exact_p4_k8() -> None:
    _check_exact(4, 0.0)
    _check_exact(4, CAP)


def slot_balance(world: int, cap: float) -> tuple[float, float]:
    """Attention work per rank per lock-step slot, as the ranks counted it (own work, plus what
    a partner served in that slot): (sum over slots of the busiest rank / of the mean rank,
    mean over slots where every rank attends of busiest / least busy)."""
    from megatron_pp_ext.schedule.generators import generate
    from megatron_pp_ext.schedule.redistribute import lockstep_slots

    microbatches, slices, _ = CASES[world]
    slots = lockstep_slots(generate("slimpipe", world, microbatches, slices=slices))
    reports = [r[cap] for r in _launch(world)]
    work: dict[int, list[int]] = {}
    for (rank, op), slot in slots.items():
        row = work.setdefault(slot, [0] * world)
        row[rank] += reports[rank]["counts"].own.get(op, 0)
        if op in reports[rank]["plan"]:
            row[reports[rank]["plan"][op][0]] += reports[rank]["counts"].delegated[op]
    rows = list(work.values())
    total = sum(max(row) for row in rows) / sum(sum(row) / world for row in rows)
    full = [max(row) / min(row) for row in rows if min(row) > 0]
    return total, sum(full) / len(full)


def rank_totals(world: int, cap: float) -> list[int]:
    """Attention each rank computed in the step (its own and what it served)."""
    return [sum(r[cap]["counts"].totals()[:2]) for r in _launch(world)]


@pytest.mark.slow
def test_redistribution_evens_out_the_attention_across_ranks_p4_k8() -> None:
    without, with_ = slot_balance(4, 0.0), slot_balance(4, CAP)
    assert with_[0] < without[0] - 0.05 and with_[1] < without[1] - 0.3, (without, with_)
    # over the whole step too: the stage with the extra layer hands part of it away
    before, after = rank_totals(4, 0.0), rank_totals(4, CAP)
    assert sum(after) == sum(before)  # moved, not lost or done twice
    assert max(after) / min(after) < max(before) / min(before) - 0.1, (before, after)


def test_megatron_hook_runs_redistribution_exactly_and_forward_only() -> None:
    reports = [r["hook"] for r in _launch(2)]
    limit = training_tolerance(model_config(2), CASES[2][0], 1)
    for rank, r in enumerate(reports):
        check(r["grad_error"], limit, f"rank {rank}: gradient")
    check([r["loss_error"] for r in reports if r["loss_error"] is not None][0], limit, "loss")
    check([r["eval_error"] for r in reports if r["eval_error"] is not None][0], limit, "evaluation loss")
    assert sum(r["delegated"] for r in reports) > 0


# ---- a partner that fails ------------------------------------------------------------------------
FAULT_TIMEOUT_S = 2.0


def failing_partner_worker(rank: int, world: int) -> dict:
    from megatron_pp_ext.megatron.model import build_chunks, init_parallel_state
    from megatron_pp_ext.runtime import PeerError, PipeComm, PipelineRuntime
    from megatron_pp_ext.runtime import redistribution as module
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    model_cfg = model_config(world)
    schedule = generate("slimpipe", world, 3, slices=4)
    chunks = build_chunks(model_cfg, schedule.placement, rank, sliced=True)
    runtime = PipelineRuntime(
        chunks,
        PipeComm(timeout_s=FAULT_TIMEOUT_S),
        (SEQ, MICRO_BATCH, model_cfg.hidden_size),
        torch.float32,
        attn_redistribution=CAP,
    )
    if rank == 1:

        def broken(*args, **kwargs):
            raise RuntimeError("kernel exploded")

        module.serve_forward = module.serve_backward = broken
    try:
        runtime.step(schedule, forward_step, [iter(make_batches(model_cfg, 3)) for _ in chunks])
    except PeerError as error:
        return {"error": str(error)}
    return {"error": None}


def test_a_failing_partner_is_named_and_nobody_hangs() -> None:
    results = run_ranks(failing_partner_worker, 2, timeout=60)  # a hang fails here
    assert not any(isinstance(r, RankFailure) for r in results), results
    waiting, partner = results[0]["error"], results[1]["error"]
    assert waiting and waiting.startswith("rank 0: ") and "from rank 1" in waiting, waiting
    assert "attention of" in waiting or "RECV" in waiting, waiting
    assert partner and "rank 1: the attention service for rank 0 failed" in partner, partner
    assert "kernel exploded" in partner


# ---- flags ---------------------------------------------------------------------------------------
def test_hook_flag_parses_and_bad_values_fail_early_naming_it() -> None:
    import argparse

    from megatron_pp_ext.megatron import hook

    parser = hook.add_args(argparse.ArgumentParser())
    args = parser.parse_args(["--pp-schedule", "slimpipe", "--pp-seq-slices", "4"])
    assert hook.PipelineOptions.from_args(args).attn_redistribution == 0.0
    args = parser.parse_args(
        ["--pp-schedule", "slimpipe", "--pp-seq-slices", "4", "--pp-attn-redistribution", "0.5"]
    )
    assert hook.PipelineOptions.from_args(args).attn_redistribution == 0.5
    megatron = dict(
        pipeline_model_parallel_size=4, global_batch_size=8, micro_batch_size=1, data_parallel_size=1
    )
    try:
        for cap, slices, why in [
            (1.5, 4, "between 0 and 1"),
            (-0.1, 4, "between 0 and 1"),
            (0.5, 1, "--pp-seq-slices"),
        ]:
            bad = argparse.Namespace(
                pp_schedule="slimpipe" if slices > 1 else "1f1b",
                pp_seq_slices=slices,
                pp_attn_redistribution=cap,
                **megatron,
            )
            with pytest.raises(hook.OptionError, match=f"--pp-attn-redistribution: .*{why}"):
                hook.install(bad)
    finally:
        hook.uninstall()


def test_runtime_refuses_autograd_backends_before_any_step() -> None:
    from types import SimpleNamespace

    from megatron_pp_ext.attention import SlicedCoreAttention
    from megatron_pp_ext.runtime.redistribution import Redistribution

    chunk = torch.nn.Sequential(SlicedCoreAttention(SimpleNamespace(kv_channels=4), backend="sdpa"))
    comm = SimpleNamespace(rank=0, size=2, ranks=[0, 1], timeout_s=1.0)
    with pytest.raises(ValueError, match="--pp-attn-redistribution needs attention kernels.*'sdpa'"):
        Redistribution(comm, 0.5, [chunk])
    Redistribution(comm, 0.0, [chunk])  # off: any backend
    with pytest.raises(ValueError, match="--pp-attn-redistribution must be between 0 and 1"):
        Redistribution(comm, 2.0, [chunk])


def test_train_refuses_a_bad_cap_before_starting() -> None:

    done = run_cli(["train", "--pp-attn-redistribution", "1.5"], timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "--pp-attn-redistribution" in last and "between 0 and 1" in last, last
    assert "train:" not in done.stdout


@pytest.mark.parametrize("world", [2])
def test_the_warm_up_creates_every_communicator_the_steps_use(world) -> None:
    """Under NCCL a communicator first used inside a step would be created there, blocking until
    its members arrive (runtime/creation.py): the runtime's warm-up leaves none for the step."""
    for rank, report in enumerate(_launch(world)):
        assert report["lazy_creations"] == [], f"rank {rank}: {report['lazy_creations'][:3]}"
