"""A peer that dies or never answers: every waiting rank raises an error naming its rank, the op
and the peer, within the configured timeout, instead of hanging."""

from __future__ import annotations

import os
import time

import torch
from dist_utils import RankFailure, run_ranks
from runtime_case import MICRO_BATCH, forward_step, make_batches, tiny_model

TIMEOUT_S = 2.0


def fault_worker(rank: int, world: int, culprit: int, mode: str) -> dict:
    from megatron_pp_ext.megatron.model import build_stage, init_parallel_state, split_layers
    from megatron_pp_ext.runtime.executor import PipelineRuntime
    from megatron_pp_ext.runtime.p2p import PeerError, PipeComm
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    model = tiny_model(world)
    layers = split_layers(model.num_layers, world)
    chunk = build_stage(model, rank, layers)
    comm = PipeComm(timeout_s=TIMEOUT_S)
    torch.distributed.barrier()  # everyone has its p2p groups: the fault happens inside the step
    if rank == culprit:
        if mode == "die":
            os._exit(3)
        time.sleep(TIMEOUT_S * 1.75)  # "hang": never takes part in the step
        return {"culprit": True}
    runtime = PipelineRuntime(
        [chunk], comm, (model.seq_length, MICRO_BATCH, model.hidden_size), torch.float32
    )
    start = time.monotonic()
    try:
        runtime.step(generate("1f1b", world, 3), forward_step, iter(make_batches(model, 3)))
    except PeerError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def _check(results: list, world: int, culprit: int) -> None:
    for rank, result in enumerate(results):
        if rank == culprit:
            continue
        assert not isinstance(result, RankFailure), result
        message = result["error"]
        assert message is not None, f"rank {rank} finished a step whose peer was gone"
        assert message.startswith(f"rank {rank}: "), message
        assert any(kind in message for kind in ("RECV_F", "RECV_B", "SEND_F", "SEND_B")), message
        assert "from rank" in message or "to rank" in message, message
        # well short of a hang (run_ranks gives up at 60 s); slack for a loaded machine
        assert result["elapsed"] < TIMEOUT_S * 2 + 8.0, result


def test_peer_dies() -> None:
    results = run_ranks(fault_worker, 2, 1, "die", timeout=60)
    _check(results, 2, culprit=1)
    assert "rank 1" in results[0]["error"]


def test_peer_never_answers_every_waiting_rank_fails() -> None:
    # rank 2 hangs: rank 1 waits on it and times out, rank 0 waits on rank 1 and fails too
    results = run_ranks(fault_worker, 3, 2, "hang", timeout=60)
    _check(results, 3, culprit=2)
    assert "rank 2" in results[1]["error"]
    assert "rank 1" in results[0]["error"].split(":", 1)[1]
