"""``--pp-timeline`` and Megatron's profiling flags (``runtime/timeline.py``): on real processes
the recorded ops of a step are exactly the lowered schedule's ops per rank, in order, with times
that nest inside the step; recording changes neither the losses nor the op walk; ``train`` writes
a Perfetto trace with a track per rank for the run and for the prediction, and the picture;
``--use-pytorch-profiler`` names every op in torch.profiler's trace; bad combinations are
refused in one line before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from dist_utils import check_ok, run_ranks
from runtime_case import forward_step, loss_values, make_batches, tiny_model

SCHEDULES = ["zb-h1", "dualpipev", "seq1f1b"]
PP, MICROBATCHES = 2, 4


def timeline_worker(rank: int, world: int, names: list[str]) -> dict:
    from megatron_pp_ext.megatron import cpu_shim
    from megatron_pp_ext.megatron.model import build_chunks, init_parallel_state
    from megatron_pp_ext.runtime.executor import PipelineRuntime, prepare
    from megatron_pp_ext.runtime.p2p import PipeComm
    from megatron_pp_ext.runtime.timeline import TimelineRecorder
    from megatron_pp_ext.schedule.generators import generate

    init_parallel_state(world)
    cpu_shim.install()
    model = tiny_model(num_layers=4)
    comm = PipeComm(timeout_s=60)
    out: dict = {}
    for name in names:
        slices = 2 if name == "seq1f1b" else 1
        schedule = generate(name, world, MICROBATCHES, slices=slices)
        batches = make_batches(model, schedule.microbatches)
        runs = {}
        for recording in (False, True):
            torch.manual_seed(0)
            chunks = build_chunks(model, schedule.placement, rank, sliced=slices > 1)
            runtime = PipelineRuntime(chunks, comm, (model.seq_length, 2, model.hidden_size), torch.float32)
            if recording:
                runtime.timeline = TimelineRecorder("unused.json", 0, 1)
            result = runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])
            runs[recording] = (loss_values(result.losses), dict(result.op_count), runtime)
        runtime = runs[True][2]
        (record,) = runtime.timeline.records
        lowered = prepare(schedule)
        out[name] = {
            "ops": [span.op for span in record.spans],
            "expected": [str(op) for op in lowered.ranks[comm.rank]],
            "ordered": all(a.end <= b.start + 1e-9 for a, b in zip(record.spans, record.spans[1:])),
            "positive": all(
                span.end >= span.start and 0 <= span.wait <= span.end - span.start for span in record.spans
            ),
            "same_losses": runs[False][0] == runs[True][0],
            "same_walk": runs[False][1] == runs[True][1],
        }
    comm.close()
    return out


def test_recorded_ops_are_the_lowered_schedule_and_recording_changes_nothing() -> None:
    reports = check_ok(run_ranks(timeline_worker, PP, SCHEDULES, timeout=300))
    for rank, report in enumerate(reports):
        for name, row in report.items():
            assert row["ops"] == row["expected"], (rank, name)
            assert row["ordered"] and row["positive"], (rank, name)
            assert row["same_losses"] and row["same_walk"], (rank, name)


TRAIN = ["--pp", "2", "--train-iters", "3", "--profile-step-start", "1", "--profile-step-end", "2"]


@pytest.mark.parametrize(
    "schedule", [["--pp-schedule", "zb-h1"], ["--pp-schedule", "slimpipe", "--pp-seq-slices", "2"]]
)
def test_train_writes_the_trace_and_the_picture(tmp_path: Path, schedule: list[str]) -> None:
    trace = tmp_path / "timeline.json"
    done = run_cli(["train", *TRAIN, *schedule, "--pp-timeline", str(trace)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"measured rank 0", "measured rank 1", "predicted rank 0", "predicted rank 1"}
    boxes = [e for e in events if e.get("ph") == "X"]
    for pid in range(4):  # every track has its ops: the run's (0, 1) and the prediction's (2, 3)
        assert any(e["pid"] == pid for e in boxes), pid
    measured = sorted((e["pid"], e["name"]) for e in boxes if e["pid"] < 2)
    predicted = sorted((e["pid"] - 2, e["name"]) for e in boxes if e["pid"] >= 2)
    assert measured == predicted  # the same ops on the same ranks
    assert trace.with_suffix(".png").stat().st_size > 10_000


def test_pytorch_profiler_names_every_op(tmp_path: Path) -> None:
    flags = [*TRAIN, "--pp-schedule", "zb-h1", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path)]
    done = run_cli(["train", *flags], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = list(tmp_path.rglob("*.pt.trace.json"))
    assert traces, list(tmp_path.rglob("*"))
    text = "".join(path.read_text() for path in traces)
    for op in ('"F0:0', '"B0:0', '"W0:0', '"SEND_F0:0'):
        assert op in text, op


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--pp-timeline", "timeline.txt"], "--pp-timeline"),
        (["--pp-timeline", "t.json", "--profile-step-end", "9"], "--profile-step-end"),
        (
            ["--pp-timeline", "t.json", "--profile-step-start", "2", "--profile-step-end", "2"],
            "--profile-step-end",
        ),
        (["--use-pytorch-profiler"], "--use-pytorch-profiler"),
        pytest.param(
            ["--profile"], "--profile", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="GPU")
        ),
    ],
)
def test_profiling_flags_refuse_what_they_cannot_do_before_processes_start(flags: list, named: str) -> None:
    base = ["--pp", "2", "--train-iters", "3", "--profile-step-start", "1", "--profile-step-end", "2"]
    done = run_cli(["train", *base, *flags], timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert named in error, error
