"""Ranks that resolved different schedules (another plugin version or other flags on one node)
are named at the warm-up, before the step: each pair's handshake carries the schedule's message
digest (``Schedule.comm_digest``) both ways, and a mismatch raises on both ends instead of a hang
at the first message where the ranks differ."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import check_ok, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches, tiny_model

from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.lowering import lower

pytestmark = pytest.mark.slow


def test_the_digest_covers_messages_not_local_copies() -> None:
    """Offload's copies are a rank's own affair (its k is measured per rank): they leave the digest
    alone; a different microbatch count or schedule changes it."""
    from megatron_pp_ext.schedule.offload import OffloadPolicy, apply_offload

    base = lower(generate("1f1b", 2, 4))
    offloaded = apply_offload(base, OffloadPolicy("full"))
    assert offloaded.ranks != base.ranks and offloaded.comm_digest() == base.comm_digest()
    assert lower(generate("1f1b", 2, 5)).comm_digest() != base.comm_digest()
    assert lower(generate("zb-h1", 2, 4)).comm_digest() != base.comm_digest()


def agreement_worker(rank: int, world: int) -> dict:
    from megatron_pp_ext.megatron.model import build_chunks_from, build_reference, init_parallel_state
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.runtime.creation import ScheduleMismatch

    init_parallel_state(world)
    out: dict = {}
    agreeing, differing, runtime_comm = (PipeComm(timeout_s=20.0) for _ in range(3))
    # the handshake alone: equal digests pass, different ones raise on both ends
    agreeing.creation.warm_up([agreeing.creation.pair("F", 0, 1)], digest=7)
    try:
        differing.creation.warm_up([differing.creation.pair("F", 0, 1)], digest=7 + rank)
    except ScheduleMismatch as error:
        out["handshake"] = str(error)
    # the runtime: rank 1 resolved 4 microbatches where rank 0 resolved 3
    model = dataclasses.replace(tiny_model(num_layers=2), seq_length=16)
    torch.manual_seed(1)
    schedule = generate("1f1b", world, 3 + rank)
    chunks, _ = build_chunks_from(build_reference(model), model, schedule.placement, rank)
    batches = make_batches(model, 4, seed=2)
    runtime = PipelineRuntime(chunks, runtime_comm, (16, MICRO_BATCH, model.hidden_size), model.torch_dtype)
    try:
        runtime.step(schedule, forward_step, [iter(batches)])
    except ScheduleMismatch as error:
        out["runtime"] = str(error)
    for comm in (agreeing, differing, runtime_comm):
        comm.abandon()
        comm.close()
    return out


def test_ranks_with_different_schedules_are_named_at_the_warm_up() -> None:
    results = check_ok(run_ranks(agreement_worker, 2, timeout=120))
    for rank, out in enumerate(results):
        peer = 1 - rank
        for where in ("handshake", "runtime"):
            message = out.get(where)
            assert message is not None, (rank, where, out)
            assert message.startswith(f"rank {rank}: pipeline rank {peer} resolved a different schedule"), (
                message
            )
            assert "same megatron_pp_ext" in message
