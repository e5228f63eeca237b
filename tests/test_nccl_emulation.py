"""NCCL's rules imposed on gloo (``--pp-emulate-nccl``): communicator creation at first use
(``runtime/creation.py``, rule 1) and in-order completion of each rank's communication
(``runtime/launch_order.py``, rule 3).

On 2 gloo processes: V-Half with vocab-2 (rank 0 starts on BCAST_IDS, rank 1 on BCAST_X),
SlimPipe interleaved with k = 2p slices (rank 0 opens the backward pair to rank 1 while rank 1
waits for a forward) and a hand-written 1F1B whose ranks receive in crossed orders. Run in the
order each rank would issue without the step's message order (every RECV right before its
consumer), created lazily, each hangs under the emulation until the deadline names the rank, the
op and what it waited for, while plain gloo runs it; warmed up, the naive order still hangs
exactly where ``schedule/nccl_check.py`` says rule 3 hangs it; in the runtime's own order every
case completes with the losses and gradients of the unpipelined model, as on plain gloo.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from cli_runner import run_cli
from dist_utils import check_ok, run_ranks
from exactness import check, training_tolerance
from runtime_case import (
    MICRO_BATCH,
    forward_step,
    loss_values,
    make_batches,
    rel_error,
    tiny_model,
    vocab_setup_from,
)

pytestmark = pytest.mark.slow

MICROBATCHES = 3
SEQ = 32  # 4 slices of 8 tokens
# (schedule, slices, vocabulary variant)
# (schedule, slices, vocabulary variant); "crossed": rank 0 sends F0:1 before it takes B0:0 while
# rank 1 sends B1:0 before it takes F1:1 (fine on gloo, a deadlock in launch order)
SCHEDULES = {
    "v-half-vocab-2": ("v-half", 1, "vocab-2"),
    "slimpipe-interleaved-k4": ("slimpipe-interleaved", 4, "none"),
    "crossed": (
        "pp: 2\nmicrobatches: 2\nrank 0: F0:0 F0:1 BW0:0 BW0:1\nrank 1: F1:0 BW1:0 F1:1 BW1:1",
        1,
        "none",
    ),
}
CROSSED_MICROBATCHES = 2
# (emulate NCCL's rules, warm every communicator up first, run the naive order: each RECV right
# before its consumer, the collectives where the vocabulary pass put them, as lowering left them
# before the step's message order): the bad modes last, since a hung case leaves its (then
# unused) groups behind
MODES = {
    "gloo-lazy": (False, False, True),
    "emulated-warm": (True, True, False),
    "emulated-lazy-ordered": (True, False, False),
    "emulated-warm-naive": (True, True, True),
    "emulated-lazy": (True, False, True),
}
DEADLINE = 5.0


def _model():
    return dataclasses.replace(tiny_model(num_layers=4), seq_length=SEQ)


def _schedule(name: str, world: int):
    """The case's schedule as the runtime receives it (the generators' output, unlowered)."""
    from megatron_pp_ext.schedule.generators import generate
    from megatron_pp_ext.schedule.ir import Schedule
    from megatron_pp_ext.schedule.vocab import add_vocab_passes

    schedule_name, slices, variant = SCHEDULES[name]
    if schedule_name.startswith("pp:"):
        return Schedule.from_text(schedule_name)
    schedule = generate(schedule_name, world, MICROBATCHES, slices=slices)
    return add_vocab_passes(schedule, variant) if variant != "none" else schedule


def emulation_worker(rank: int, world: int) -> dict:
    from megatron_pp_ext.megatron.model import build_chunks_from, build_reference, init_parallel_state
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.runtime.reference import reference_step
    from megatron_pp_ext.runtime.vocab_parallel import VocabGroups
    from megatron_pp_ext.schedule.lowering import insert_p2p

    init_parallel_state(world)
    model_cfg = _model()
    torch.manual_seed(1234)
    reference = build_reference(model_cfg)
    batches = make_batches(model_cfg, MICROBATCHES, seed=3)
    expected = {}  # microbatches -> (losses, gradients) of the unpipelined model
    for count in (MICROBATCHES, CROSSED_MICROBATCHES):
        reference.zero_grad(set_to_none=True)
        losses = loss_values(reference_step(reference, forward_step, iter(batches), count))
        expected[count] = (losses, {n: p.grad.detach().clone() for n, p in reference.named_parameters()})
    report: dict[str, dict] = {}
    # every case's groups first (new_group waits for all ranks, a hung case does not)
    cases = [
        (mode, name, PipeComm(timeout_s=DEADLINE, emulate_nccl=MODES[mode][0]), VocabGroups.create())
        for mode in MODES
        for name in SCHEDULES
    ]
    for mode, name, comm, groups in cases:
        warm_up = MODES[mode][1]
        _, slices, variant = SCHEDULES[name]
        entry: dict = {}
        report[f"{name}/{mode}"] = entry
        try:
            schedule = _schedule(name, world)
            if MODES[mode][2]:
                schedule = insert_p2p(schedule)  # lowered already: the runtime keeps this order
            chunks, names_of = build_chunks_from(
                reference, model_cfg, schedule.placement, rank, sliced=slices > 1
            )
            setup = None
            if variant != "none":
                setup = vocab_setup_from(
                    reference, model_cfg, chunks, schedule.placement, rank, variant, groups
                )
            shape = (SEQ, MICRO_BATCH, model_cfg.hidden_size)
            runtime = PipelineRuntime(
                chunks, comm, shape, model_cfg.torch_dtype, vocab=setup, warm_up=warm_up
            )
            result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
            entry["launched"] = comm.launch.launched
            layers = [p for c in chunks for p in c.parameters() if id(p) in names_of]
            ref_losses, ref_grads = expected[schedule.microbatches]
            entry["grad_error"] = max(rel_error(p.grad, ref_grads[names_of[id(p)]]) for p in layers)
            if result.is_loss_rank:
                losses = loss_values(result.losses)
                entry["loss_error"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            entry["warmed"] = len(comm.creation.created)
            entry["warm_up_seconds"] = comm.creation.warm_up_seconds
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {error}"
        finally:
            comm.abandon()
            comm.close()
    return report


@functools.cache
def _launch() -> tuple:
    return tuple(check_ok(run_ranks(emulation_worker, 2, timeout=300)))


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("mode", ["gloo-lazy", "emulated-warm", "emulated-lazy-ordered"])
def test_runs_exactly_on_plain_gloo_and_warmed_under_emulation(name: str, mode: str) -> None:
    """The naive order on plain gloo, and under emulation the runtime's own: warmed up, or even
    without the warm-up (the step's message order makes first uses come in one order too)."""
    reports = [r[f"{name}/{mode}"] for r in _launch()]
    errors = [f"rank {rank}: {r['error']}" for rank, r in enumerate(reports) if "error" in r]
    assert not errors, "\n".join(errors)
    limit = training_tolerance(_model(), MICROBATCHES, 1)
    for rank, r in enumerate(reports):
        check(r["grad_error"], limit, f"rank {rank}: gradient")
    (loss_error,) = [r["loss_error"] for r in reports if "loss_error" in r]
    check(loss_error, limit, "loss")
    if mode == "emulated-warm":
        assert all(r["warmed"] >= 2 for r in reports), reports  # pairs (and vocabulary channels)
    # under emulation every send and receive went through the launch queue (launch_order.py)
    assert all((r["launched"] > 0) == mode.startswith("emulated") for r in reports), reports


def _nccl_verdict(name: str) -> str | None:
    from megatron_pp_ext.schedule.lowering import insert_p2p
    from megatron_pp_ext.schedule.nccl_check import check_nccl

    verdict = check_nccl(insert_p2p(_schedule(name, 2)), strict=True, warmed=True)
    return None if verdict is None else str(verdict)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_in_order_completion_hangs_the_naive_order_where_the_check_says(name: str) -> None:
    """Warmed up (rule 1 met), the naive order under the launch queue: it completes exactly where
    the schedule core's strict check says it completes, and otherwise every rank stops at the
    deadline naming its op, the peer and the operation it was queued behind (the crossed case
    runs on plain gloo in test_runs_exactly_on_plain_gloo_and_warmed_under_emulation)."""
    verdict = _nccl_verdict(name)
    reports = [r[f"{name}/emulated-warm-naive"] for r in _launch()]
    if name == "crossed":
        assert verdict is not None and "launch order" in verdict, verdict
    if verdict is None:
        assert not any("error" in r for r in reports), reports
        assert all(r["launched"] > 0 for r in reports), reports
        return
    for rank, r in enumerate(reports):
        assert "error" in r, f"rank {rank} completed a step that the check says hangs: {verdict}"
        message = r["error"]
        assert re.match(f"(PeerError|PipelineError): rank {rank}: ", message), message
        assert "no completion after" in message, message
    # at least one rank names the operation it was queued behind (rule 3's signature)
    messages = [r["error"] for r in reports]
    assert any("is launched behind" in m and "launch order" in m for m in messages), messages
    if name == "crossed":
        assert "RECV_B0:0<1 from rank 1" in reports[0]["error"], reports[0]["error"]
        assert "launched behind SEND_F0:1>1" in reports[0]["error"], reports[0]["error"]


@pytest.mark.parametrize("name", [name for name in SCHEDULES if name != "crossed"])
def test_lazy_creation_hangs_under_emulation_until_the_deadline_names_it(name: str) -> None:
    reports = [r[f"{name}/emulated-lazy"] for r in _launch()]
    for rank, r in enumerate(reports):
        assert "error" in r, f"rank {rank} completed a step that NCCL would hang: {r}"
        message = r["error"]
        assert message.startswith("CreationError: rank "), message
        assert "waits to create communicator" in message and f"within {DEADLINE:.1f}s" in message, message
    first = reports[0]["error"]
    if name.startswith("v-half"):  # rank 0 (first stage and loss rank) starts on BCAST_IDS, rank 1 on BCAST_X
        assert "BCAST_IDS" in first and "vocab-emb" in first, first
    else:
        assert "p2p-" in first, first


def _train(*args: str) -> list[dict]:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        metrics = f"{scratch}/metrics.jsonl"
        common = ["--pp", "2", "--num-layers", "4", "--train-iters", "2", "--global-batch-size", "8"]
        done = run_cli(["train", *common, *args, "--metrics", metrics], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in open(metrics)]
    return [{"loss": row["loss"], "grad_norm": row["grad_norm"], "out": done.stdout} for row in rows]


@pytest.mark.parametrize(
    "flags",
    [
        "--pp-schedule v-half --pp-vocab-parallel vocab-2",
        pytest.param(  # k = 2p; also run by the runtime-level test above
            "--pp-schedule slimpipe-interleaved --pp-seq-slices 4", marks=pytest.mark.heavy
        ),
        # k = 2p with SlimPipe's attention redistribution: both ranks hand attention away
        pytest.param(
            "--pp-schedule slimpipe-interleaved --pp-seq-slices 4 --pp-slice-partition uniform "
            "--pp-attn-redistribution 0.5",
            id="slimpipe-interleaved-k4-redistribution",
        ),
    ],
)
def test_train_under_emulation_gives_the_same_losses(flags: str) -> None:
    """``megatron-pp-ext train --pp-emulate-nccl``: the runtime's warm-up creates every
    communicator first, so what hangs lazily above trains, bitwise as on plain gloo."""
    plain = _train(*flags.split())
    emulated = _train(*flags.split(), "--pp-emulate-nccl")
    assert [(r["loss"], r["grad_norm"]) for r in emulated] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert "NCCL's rules emulated" in emulated[0]["out"] and "emulated" not in plain[0]["out"]
    if "--pp-attn-redistribution" in flags:
        handed = re.findall(r"handed away ([0-9.e-]+)", emulated[0]["out"])
        assert len(handed) == 2 and all(float(n) > 0 for n in handed), emulated[0]["out"]


@pytest.mark.heavy
def test_the_exactness_matrix_passes_under_emulation() -> None:
    """The runtime's exactness matrix (schedules x slices x offload x vocabulary x TP/SP/CP/DP,
    p = 2..4) with every PipeComm imposing NCCL's creation and launch-order rules
    (MEGATRON_PP_EXT_EMULATE_NCCL=1): the same checks pass, attention redistribution included."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megatron_pp_ext.runtime.p2p import EMULATE_NCCL_VARIABLE

    files = [
        "tests/test_runtime_exact.py",
        "tests/test_runtime_sliced.py",
        "tests/test_parallel_compose.py",
        "tests/test_context_parallel.py",
        "tests/test_vocab_parallel_exact.py",
        "tests/test_offload_runtime.py",
        "tests/test_megatron_hook.py",
        "tests/test_redistribution_runtime.py",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not heavy",
            "--tier",
            "full",  # the whole matrix of those files
            *files,
        ],
        env={**os.environ, EMULATE_NCCL_VARIABLE: "1"},
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and " passed" in summary and "failed" not in summary, done.stdout[-4000:]


def rendezvous_worker(rank: int, world: int) -> dict:
    """Rank 0 sends one small message and waits for it to go out; rank 1 posts the receive only
    after rank 0's deadline."""
    import time

    from megatron_pp_ext.runtime.p2p import PeerError, PipeComm

    comm = PipeComm(timeout_s=1.0)
    comm.creation.warm_up([comm.creation.pair("F", 0, 1)])
    out: dict = {"error": None}
    if rank == 0:
        comm.send(torch.ones(4), 1, "F", "SEND_F0:0>1")
        try:
            comm.flush()
        except PeerError as error:
            out["error"] = str(error)
            comm.abandon()
    time.sleep(1.5)
    comm.close()
    return out


def test_gloo_already_makes_a_send_wait_for_its_receive() -> None:
    """NCCL's rule 2 (a send completes only once its receive is posted) holds on gloo as it is,
    even for 16 bytes, so --pp-emulate-nccl adds nothing for it: a send whose receive never comes
    fails at the deadline naming the op and the peer."""
    sender, _ = check_ok(run_ranks(rendezvous_worker, 2, timeout=60))
    message = sender["error"]
    assert message is not None, "gloo completed a send that nobody received"
    assert message.startswith("rank 0: SEND_F0:0>1 to rank 1 did not complete"), message


def test_train_refuses_a_schedule_that_would_hang_under_nccl() -> None:
    """Every generated schedule is lowered into the step's message order and passes; one whose
    RECVs stand right before their consumers (rank 0 sends F0:1 then receives B0:0, rank 1 the
    mirror image) hangs in launch order: ``schedule_for``'s check refuses it in one line naming
    the flag (train and the hook exit 2 on it)."""
    from megatron_pp_ext.megatron.hook import OptionError, check_under_nccl
    from megatron_pp_ext.schedule.ir import Schedule
    from megatron_pp_ext.schedule.lowering import insert_p2p, lower

    text = "pp: 2\nmicrobatches: 2\nrank 0: F0:0 F0:1 BW0:0 BW0:1\nrank 1: F1:0 BW1:0 F1:1 BW1:1"
    check_under_nccl(lower(Schedule.from_text(text)))
    with pytest.raises(OptionError) as refused:
        check_under_nccl(insert_p2p(Schedule.from_text(text)))
    message = str(refused.value)
    assert "would hang under NCCL" in message and "rank 0 waits at RECV_B0:0<1" in message, message
    assert "launch order" in message and "\n" not in message
    assert refused.value.flag == "--pp-schedule"
