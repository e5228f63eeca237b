"""``bench --emulate F,B,W``: the simulator checked against real processes.

p processes run each schedule's lowered op list with emulated compute and real messages: an F, B,
W or BW sleeps for its duration, SEND and RECV move real tensors (the ``tiny`` bench model's
activation by default: seq 32 x micro-batch 2 x hidden 64, fp32; a slice's share of the sequence
for sliced schedules) through the runtime's own :class:`~megatron_pp_ext.runtime.p2p.PipeComm`.
Beside the measured step time stands the simulator's prediction for the same costs
(``schedule/simulate.py``) and ``sim_error = measured / predicted - 1``.

Costs. ``F,B,W`` are milliseconds for one whole microbatch through one rank's share of the model,
as ``simulate --costs`` reads them (``UniformCosts``): an op of one of a rank's v stages costs 1/v
of that, an op of one of k sequence slices 1/k, BW costs B + W (W may be 0 or left out for
schedules without a B/W split). ``--emulate-skew`` multiplies every compute op of rank r by its
r-th factor (a slow device). The worker and the prediction read their durations from the same
:class:`EmulatedCosts`, so they cannot disagree about what an op costs; the prediction adds the
p2p latency measured once per run by a ping-pong between neighbour ranks (one-way = half the
round trip, the median of many) as every message's latency.

The runner. :class:`EmulatedStep` does not reuse ``runtime/executor.py``'s ``_StepRun``: that walk
is welded to megatron-core stage runners (autograd, weight-gradient stores, slicing contexts), and
a model whose every layer sleeps would still pay autograd's CPU time. It is a small copy of the
same walk with the same communication discipline, op by op: a RECV posts its receive at its place
(``PipeComm.post_recv``, into an inbox keyed by (direction, stage, microbatch, slice)); the compute
op that needs the message waits for it there (``PostedRecv.wait``); a compute op's output goes to
the outbox, or straight to the inbox when the next stage is on the same rank (the tip of a V); a
SEND sends it asynchronously (``PipeComm.send``); ``reap`` after every op, ``flush`` at the end of
the step; every communicator a schedule uses is created before its first step in the global order
(``creation.warm_up``), and ``--pp-emulate-nccl`` imposes NCCL's creation and in-order completion on
gloo exactly as in the runtime. Every message carries (direction, stage, microbatch, slice) in its
first four elements, checked on arrival, so a crossed message fails the step.

Sleep, not spin. An emulated op sleeps for its duration (:class:`Sleeper`). Spinning would be
exact, but p ranks spinning on 2 cores would take turns on them and stretch every op by the
scheduler's time slices: the error would be the machine's, not the simulator's. A sleeping rank
costs no CPU, so ranks overlap as devices do. A sleep wakes late (the kernel's timer slack,
lowered to 1 us where Linux allows it, and on a busy machine the wait for a core), so each sleep
is shortened by the recent average lateness: the emulated ops last their durations to within
tens of microseconds on average. (Spinning out the rest of an op instead would take the CPU that
the other ranks' host work waits for.)

Host time. What the simulator does not price is the host's own time per op: posting a receive,
sending, waking up, on a loaded 2-core machine 0.1 to 1 ms per compute op. On a GPU the host runs
ahead of the device and hides it; here it adds to every rank's critical path. Each step splits
every rank's time into emulated compute, waits for peers (PipeComm's ``wait_seconds``) and the
rest, its host time; besides ``sim_error`` the results give the host time per compute op of
each rank and ``host_error``, the error left once the prediction charges that host time to each
compute op of the rank. What ``host_error`` still shows is the schedule's timing itself: a runner
that ran serially, or a simulator that ignored a dependency, misses by tens of percent.

NCCL's rules. Under ``--pp-emulate-nccl`` a send completes only once its receive is posted and a
rank completes its communication in launch order (``runtime/launch_order.py``): a send waits for
its receiver to reach the receive's place, and everything launched after it waits too. The
prediction then replays the same lowered ops under those rules with the host computing
(``schedule/completion.py``, ``IN_ORDER_SYNC``); without the flag, with sends that never wait.
Each job's messages are ordered by a replay at its emulated costs (no skew, no latency), as the
runtime orders them at its model's FLOP costs (``schedule/run_costs.py``).

A step's time is the slowest rank's, each from its exit of a barrier to the end of its step
(flush included), as the bench times the real runtime.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..schedule.completion import FREE, IN_ORDER_SYNC
from ..schedule.costs import UniformCosts
from ..schedule.generators import SCHEDULES, RequestError, generate
from ..schedule.generators.request import Costs
from ..schedule.ir import COMPUTE_KINDS, Op, OpKind, Schedule, format_op
from ..schedule.lowering import lower
from ..schedule.replay import SimResult, replay
from ..schedule.validate import validate
from .job import DEFAULT_SLICES, is_sliced_family

MESSAGE_SHAPE = (32, 2, 64)  # the tiny bench model's activation: seq, micro-batch, hidden (fp32)
PING_ROUNDS = 60  # round trips per neighbour pair when measuring the p2p latency
PING_SKIPPED = 10  # first round trips not counted (connection set-up, cold caches)
LATE_CAP = 1e-3  # the most a sleep is shortened by


# ---- flags ------------------------------------------------------------------------------------


def add_emulate_arguments(parser: argparse.ArgumentParser) -> None:
    """``--emulate F,B,W`` and ``--emulate-skew r0,r1,...`` (attributes ``emulate``, ``emulate_skew``)."""
    parser.add_argument(
        "--emulate",
        metavar="F,B,W",
        help="run the schedules with emulated compute (milliseconds for one microbatch through a "
        "rank's share of the model, as simulate --costs; W may be left out) and real messages, "
        "and compare the step time with the simulator's prediction (sim_error)",
    )
    parser.add_argument(
        "--emulate-skew",
        metavar="R0,R1,...",
        help="with --emulate: one factor per pipeline rank multiplying its compute times (a slow device)",
    )


@dataclass(frozen=True)
class EmulateCosts:
    """What ``--emulate`` and ``--emulate-skew`` asked for, in seconds."""

    forward: float
    backward: float
    weight: float
    skew: tuple[float, ...] | None = None


def parse_emulate(text: str | None, skew_text: str | None, pp: int) -> EmulateCosts:
    """Read the two flags; a bad value raises ``RequestError`` naming its flag."""
    if text is None:
        if skew_text is not None:
            raise RequestError("needs --emulate F,B,W", flag="--emulate-skew")
        raise RequestError("expected F,B,W in milliseconds, e.g. 20,20,20", flag="--emulate")
    values = _numbers(text)
    if values is None or len(values) not in (2, 3) or min(values[:2]) <= 0 or min(values) < 0:
        raise RequestError(
            f"expected F,B,W in milliseconds (F and B > 0, W >= 0 or left out), e.g. 20,20,20, got {text!r}",
            flag="--emulate",
        )
    forward, backward, weight = (*values, 0.0)[:3]
    skew = None
    if skew_text is not None:
        factors = _numbers(skew_text)
        if factors is None or len(factors) != pp or min(factors) <= 0:
            raise RequestError(
                f"expected {pp} positive factors (one per pipeline rank, --pp {pp}), e.g. "
                f"{','.join(['1.0'] * pp)}, got {skew_text!r}",
                flag="--emulate-skew",
            )
        skew = tuple(factors)
    return EmulateCosts(forward / 1e3, backward / 1e3, weight / 1e3, skew)


def _numbers(text: str) -> list[float] | None:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        return None
    return values if all(math.isfinite(v) for v in values) else None


# ---- costs ------------------------------------------------------------------------------------


@dataclass
class EmulatedCosts(UniformCosts):
    """:class:`UniformCosts` in seconds, each compute op scaled by its rank's skew factor.
    ``rank_of_stage[s]`` is the rank of virtual stage s (the schedule's placement). ``overhead``
    (per rank, seconds): host time added to each compute op, for the prediction that charges
    the runner's measured per-op host time; the emulated ops themselves never include it."""

    skew: tuple[float, ...] = ()
    rank_of_stage: tuple[int, ...] = ()
    overhead: tuple[float, ...] = ()

    def duration(self, op: Op) -> float:
        base = super().duration(op)
        if op.kind in COMPUTE_KINDS:
            rank = self.rank_of_stage[op.stage]
            if self.skew:
                base *= self.skew[rank]
            if self.overhead:
                base += self.overhead[rank]
        return base


def emulated_costs(
    schedule: Schedule, costs: EmulateCosts, latency: float = 0.0, overhead: tuple[float, ...] = ()
) -> EmulatedCosts:
    """The cost model of ``schedule`` for ``costs``, with ``latency`` seconds per p2p message
    (and ``overhead`` seconds of host time per compute op of each rank)."""
    return EmulatedCosts(
        num_stages=schedule.num_stages,
        num_slices=schedule.slices,
        chunks_per_rank=schedule.vpp,
        forward=costs.forward,
        backward=costs.backward,
        weight=costs.weight,
        comm=latency,
        skew=costs.skew or (),
        rank_of_stage=tuple(schedule.placement.rank_of(s) for s in range(schedule.num_stages)),
        overhead=tuple(overhead),
    )


# ---- the plan, decided before any process starts ----------------------------------------------


@dataclass
class EmulateJob:
    """One schedule to emulate: the lowered, validated op lists, or why not."""

    name: str
    schedule: Schedule | None = None
    lowered: Schedule | None = None
    skip: str | None = None


@dataclass
class EmulateSettings:
    """Everything a worker needs; plain data so it pickles into spawned processes."""

    pp: int
    microbatches: int
    iterations: int
    warmup: int
    costs: EmulateCosts
    jobs: list[EmulateJob]
    output: str  # rank 0 writes the results here as JSON
    timeout: float = 300.0
    emulate_nccl: bool = False
    seed: int = 1234
    message_shape: tuple[int, ...] = MESSAGE_SHAPE
    slices: int = DEFAULT_SLICES  # for the sequence-sliced schedules
    trace: bool = False  # also return every rank's executed ops and their times (last step)


def plan_job(
    name: str,
    pp: int,
    microbatches: int,
    costs: EmulateCosts,
    emulate_nccl: bool,
    slices: int = DEFAULT_SLICES,
) -> EmulateJob:
    """Generate and lower ``name`` (``slices`` slices for a sliced schedule, at least its
    minimum), or say why it is skipped."""
    job = EmulateJob(name)
    spec = SCHEDULES.get(name)
    if spec is None:
        job.skip = "not in this build's schedule registry"
        return job
    if is_sliced_family(name):
        slices = max(slices, spec.min_slices(pp, spec.default_vpp))
    else:
        slices = 1
    plan_costs = Costs(forward=costs.forward, backward=costs.backward, weight=costs.weight)
    try:
        schedule = generate(name, pp, microbatches, slices=slices, costs=plan_costs)
    except RequestError as error:
        job.skip = f"{error.flag}: {error}"
        return job
    # the messages in the order a replay at these costs sends them, as the runtime orders them
    # at its model's FLOP costs (schedule/run_costs.py): without skew or latency, which no rank
    # knows alike
    lowered = lower(schedule, emulated_costs(schedule, dataclasses.replace(costs, skew=None)))
    if emulate_nccl:
        from ..schedule.nccl_check import check_nccl

        hang = check_nccl(lowered, strict=True, warmed=True)
        if hang is not None:
            job.skip = f"would hang under NCCL: {hang.message()}"
            return job
    validate(lowered)
    job.schedule, job.lowered = schedule, lowered
    return job


# ---- the worker -------------------------------------------------------------------------------


class EmulatedStep:
    """One step of one rank's lowered ops with emulated compute, using ``comm`` (a PipeComm)
    exactly as ``runtime/executor.py``'s ``_StepRun`` does (see the module docstring).
    ``trace``: (op, start, compute start, compute end, end) of every op as it ran, in seconds
    from the step's start (the compute window is the emulated op's sleep; before it, the wait
    for its message). After :meth:`execute`: ``compute_s`` (emulated compute), ``wait_s``
    (blocked on peers: receives and the final flush, PipeComm's ``wait_seconds``) and
    ``host_s``, the rest (the runner's and PipeComm's own CPU time, or waiting for a core)."""

    def __init__(
        self,
        lowered: Schedule,
        rank: int,
        comm: Any,
        costs: EmulatedCosts,
        message_shape: tuple,
        sleeper: Sleeper | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.lowered = lowered
        self.rank = rank
        self.comm = comm
        self.costs = costs
        self.place = lowered.placement
        sequence, *rest = message_shape
        self.shape = (max(1, sequence // lowered.slices), *rest)
        self.inbox: dict[tuple[str, int, int, int], Any] = {}
        self.outbox: dict[tuple[str, int, int, int], Any] = {}
        self.sleeper = sleeper or Sleeper()
        self.trace: list[tuple[str, float, float, float, float]] = []
        self._window = (0.0, 0.0)
        self.compute_s = self.wait_s = self.host_s = 0.0
        self.compute_ops = 0

    def execute(self, start: float) -> None:
        clock = time.perf_counter
        waited = self.comm.wait_seconds
        for op in self.lowered.ranks[self.rank]:
            began = clock()
            self._window = (began, began)
            self._run(op)
            self.comm.reap()
            computed, done = self._window
            self.compute_s += done - computed
            self.trace.append((format_op(op), began - start, computed - start, done - start, clock() - start))
        self.comm.flush()
        self.wait_s = self.comm.wait_seconds - waited
        self.host_s = clock() - start - self.compute_s - self.wait_s
        left = [f"unused message {key}" for key in self.inbox] + [
            f"unsent output {key}" for key in self.outbox
        ]
        if left:
            raise RuntimeError(f"rank {self.rank}: step ended with " + "; ".join(left[:5]))

    def _run(self, op: Op) -> None:
        kind = op.kind
        if kind == OpKind.F:
            if op.stage > 0:
                self._take("F", op)
            self._compute(op)
            if op.stage < self.lowered.num_stages - 1:
                self._emit("F", op.stage + 1, op)
        elif kind in (OpKind.B, OpKind.BW):
            if op.stage < self.lowered.num_stages - 1:
                self._take("B", op)
            self._compute(op)
            if op.stage > 0:
                self._emit("B", op.stage - 1, op)
        elif kind == OpKind.W:
            self._compute(op)
        elif kind in (OpKind.RECV_F, OpKind.RECV_B):
            direction = "F" if kind == OpKind.RECV_F else "B"
            posted = self.comm.post_recv(
                self.shape, self.torch.float32, self.comm.device, op.peer, direction, str(op)
            )
            self.inbox[(direction, op.stage, op.microbatch, op.slice)] = posted
        elif kind in (OpKind.SEND_F, OpKind.SEND_B):
            direction = "F" if kind == OpKind.SEND_F else "B"
            tensor = self.outbox.pop((direction, op.stage, op.microbatch, op.slice))
            self.comm.send(tensor, op.peer, direction, str(op))
        else:
            raise RuntimeError(f"rank {self.rank}: the emulation does not run {op} (offload, vocabulary)")

    def _compute(self, op: Op) -> None:
        self.compute_ops += 1
        began = time.perf_counter()
        self.sleeper.sleep(began, self.costs.duration(op))
        self._window = (began, time.perf_counter())

    def _take(self, direction: str, op: Op) -> None:
        item = self.inbox.pop((direction, op.stage, op.microbatch, op.slice), None)
        if item is None:
            what = "input" if direction == "F" else "output gradient"
            raise RuntimeError(f"rank {self.rank}: {op} has no {what}")
        tensor = item if isinstance(item, self.torch.Tensor) else item.wait()
        producer = op.stage - 1 if direction == "F" else op.stage + 1
        got = [int(v) for v in tensor.reshape(-1)[:4].tolist()]
        wanted = [0 if direction == "F" else 1, producer, op.microbatch, op.slice]
        if got != wanted:
            raise RuntimeError(f"rank {self.rank}: {op} got the message of {got}, expected {wanted}")

    def _emit(self, direction: str, to_stage: int, op: Op) -> None:
        tensor = self.torch.zeros(self.shape, dtype=self.torch.float32, device=self.comm.device)
        code = [0.0 if direction == "F" else 1.0, float(op.stage), float(op.microbatch), float(op.slice)]
        tensor.view(-1)[:4] = self.torch.tensor(code, device=self.comm.device)
        if self.place.rank_of(to_stage) == self.rank:
            self.inbox[(direction, to_stage, op.microbatch, op.slice)] = tensor
        else:
            self.outbox[(direction, op.stage, op.microbatch, op.slice)] = tensor


class Sleeper:
    """Sleeps that end on time on average, without spinning: each sleep is shortened by how
    late the recent ones woke up (a moving average of the kernel's wake-up and, on a busy
    machine, the wait for a core). One op may end a little early, the next a little late; the
    sum over a step is what the durations say."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.late = 0.0  # seconds a sleep overshoots, moving average
        self.smoothing = smoothing

    def sleep(self, began: float, seconds: float) -> None:
        if seconds <= 0:
            return
        now = time.perf_counter()
        asked = began + seconds - min(self.late, LATE_CAP) - now
        if asked > 0:
            time.sleep(asked)
            self.late += self.smoothing * ((time.perf_counter() - now - asked) - self.late)


def _fine_timer_slack() -> None:
    """Ask Linux to wake sleeps within 1 us instead of its default 50 us (PR_SET_TIMERSLACK)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def measure_latency(comm: Any, shape: tuple[int, ...], rounds: int = PING_ROUNDS) -> list[float]:
    """One-way latency of a message of ``shape`` (fp32) between each pair of neighbour ranks
    (r, r+1), through ``comm`` as the pipeline sends it: half the median round trip, measured by
    rank r (F channel up, B channel back). Every rank returns the same list."""
    import torch

    from .. import launch

    rank, size = comm.rank, comm.size
    creation = comm.creation
    pairs = [creation.pair("F", r, r + 1) for r in range(size - 1)]
    pairs += [creation.pair("B", r + 1, r) for r in range(size - 1)]
    creation.warm_up(pairs)
    tensor = torch.zeros(shape, dtype=torch.float32, device=comm.device)
    mine: dict[int, float] = {}
    for low in range(size - 1):
        if rank not in (low, low + 1):
            continue
        trips = []
        for _ in range(rounds):
            if rank == low:
                began = time.perf_counter()
                comm.send(tensor, low + 1, "F", "latency ping")
                comm.post_recv(shape, torch.float32, comm.device, low + 1, "B", "latency pong").wait()
                trips.append(time.perf_counter() - began)
            else:
                comm.post_recv(shape, torch.float32, comm.device, low, "F", "latency ping").wait()
                comm.send(tensor, low, "B", "latency pong")
        comm.flush()
        if rank == low:
            mine[low] = statistics.median(trips[PING_SKIPPED:] or trips) / 2
    merged: dict[int, float] = {}
    for found in launch.gather_objects(mine):
        merged.update(found)
    return [merged[low] for low in range(size - 1)]


def worker(rank: int, world_size: int, local_rank: int, settings: EmulateSettings) -> None:
    import torch
    import torch.distributed as dist

    from .. import launch
    from ..runtime.p2p import PipeComm

    # the bookkeeping collectives wait longer than any transfer: a rank whose peer failed times
    # out in the pipeline first and still meets the others at the next gather
    launch.init_distributed(rank, world_size, local_rank, 2 * settings.timeout + 60)
    torch.set_num_threads(1)
    torch.manual_seed(settings.seed)
    _fine_timer_slack()
    emulate = settings.emulate_nccl or None  # None: the environment variable decides, as bench
    comm = PipeComm(timeout_s=settings.timeout, emulate_nccl=emulate)
    latencies = measure_latency(comm, settings.message_shape)
    rows = []
    for job in settings.jobs:
        if job.lowered is None:
            rows.append({"schedule": job.name, "skip": job.skip})
            continue
        row, failed = run_job(job, comm, settings)
        rows.append(row)
        if failed:  # a gloo pair that timed out stays closed: fresh channels for the next job
            comm.close()
            comm = PipeComm(timeout_s=settings.timeout, emulate_nccl=emulate)
    if rank == 0:
        with open(settings.output, "w") as handle:
            json.dump({"latency_per_pair_s": latencies, "backend": dist.get_backend(), "rows": rows}, handle)
    comm.close()
    dist.barrier()
    dist.destroy_process_group()


def run_job(job: EmulateJob, comm: Any, settings: EmulateSettings) -> tuple[dict[str, Any], bool]:
    """Warm-up and timed steps of one schedule on this rank; (its row, whether a step failed)."""
    import torch.distributed as dist

    from .. import launch

    assert job.lowered is not None
    costs = emulated_costs(job.lowered, settings.costs)
    creation = comm.creation
    creation.warm_up(creation.pairs_of(job.lowered))  # as the runtime, before the first step
    times: list[float] = []
    host: list[float] = []  # this rank's host seconds per timed step
    step: EmulatedStep | None = None
    sleeper = Sleeper()
    for iteration in range(settings.warmup + settings.iterations):
        error = None
        step = EmulatedStep(job.lowered, comm.rank, comm, costs, settings.message_shape, sleeper)
        try:
            dist.barrier()
            start = time.perf_counter()
            step.execute(start)
            seconds = time.perf_counter() - start
        except Exception as caught:
            comm.abandon()
            seconds, error = 0.0, f"{type(caught).__name__}: {caught}"[:500]
        outcomes = launch.gather_objects((seconds, error))
        errors = [e for _, e in outcomes if e]
        if errors:
            return {"schedule": job.name, "skip": f"failed: {errors[0]}"}, True
        if iteration >= settings.warmup:
            times.append(max(s for s, _ in outcomes))
            host.append(step.host_s)
    assert step is not None
    per_op = statistics.median(host) / step.compute_ops if host and step.compute_ops else 0.0
    row: dict[str, Any] = {
        "schedule": job.name,
        "skip": None,
        "steps_s": times,
        "host_per_op_s": launch.gather_objects(per_op),
    }
    if settings.trace:
        row["trace"] = launch.gather_objects(step.trace)  # every rank's ops of the last step, as executed
    return row, False


# ---- the command's side -----------------------------------------------------------------------


def run_emulate(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """Emulate ``names`` on ``args.pp`` processes and predict each; the results as plain data.

    Reads ``args.emulate``, ``args.emulate_skew``, ``args.pp``, ``args.microbatches``,
    ``args.iterations``, ``args.warmup``, ``args.timeout``, ``args.pp_emulate_nccl`` and
    ``args.seed``; ``args.emulate_trace`` (optional, no flag) also returns each rank's executed ops
    of the last step with their times (``trace`` in each row). A bad ``--emulate`` or
    ``--emulate-skew`` raises ``RequestError`` (naming the flag) before any process starts. Under torchrun or
    srun only rank 0 gets the results; the others get {}."""
    from .. import launch

    costs = parse_emulate(args.emulate, args.emulate_skew, args.pp)
    slices = getattr(args, "pp_seq_slices", DEFAULT_SLICES)
    jobs = [plan_job(name, args.pp, args.microbatches, costs, args.pp_emulate_nccl, slices) for name in names]
    settings = EmulateSettings(
        pp=args.pp,
        microbatches=args.microbatches,
        iterations=args.iterations,
        warmup=args.warmup,
        costs=costs,
        jobs=jobs,
        output="",  # run_for_results gives it a file
        timeout=args.timeout,
        emulate_nccl=bool(args.pp_emulate_nccl),
        seed=args.seed,
        trace=bool(getattr(args, "emulate_trace", False)),
        slices=slices,
    )
    text = launch.run_for_results(worker, args.pp, lambda path: dataclasses.replace(settings, output=path))
    if not text:  # another rank's process under torchrun/srun: rank 0 reports
        return {}
    return results_of(settings, json.loads(text))


def results_of(settings: EmulateSettings, measured: dict[str, Any]) -> dict[str, Any]:
    """The workers' measurements beside the simulator's predictions for the same costs."""
    latencies = measured["latency_per_pair_s"]
    latency = statistics.mean(latencies) if latencies else 0.0
    c = settings.costs
    completion = IN_ORDER_SYNC if settings.emulate_nccl else FREE

    def predict(job: EmulateJob, host: tuple[float, ...] = ()) -> SimResult:
        assert job.schedule is not None and job.lowered is not None
        costs = emulated_costs(job.schedule, c, latency, host)
        return replay(job.lowered, costs, job.schedule, completion=completion)

    rows = []
    for job, row in zip(settings.jobs, measured["rows"]):
        out: dict[str, Any] = {"schedule": job.name, "skip": row.get("skip")}
        if job.schedule is not None:
            out.update(vpp=job.schedule.vpp, slices=job.schedule.slices)
            predicted = predict(job)
            out["predicted_s"] = predicted.makespan
            out["predicted_bubble_rate"] = predicted.bubble_rate
        if out["skip"] is None:
            steps = row["steps_s"]
            measured_s = statistics.median(steps)
            host = tuple(row["host_per_op_s"])
            with_host = predict(job, host).makespan
            out.update(
                measured_s=measured_s,
                min_s=min(steps),
                max_s=max(steps),
                steps_s=steps,
                sim_error=measured_s / out["predicted_s"] - 1,
                host_per_op_s=list(host),
                predicted_with_host_s=with_host,
                host_error=measured_s / with_host - 1,
            )
            if "trace" in row:
                out["trace"] = row["trace"]
        rows.append(out)
    return {
        "mode": "emulate",
        "pp": settings.pp,
        "microbatches": settings.microbatches,
        "iterations": settings.iterations,
        "warmup": settings.warmup,
        "costs_ms": {"F": c.forward * 1e3, "B": c.backward * 1e3, "W": c.weight * 1e3},
        "skew": list(c.skew) if c.skew else None,
        "slices": settings.slices,
        "message_shape": list(settings.message_shape),
        "backend": measured["backend"],
        "emulate_nccl": settings.emulate_nccl,
        "completion": completion,
        "latency_s": latency,
        "latency_per_pair_s": latencies,
        "rows": rows,
    }


def format_emulate_table(results: dict[str, Any]) -> str:
    """A header line, then one row per schedule: the prediction, the measured median, its
    ``sim_error``, min and max; then the runner's host time per compute op (mean over ranks)
    and the error left once the prediction charges it (``host_error``)."""
    c = results["costs_ms"]
    skew = results.get("skew")
    lines = [
        f"emulated compute F,B,W = {c['F']:g},{c['B']:g},{c['W']:g} ms per microbatch and rank"
        + (f", skew {','.join(f'{s:g}' for s in skew)}" if skew else "")
        + f"; pp {results['pp']}, {results['microbatches']} microbatches, {results['iterations']} steps "
        f"after {results['warmup']} warm-up; {results['backend']}"
        + (" under NCCL emulation" if results.get("emulate_nccl") else "")
        + f"; p2p latency {results['latency_s'] * 1e6:.0f} us (measured, fed to the simulator)",
    ]
    header = (
        "schedule", "v", "k", "predicted s", "measured s", "sim_error", "min s", "max s",
        "host ms/op", "host_error",
    )  # fmt: skip
    table = [header]
    skipped = []
    for row in results["rows"]:
        if row.get("skip"):
            skipped.append(f"{row['schedule']}: skipped, {row['skip']}")
            continue
        host = row["host_per_op_s"]
        table.append(
            (
                row["schedule"],
                str(row["vpp"]),
                str(row["slices"]),
                f"{row['predicted_s']:.4f}",
                f"{row['measured_s']:.4f}",
                f"{row['sim_error']:+.1%}",
                f"{row['min_s']:.4f}",
                f"{row['max_s']:.4f}",
                f"{statistics.mean(host) * 1e3:.2f}",
                f"{row['host_error']:+.1%}",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines + skipped)
