"""A peer that dies or never answers: every waiting rank raises an error naming its rank, the op
and the peer, within the configured timeout, instead of hanging."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
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
        # the op it waited at, or (before the first step) the communicator it waited to create
        assert any(
            kind in message for kind in ("RECV_F", "RECV_B", "SEND_F", "SEND_B", "communicator p2p-")
        ), message
        assert any(words in message for words in ("from rank", "to rank", "for rank")), message
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


# ---- the same faults in `train`: mid-step, with checkpoints on disk ---------------------------

TRAIN_TIMEOUT_S = 4.0
FAULT_ITERATION = 3
TRAIN_ARGS = [
    "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1", "--microbatches", "4",
    "--data", str(Path(__file__).resolve().parents[1] / "README.md"), "--pp", "2",
    "--pp-schedule", "1f1b", "--train-iters", "4", "--save-interval", "2",
    "--pp-p2p-timeout", str(TRAIN_TIMEOUT_S),
]  # fmt: skip


class Fault:
    """Megatron's forward step, except that pipeline rank ``culprit`` dies or stops answering at
    its second forward of iteration ``FAULT_ITERATION`` (mid-step); ``started`` records this
    rank's last forward before it failed (a peer of a rank that died right after a send may never
    get that send, and so never begin the iteration)."""

    def __init__(self, rank: int, culprit: int, mode: str, microbatches: int) -> None:
        self.rank, self.culprit, self.mode = rank, culprit, mode
        self.first = (FAULT_ITERATION - 1) * microbatches + 1
        self.calls = 0
        self.started = time.monotonic()

    def __call__(self, data_iterator, model):
        from megatron_pp_ext.megatron.steps import forward_step

        self.calls += 1
        self.started = time.monotonic()
        if self.rank == self.culprit and self.calls == self.first + 1:
            if self.mode == "die":
                os._exit(3)
            time.sleep(TRAIN_TIMEOUT_S * 2.5)  # stops answering until every peer has given up
            os._exit(4)
        return forward_step(data_iterator, model)


def train_fault_worker(rank: int, world: int, save: str, culprit: int, mode: str) -> dict:
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.training.worker import fatal_errors, fatal_message, train_loop

    settings = settings_from_argv([*TRAIN_ARGS, "--save", save], world)
    fault = Fault(rank, culprit, mode, settings.microbatches)
    try:
        train_loop(rank, settings, torch.device("cpu"), fault)
    except fatal_errors() as error:
        return {"error": fatal_message(settings, error), "elapsed": time.monotonic() - fault.started}
    return {"error": None, "elapsed": time.monotonic() - fault.started}


def resume_worker(rank: int, world: int, root: str) -> dict:
    """The uninterrupted run, and the runs resumed from the checkpoints the faults left."""
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.training.worker import train_loop

    cpu = torch.device("cpu")
    return {
        name: train_loop(rank, settings_from_argv([*TRAIN_ARGS, *flags], world), cpu)
        for name, flags in (
            ("straight", ["--save", f"{root}/straight"]),
            ("after-die", ["--load", f"{root}/die", "--save", f"{root}/die"]),  # the same command + --load
            ("after-hang", ["--load", f"{root}/hang", "--save", f"{root}/hang"]),
        )
    }


def _check_train_fault(result: dict, rank: int, culprit: int, save: Path) -> None:
    assert not isinstance(result, RankFailure), result
    message = result["error"]
    assert message is not None, f"rank {rank} finished a step whose peer was gone"
    assert message.startswith(f"rank {rank}: "), message  # this rank, the op and the peer
    assert any(kind in message for kind in ("RECV_F", "RECV_B", "SEND_F", "SEND_B")), message
    assert f"rank {culprit}" in message, message
    assert f"the last checkpoint is {save / 'iter_0000002'}" in message, message
    assert f"--load {save}" in message, message
    assert result["elapsed"] < TRAIN_TIMEOUT_S * 2 + 8.0, result


@pytest.mark.slow
def test_train_survives_a_dead_and_a_hung_peer_and_resumes_from_the_checkpoint(tmp_path) -> None:
    """In `train`, mid-step at iteration 3: rank 0 dies (rank 1 must fail naming it), then in
    another job rank 1 stops answering (rank 0 must fail within the timeout). Each leaves the
    iteration-2 checkpoint, from which `--load` continues with the uninterrupted run's losses."""
    from megatron_pp_ext.megatron.checkpoint import read_tracker

    results = run_ranks(train_fault_worker, 2, str(tmp_path / "die"), 0, "die", timeout=120)
    _check_train_fault(results[1], 1, 0, tmp_path / "die")
    results = run_ranks(train_fault_worker, 2, str(tmp_path / "hang"), 1, "hang", timeout=120)
    _check_train_fault(results[0], 0, 1, tmp_path / "hang")
    assert "did not complete after" in results[0]["error"]
    assert read_tracker(tmp_path / "die") == read_tracker(tmp_path / "hang") == 2

    runs = run_ranks(resume_worker, 2, str(tmp_path), timeout=300)
    for result in runs:
        assert not isinstance(result, RankFailure), f"{result.error}\n{result.traceback}"

    def losses(name: str) -> list[float]:  # from whichever rank reports them
        return [
            next(r["loss"] for r in rows if r["loss"] is not None)
            for rows in zip(runs[0][name], runs[1][name])
        ]

    assert [row["iteration"] for row in runs[0]["after-die"]] == [3, 4]
    assert losses("after-die") == losses("after-hang") == losses("straight")[2:]  # bitwise


# ---- post-validation: a rank that waits for the global check at its gate ----------------------


def post_validation_fault_worker(rank: int, world: int, save: str) -> dict:
    """ZB-H2 with post-validation (chain 0 > 1): at iteration ``FAULT_ITERATION`` rank 1 dies
    before its optimizer step, so it never joins that step's global all-reduce. Rank 0 stepped on
    its partial state and went on; it waits for the global check at its next step's gate."""
    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.megatron import optimizer
    from megatron_pp_ext.training.worker import fatal_errors, fatal_message, train_loop

    argv = [*TRAIN_ARGS, "--pp-schedule", "zb-h2", "--pp-post-validation", "--clip-grad", "100"]
    argv += ["--pp-post-validation-chain", "auto"]  # the schedule's 0 > 1, not a timed order
    settings = settings_from_argv([*argv, "--save", save], world)
    step = optimizer.MainGradOptimizer.step
    calls = []

    def dying_step(self) -> float:
        calls.append(time.monotonic())
        if rank == 1 and len(calls) == FAULT_ITERATION:
            os._exit(3)
        return step(self)

    optimizer.MainGradOptimizer.step = dying_step  # this worker process only
    try:
        train_loop(rank, settings, torch.device("cpu"))
    except fatal_errors() as error:
        return {"error": fatal_message(settings, error), "elapsed": time.monotonic() - calls[-1]}
    return {"error": None, "steps": len(calls)}


@pytest.mark.slow
def test_post_validation_gate_names_a_dead_peer(tmp_path) -> None:
    """Rank 0, which went on past its step, does not hang at its gate: it fails within the
    timeout naming what found rank 1 gone, and the checkpoint of iteration 2 is the one to resume
    from."""
    results = run_ranks(post_validation_fault_worker, 2, str(tmp_path), timeout=120)
    result = results[0]
    assert not isinstance(result, RankFailure), result
    message = result["error"]
    assert message is not None, "rank 0 finished a step whose global check never came"
    # what first found rank 1 gone: a send of the next iteration's forwards (before the gate), the
    # partial state's send, or the global all-reduce rank 0 waits for at its gate
    assert message.startswith("rank 0: "), message
    assert "to rank 1 " in message or "ranks [0, 1]) failed" in message, message
    assert f"the last checkpoint is {tmp_path / 'iter_0000002'}" in message, message
    assert result["elapsed"] < TRAIN_TIMEOUT_S * 2 + 8.0, result
