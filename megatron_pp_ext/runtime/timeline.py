"""The timeline of real steps: every op each rank ran, when, and how long it waited for peers.

``--pp-timeline FILE`` (``train`` and the hook under pretrain_gpt.py) records the training steps
of Megatron's profiling window (``--profile-step-start`` .. ``--profile-step-end``) and, after
the window's last step, writes what the ranks of the first pipeline ran:

- ``FILE`` (``.json``): a Perfetto trace (ui.perfetto.dev), one process per rank for the run and
  one per rank for the simulator's prediction of the same lowered schedule at the op costs the
  run measured;
- ``FILE`` with ``.png`` (or ``.svg``): the picture ``simulate --plot`` draws, measured above,
  predicted below, on one time axis, with each rank's bubble.

How. A recorded step gets one more step feature (:class:`StepTimeline`, ``step_feature.py``): it
takes the clock before and after every op of the rank's lowered list (compute ops, sends and
receives, copies, vocabulary passes; the two ops of an overlapped pair share one span) and
PipeComm's ``wait_seconds`` around it, the time the op spent blocked on a peer. On the host the
clock is ``time.perf_counter``; on a GPU a CUDA event per edge, read once the step is over (one
synchronisation at the step's end, only in a recorded step), anchored to the host's wall clock at
the step's start so that the ranks line up. After the window the spans are gathered to every
rank (``all_gather_object`` on the world group) and rank 0 writes the files, between steps:
``train`` right after the window's last step, outside its timing; under pretrain_gpt.py at the
start of the next call of the forward-backward function (that step pays for it; the window must
end before ``--train-iters``). Off (no ``--pp-timeline``), nothing is recorded and nothing is added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..schedule.costs import UniformCosts
from ..schedule.ir import Op, OpKind, Schedule
from .step_feature import StepFeature

COMPUTE = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)


@dataclass(frozen=True)
class Span:
    """One op of one rank in one step, in seconds from the step's start (the rank's own clock,
    anchored to wall-clock time so ranks line up)."""

    rank: int
    position: int
    op: str  # ``str(op)`` (picklable, readable)
    kind: str
    stage: int
    microbatch: int
    slice: int
    start: float
    end: float
    wait: float  # of which blocked on a peer (PipeComm.wait_seconds)


@dataclass
class StepRecord:
    """What one rank recorded in one step."""

    iteration: int
    rank: int
    anchor: float  # wall-clock seconds of the step's start on this rank
    spans: list[Span] = field(default_factory=list)


class _HostClock:
    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def mark(self) -> Any:
        return time.perf_counter()

    def seconds(self, marks: list[Any]) -> list[float]:
        return [mark - self.origin for mark in marks]


class _DeviceClock:
    """CUDA events per edge, read after the step (the device's times, not the host's launches)."""

    def __init__(self) -> None:
        import torch

        torch.cuda.synchronize()  # the anchor is the device's start, not a launch ahead of it
        self.torch = torch
        self.origin = self.mark()

    def mark(self) -> Any:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list[Any]) -> list[float]:
        self.torch.cuda.synchronize()
        return [self.origin.elapsed_time(mark) / 1e3 for mark in marks]


class StepTimeline(StepFeature):
    """The step feature of a recorded step: each op's edges and waits."""

    def __init__(self, iteration: int, rank: int, comm: Any, on_device: bool) -> None:
        self.iteration, self.rank, self.comm, self.on_device = iteration, rank, comm, on_device
        self.begin()

    def begin(self) -> None:
        """The step (or its restart, after the validation gate) starts: record from here."""
        self.record = StepRecord(self.iteration, self.rank, time.time())
        self.clock: _HostClock | _DeviceClock = _DeviceClock() if self.on_device else _HostClock()
        self._open: dict[int, tuple[Any, float]] = {}
        self._closed: list[tuple[int, Op, Any, Any, float]] = []

    def before(self, position: int, op: Op) -> None:
        self._open[position] = (self.clock.mark(), self.comm.wait_seconds)

    def after(self, position: int, op: Op) -> None:
        start, waited = self._open.pop(position)
        self._closed.append((position, op, start, self.clock.mark(), self.comm.wait_seconds - waited))

    def finish(self) -> None:
        marks = [mark for _, _, start, end, _ in self._closed for mark in (start, end)]
        seconds = self.clock.seconds(marks)
        for index, (position, op, _, _, wait) in enumerate(self._closed):
            start, end = seconds[2 * index], seconds[2 * index + 1]
            self.record.spans.append(
                Span(
                    self.record.rank,
                    position,
                    str(op),
                    op.kind.value,
                    op.stage,
                    op.microbatch,
                    op.slice,
                    start,
                    end,
                    min(wait, end - start),
                )  # fmt: skip
            )
        self._closed.clear()


class OpRanges(StepFeature):
    """Megatron's ``--profile`` / ``--use-pytorch-profiler``: every op of the step as a range
    named after it (``F3:1<0``...), so the profilers show the schedule: torch.profiler's
    ``record_function`` always, NVTX (nsys) on a GPU. The two ops of a pair nest."""

    def __init__(self, nvtx: bool) -> None:
        self.nvtx = nvtx
        self._open: list[Any] = []

    def before(self, position: int, op: Op) -> None:
        import torch

        scope = torch.profiler.record_function(str(op))
        scope.__enter__()
        self._open.append(scope)
        if self.nvtx:
            torch.cuda.nvtx.range_push(str(op))

    def after(self, position: int, op: Op) -> None:
        import torch

        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._open.pop().__exit__(None, None, None)

    def discard(self, error: BaseException) -> None:
        while self._open:
            self.after(-1, None)  # type: ignore[arg-type]


def window_refusal(
    path: str | None, start: int, end: int, iterations: int | None = None, written_after: bool = False
) -> tuple[str, str] | None:
    """(flag, why) where ``--pp-timeline`` and Megatron's profiling window cannot be honoured,
    else None: train's checks, pretrain_gpt.py's parser and the recorder itself ask this.
    ``written_after``: the files are written at the step after the window (the hook under
    Megatron-LM's loop), so the window must end before ``iterations``."""
    if path is not None and not path.endswith(".json"):
        return "--pp-timeline", f"{path}: give a .json file (the picture goes beside it)"
    if not 0 <= start < end:
        return "--profile-step-end", f"{end} must be above --profile-step-start {start} (>= 0)"
    if iterations is not None and (end >= iterations if written_after else end > iterations):
        after = " and end before it (the files are written at the next step)" if written_after else ""
        return (
            "--profile-step-end",
            f"{end}: the profiling window must lie inside --train-iters {iterations}{after}",
        )
    return None


class TimelineRecorder:
    """Which training steps are recorded (Megatron's profiling window), and the files after it.

    ``start``/``end``: Megatron-LM's ``--profile-step-start``/``--profile-step-end``: its loop
    profiles while ``start <= iteration < end`` with ``iteration`` the steps done before, so the
    training steps ``start + 1`` .. ``end`` (1-based) are recorded."""

    def __init__(self, path: str, start: int, end: int) -> None:
        refusal = window_refusal(path, start, end)
        if refusal is not None:
            raise ValueError(": ".join(refusal))
        self.path, self.start, self.end = path, start, end
        self.done = 0  # training steps run
        self.records: list[StepRecord] = []
        self.written: str | None = None  # the files, once written (rank 0)
        self._current: StepTimeline | None = None
        self._ready: tuple[Any, Schedule] | None = None  # the window is over: what flush writes

    def step_feature(self, runtime: Any, forward_only: bool) -> StepTimeline | None:
        """The feature for the step about to run (None: not recorded)."""
        self._current = None
        if forward_only:
            return None
        iteration = self.done + 1
        if self.start < iteration <= self.end:
            self._current = StepTimeline(iteration, runtime.rank, runtime.comm, runtime.device.type == "cuda")
        return self._current

    def step_done(self, runtime: Any, schedule: Schedule, forward_only: bool) -> None:
        """After a step: keep its record (the files wait for :meth:`flush`, outside any step)."""
        if forward_only:
            return
        self.done += 1
        if self._current is not None:
            self.records.append(self._current.record)
            self._current = None
        if self.done == self.end:
            self._ready = (runtime, schedule)

    def flush(self) -> str | None:
        """After the window's last step (collective: every rank calls it at the same point), gather
        the records and write the files on rank 0; the picture's path there, else None."""
        ready, self._ready = self._ready, None
        if ready is None:
            return None
        self._write(*ready)
        return self.written

    def _write(self, runtime: Any, schedule: Schedule) -> None:
        import torch.distributed as dist

        from ..launch import gather_objects

        pipeline = tuple(runtime.comm.ranks)
        rows = (
            gather_objects((pipeline, self.records)) if dist.is_initialized() else [(pipeline, self.records)]
        )
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        first = rows[0][0]
        records = [record for ranks, found in rows if ranks == first for record in found]
        self.written = write_timeline(self.path, schedule, records)


def write_timeline(path: str, schedule: Schedule, records: list[StepRecord]) -> str:
    """The trace and the picture of the last recorded step (``schedule``: the lowered schedule it
    ran); returns the picture's path."""
    from ..schedule.plot import plot_comparison, write_trace_of

    last = max(record.iteration for record in records)
    step = [record for record in records if record.iteration == last]
    measured = measured_result(schedule, step)
    predicted = predicted_result(schedule, records)
    write_trace_of([("measured", measured), ("predicted", predicted)], path)
    picture = path[: -len(".json")] + ".png"
    plot_comparison([("measured", measured), ("predicted at measured op costs", predicted)], picture)
    return picture


def measured_result(schedule: Schedule, step: list[StepRecord]) -> Any:
    """One recorded step as the simulator's result type (its compute ops as events; no memory
    curve: the runtime measures the peak only)."""
    from ..schedule.replay import Event, SimResult

    origin = min(record.anchor for record in step)
    events, busy = [], [0.0] * schedule.pp
    for record in step:
        shift = record.anchor - origin
        for span in record.spans:
            if not _drawn(span):
                continue
            op = Op(OpKind(span.kind), span.stage, span.microbatch, span.slice)
            events.append(Event(record.rank, op, span.start + shift, span.end + shift))
            busy[record.rank] += span.end - span.start - span.wait
    makespan = max((event.end for event in events), default=0.0)
    return SimResult(schedule, makespan, busy, [0.0] * schedule.pp, 1.0, events=events)


@dataclass
class MeasuredCosts(UniformCosts):
    """Op durations as the run measured them: per (kind, stage) the mean compute time (span minus
    waits) over the recorded steps; the two ops of an overlapped pair share their span, so each
    is charged half of it. Messages cost nothing more (their waits are what the replay derives);
    memory is not priced (the runtime measures the peak only)."""

    means: dict[tuple[str, int], float] = field(default_factory=dict)

    def duration(self, op: Op) -> float:
        return self.means.get((op.kind.value, op.stage), 0.0)


def measured_costs(schedule: Schedule, records: list[StepRecord]) -> MeasuredCosts:
    samples: dict[tuple[str, int], list[float]] = {}
    for record in records:
        sharing: dict[tuple[float, float], int] = {}
        for span in record.spans:
            sharing[(span.start, span.end)] = sharing.get((span.start, span.end), 0) + 1
        for span in record.spans:
            if _drawn(span):
                share = (span.end - span.start - span.wait) / sharing[(span.start, span.end)]
                samples.setdefault((span.kind, span.stage), []).append(share)
    means = {key: sum(values) / len(values) for key, values in samples.items()}
    return MeasuredCosts(
        num_stages=schedule.num_stages,
        num_slices=schedule.slices,
        chunks_per_rank=schedule.vpp,
        means=means,
    )


def _drawn(span: Span) -> bool:
    """A compute op (F, B, W, BW or a vocabulary pass): what the pictures draw as boxes."""
    kind = OpKind(span.kind)
    return kind in COMPUTE or Op(kind, span.stage, span.microbatch, span.slice).is_vocab


def predicted_result(schedule: Schedule, records: list[StepRecord]) -> Any:
    """The simulator's replay of the lowered schedule at the measured op costs."""
    from ..schedule.replay import replay

    result = replay(schedule, measured_costs(schedule, records))
    result.peak_memory_per_rank = [0.0] * schedule.pp
    result.memory_curves = []
    return result
