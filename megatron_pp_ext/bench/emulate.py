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

Expert all-to-all and overlapped pairs. ``--pp-expert-comm T`` (milliseconds, as simulate's
flag) is the expert all-to-all of a whole microbatch's F and of its B on a rank (a stage's op
1/v of it, a BW's T as a B's), part of the op's duration (``UniformCosts.expert_comm``): an
unpaired F, B or BW sleeps its compute and its all-to-all in one, one after the other. The skew
scales the compute only. ``--overlap-moe-expert-parallel-comm`` runs every schedule twice, as
NAME and as NAME+pairs: the latter paired by ``pairing.pair`` at the emulated costs (those that
order the messages) before lowering. A pair runs as the runtime runs it on the host
(``runtime/expert_overlap.py``): each op's compute in two halves on the rank's thread and its
all-to-all in two halves on a communication thread of its own (:class:`CommThread`), in
megatron-core's combined 1F1B order, the rank waiting for an all-to-all only where its next
compute needs it (:meth:`EmulatedStep._overlap`). Ideally that lasts
max(kF, cB) + max(kB, cF) (k compute, c all-to-all of the F and the B), exactly the replay's
price of the pair (kF + kB + cF + cB less ``pairs.hidden_seconds``). Per paired row the results
give ``expert_comm_s``, the all-to-all seconds of one rank's step (the most of any rank: 2 m T
at uniform costs, all of it exposed unpaired), ``hidden_fraction`` = (unpaired measured - paired
measured) / ``expert_comm_s``, the share of it the pairs took off the step, beside
``predicted_hidden_fraction``, the same of the predictions; ``in_pairs_fraction``, the share
inside the pairs that the replay hides (on the rank that hides the most; short of 1 where the
pipeline's warm-up and cool-down leave ops unpaired); and ``pair_overlap``, of what the replay
hides inside the pairs the share the runner hid (the pairs' durations less their measured
windows, every rank over the timed steps): the overlap itself, apart from the schedule. Sliced
schedules are refused with the flag, as simulate refuses them.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..schedule import pairs
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
PAIR_FLAG = "--overlap-moe-expert-parallel-comm"
PAIRED = "+pairs"  # the job name's suffix for a schedule run with overlapped pairs


# ---- flags ------------------------------------------------------------------------------------


def add_emulate_arguments(parser: argparse.ArgumentParser) -> None:
    """``--emulate F,B,W``, ``--emulate-skew r0,r1,...``, ``--pp-expert-comm MS`` and
    ``--overlap-moe-expert-parallel-comm`` (attributes ``emulate``, ``emulate_skew``,
    ``pp_expert_comm``, ``overlap_moe_expert_parallel_comm``)."""
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
    parser.add_argument(
        "--pp-expert-comm",
        type=float,
        metavar="MS",
        help="with --emulate: the expert all-to-all time of a whole microbatch's forward (and of its "
        "backward) on a rank, in milliseconds, as simulate's flag: part of each F and B unless paired",
    )
    parser.add_argument(
        PAIR_FLAG,
        action="store_true",
        help="(Megatron's flag) each schedule also runs with its adjacent forwards and backwards "
        "paired (schedule/pairing.py), beside itself unpaired: with --emulate as NAME+pairs, each "
        "op's all-to-all on a communication thread beside the other's compute (bench/emulate.py); "
        "without, on a model with experts (bench/job.py)",
    )


@dataclass(frozen=True)
class EmulateCosts:
    """What ``--emulate``, ``--emulate-skew`` and ``--pp-expert-comm`` asked for, in seconds."""

    forward: float
    backward: float
    weight: float
    skew: tuple[float, ...] | None = None
    expert_comm: float = 0.0  # a whole microbatch's all-to-all per F and per B


def parse_emulate(
    text: str | None, skew_text: str | None, pp: int, expert_comm: float | None = None
) -> EmulateCosts:
    """Read the flags (``expert_comm``: ``--pp-expert-comm`` in milliseconds, None when not
    given); a bad value raises ``RequestError`` naming its flag."""
    if text is None:
        if skew_text is not None:
            raise RequestError("needs --emulate F,B,W", flag="--emulate-skew")
        if expert_comm is not None:
            raise RequestError("needs --emulate F,B,W", flag="--pp-expert-comm")
        raise RequestError("expected F,B,W in milliseconds, e.g. 20,20,20", flag="--emulate")
    if expert_comm is not None and not (math.isfinite(expert_comm) and expert_comm >= 0):
        raise RequestError(
            f"expected the all-to-all milliseconds per F and per B (>= 0), got {expert_comm}",
            flag="--pp-expert-comm",
        )
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
    return EmulateCosts(forward / 1e3, backward / 1e3, weight / 1e3, skew, (expert_comm or 0.0) / 1e3)


def _numbers(text: str) -> list[float] | None:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        return None
    return values if all(math.isfinite(v) for v in values) else None


# ---- costs ------------------------------------------------------------------------------------


@dataclass
class EmulatedCosts(UniformCosts):
    """:class:`UniformCosts` in seconds, each compute op's compute scaled by its rank's skew
    factor (its expert all-to-all, ``expert_comm_time``, is the network's and is not).
    ``rank_of_stage[s]`` is the rank of virtual stage s (the schedule's placement). ``overhead``
    (per rank, seconds): host time added to each compute op, for the prediction that charges
    the runner's measured per-op host time; the emulated ops themselves never include it."""

    skew: tuple[float, ...] = ()
    rank_of_stage: tuple[int, ...] = ()
    overhead: tuple[float, ...] = ()

    def duration(self, op: Op) -> float:
        comm = self.expert_comm_time(op)
        base = super().duration(op) - comm
        if op.kind in COMPUTE_KINDS:
            rank = self.rank_of_stage[op.stage]
            if self.skew:
                base *= self.skew[rank]
            if self.overhead:
                base += self.overhead[rank]
        return base + comm


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
        expert_comm=costs.expert_comm,
        skew=costs.skew or (),
        rank_of_stage=tuple(schedule.placement.rank_of(s) for s in range(schedule.num_stages)),
        overhead=tuple(overhead),
    )


# ---- the plan, decided before any process starts ----------------------------------------------


@dataclass
class EmulateJob:
    """One schedule to emulate: the lowered, validated op lists, or why not. A paired job's
    name is its schedule's with ``+pairs``; its schedule has ``meta["pairs"]``."""

    name: str
    schedule: Schedule | None = None
    lowered: Schedule | None = None
    skip: str | None = None
    paired: bool = False

    @property
    def base(self) -> str:
        """The schedule's name (without ``+pairs``)."""
        return self.name.removesuffix(PAIRED) if self.paired else self.name


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
    paired: bool = False,
) -> EmulateJob:
    """Generate, pair (``paired``: ``pairing.pair`` at the emulated costs) and lower ``name``
    (``slices`` slices for a sliced schedule, at least its minimum), or say why it is skipped.
    Pairs with slices raise ``RequestError`` naming the flag, as simulate refuses them."""
    job = EmulateJob(name + PAIRED if paired else name, paired=paired)
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
    # the pairs, and the messages in the order a replay at these costs sends them, as the
    # runtime orders them at its model's FLOP costs (schedule/run_costs.py): without skew or
    # latency, which no rank knows alike
    planning = emulated_costs(schedule, dataclasses.replace(costs, skew=None))
    if paired:
        schedule = paired_schedule(schedule, planning)
    lowered = lower(schedule, planning)
    if emulate_nccl:
        from ..schedule.nccl_check import check_nccl

        hang = check_nccl(lowered, strict=True, warmed=True)
        if hang is not None:
            job.skip = f"would hang under NCCL: {hang.message()}"
            return job
    validate(lowered)
    job.schedule, job.lowered = schedule, lowered
    return job


def paired_schedule(schedule: Schedule, costs: EmulatedCosts) -> Schedule:
    """``schedule`` with its overlapped pairs at ``costs``; what the pairs do not compose with
    yet (as simulate's ``paired`` and the runtime's ``check_pairing``) raises ``RequestError``."""
    from ..schedule import pairing

    if schedule.slices > 1:
        raise RequestError(
            f"not with sequence slices yet ({schedule.name} with {schedule.slices}): the pair's order "
            "does not place its ops; leave the sliced schedules out of --schedules",
            flag=PAIR_FLAG,
        )
    try:
        return pairing.pair(schedule, costs)
    except ValueError as error:  # vocabulary passes
        raise RequestError(str(error), flag=PAIR_FLAG) from None


def plan_jobs(args: argparse.Namespace, names: list[str], costs: EmulateCosts) -> list[EmulateJob]:
    """Each of ``names`` unpaired, and with ``--overlap-moe-expert-parallel-comm`` paired too
    (``NAME+pairs`` right after it). A sliced schedule among them is refused with the flag,
    before any is planned."""
    overlap = bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
    slices = getattr(args, "pp_seq_slices", DEFAULT_SLICES)
    sliced = [name for name in names if name in SCHEDULES and is_sliced_family(name)]
    if overlap and sliced:
        raise RequestError(
            f"not with sequence-sliced schedules yet ({', '.join(sliced)}): the pair's order does not "
            "place their ops; name the others with --schedules",
            flag=PAIR_FLAG,
        )
    return [
        plan_job(name, args.pp, args.microbatches, costs, args.pp_emulate_nccl, slices, paired)
        for name in names
        for paired in ((False, True) if overlap else (False,))
    ]


# ---- the worker -------------------------------------------------------------------------------


class EmulatedStep:
    """One step of one rank's lowered ops with emulated compute, using ``comm`` (a PipeComm)
    exactly as ``runtime/executor.py``'s ``_StepRun`` does (see the module docstring), and an
    overlapped pair as one unit (:meth:`_pair`, its all-to-alls on ``lane``).
    ``trace``: (op, start, compute start, compute end, end) of every op as it ran, in seconds
    from the step's start (the compute window is the emulated op's sleep, a pair's the whole
    unit, the same for both its ops; before it, the wait for its messages). After
    :meth:`execute`: ``compute_s`` (emulated compute), ``wait_s`` (blocked on peers: receives
    and the final flush, PipeComm's ``wait_seconds``), ``host_s``, the rest (the runner's and
    PipeComm's own CPU time, or waiting for a core), ``pairs_run``, and the pairs'
    ``pair_hidden_s`` (their ops' durations less their windows: the all-to-all they hid) beside
    ``pair_hideable_s`` (what the replay hides in them)."""

    def __init__(
        self,
        lowered: Schedule,
        rank: int,
        comm: Any,
        costs: EmulatedCosts,
        message_shape: tuple,
        sleeper: Sleeper | None = None,
        lane: CommThread | None = None,
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
        self.firsts = pairs.first_ops(lowered)[rank]
        self.lane = lane
        self._own_lane: CommThread | None = None
        self.pairs_run = 0
        self.pair_hidden_s = 0.0  # the pairs' serial time (both durations) less their windows
        self.pair_hideable_s = 0.0  # what the replay hides in them (pairs.hidden_seconds)

    def execute(self, start: float) -> None:
        clock = time.perf_counter
        waited = self.comm.wait_seconds
        ops = self.lowered.ranks[self.rank]
        position = 0
        while position < len(ops):
            group = self._group(ops, position)
            began = clock()
            self._window = (began, began)
            if len(group) == 2:
                self._pair(*group)
            else:
                self._run(group[0])
            self.comm.reap()
            computed, done = self._window
            self.compute_s += done - computed
            end = clock()
            for op in group:
                self.trace.append((format_op(op), began - start, computed - start, done - start, end - start))
            position += len(group)
        if self._own_lane is not None:
            self._own_lane.close()
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

    def _group(self, ops: list[Op], position: int) -> list[Op]:
        """The op at ``position``, or the pair it starts (its partner must follow it)."""
        op = ops[position]
        second = self.firsts.get(pairs.key_of(op)) if op.is_compute else None
        if second is None:
            return [op]
        if position + 1 >= len(ops) or pairs.key_of(ops[position + 1]) != second:
            raise RuntimeError(f"rank {self.rank}: {op} is paired with {second}, which does not follow it")
        return [op, ops[position + 1]]

    def _compute(self, op: Op) -> None:
        """An unpaired op: its compute and its all-to-all one after the other, one sleep."""
        self.compute_ops += 1
        began = time.perf_counter()
        self.sleeper.sleep(began, self.costs.duration(op))
        self._window = (began, time.perf_counter())

    def _pair(self, first: Op, second: Op) -> None:
        """An overlapped pair as the runtime runs it (``runtime/executor.py``'s ``_pair``): both
        inputs taken, the two ops as one unit (:meth:`_overlap`), both outputs handed on."""
        forward, backward = (first, second) if first.kind == OpKind.F else (second, first)
        if backward.stage < self.lowered.num_stages - 1:
            self._take("B", backward)
        if forward.stage > 0:
            self._take("F", forward)
        began = time.perf_counter()
        self._overlap(forward, backward)
        self._window = (began, time.perf_counter())
        self.compute_ops += 2
        self.pairs_run += 1
        serial = self.costs.duration(first) + self.costs.duration(second)
        self.pair_hidden_s += serial - (self._window[1] - began)
        self.pair_hideable_s += pairs.hidden_seconds(first, second, self.costs)
        if forward.stage < self.lowered.num_stages - 1:
            self._emit("F", forward.stage + 1, forward)
        if backward.stage > 0:
            self._emit("B", backward.stage - 1, backward)

    def _overlap(self, forward: Op, backward: Op) -> None:
        """One layer of megatron-core's combined 1F1B (``runtime/expert_overlap.py``'s
        ``_run_layers``): each op's compute in halves (attention, mlp) on this thread, its
        all-to-all in halves (dispatch, combine) on the lane's, each submitted once its input
        is ready and waited for only where the next compute needs it::

            lane: combine_bwd(B) | dispatch_fwd(F) | dispatch_bwd(B) | combine_fwd(F)
            here: attn_fwd(F)    | mlp_bwd(B)      | mlp_fwd(F)      | attn_bwd(B)

        It lasts max(kF, cB) + max(kB, cF) (k compute, c all-to-all): kF + kB + cF + cB less
        ``pairs.hidden_seconds``, the replay's price of the pair. Each piece is timed from when
        it could start (its input's end, as a stream's event orders it on a GPU), not from when
        its thread woke up to run it: the hand-over between two threads is the emulator's."""
        lane = self._lane()
        comm_f, comm_b = self.costs.expert_comm_time(forward), self.costs.expert_comm_time(backward)
        half_f = (self.costs.duration(forward) - comm_f) / 2
        half_b = (self.costs.duration(backward) - comm_b) / 2
        now = time.perf_counter()
        combine_b = lane.run(comm_b / 2, now)
        now = self._sleep(now, half_f)  # attention forward
        dispatch_f = lane.run(comm_f / 2, now)
        now = self._sleep(max(now, combine_b.result()), half_b)  # mlp backward
        dispatch_b = lane.run(comm_b / 2, now)
        now = self._sleep(max(now, dispatch_f.result()), half_f)  # mlp forward
        combine_f = lane.run(comm_f / 2, now)
        self._sleep(max(now, dispatch_b.result()), half_b)  # attention backward
        combine_f.result()

    def _sleep(self, began: float, seconds: float) -> float:
        """Compute from ``began`` for ``seconds``; when it ended."""
        self.sleeper.sleep(began, seconds)
        return time.perf_counter()

    def _lane(self) -> CommThread:
        if self.lane is None:  # a step run on its own: a lane of its own (run_job passes one per job)
            self.lane = self._own_lane = CommThread()
        return self.lane

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


class CommThread:
    """The all-to-all's own thread, as the runtime's ``CommLane`` on the host: one thread runs
    the submitted all-to-alls (sleeps, with their own :class:`Sleeper`) in submission order,
    each from when it is ready or the one before it ended, whichever is later."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-expert-comm")
        self.sleeper = Sleeper()
        self.ended = 0.0  # when the last all-to-all ended (perf_counter)

    def run(self, seconds: float, ready: float) -> Future:
        """An all-to-all of ``seconds`` whose input is ready at ``ready``; a future of when it
        ended (``ready`` at once when it takes no time)."""
        if seconds <= 0:
            done: Future = Future()
            done.set_result(ready)
            return done
        return self.pool.submit(self._sleep, seconds, ready)

    def _sleep(self, seconds: float, ready: float) -> float:
        self.sleeper.sleep(max(ready, self.ended), seconds)
        self.ended = time.perf_counter()
        return self.ended

    def close(self) -> None:
        self.pool.shutdown(wait=True)


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
    """Warm-up and timed steps of one schedule on this rank; (its row, whether a step failed).
    A paired job's all-to-alls run on one communication thread for all its steps."""
    assert job.lowered is not None
    costs = emulated_costs(job.lowered, settings.costs)
    creation = comm.creation
    creation.warm_up(creation.pairs_of(job.lowered))  # as the runtime, before the first step
    lane = CommThread() if job.paired else None
    try:
        return _timed_steps(job, comm, settings, costs, lane)
    finally:
        if lane is not None:
            lane.close()


def _timed_steps(
    job: EmulateJob, comm: Any, settings: EmulateSettings, costs: EmulatedCosts, lane: CommThread | None
) -> tuple[dict[str, Any], bool]:
    import torch.distributed as dist

    from .. import launch

    assert job.lowered is not None
    times: list[float] = []
    host: list[float] = []  # this rank's host seconds per timed step
    hidden = [0.0, 0.0]  # this rank's pairs over the timed steps: hid, and the replay's to hide
    step: EmulatedStep | None = None
    sleeper = Sleeper()
    for iteration in range(settings.warmup + settings.iterations):
        error = None
        step = EmulatedStep(job.lowered, comm.rank, comm, costs, settings.message_shape, sleeper, lane)
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
            hidden = [hidden[0] + step.pair_hidden_s, hidden[1] + step.pair_hideable_s]
    assert step is not None
    per_op = statistics.median(host) / step.compute_ops if host and step.compute_ops else 0.0
    row: dict[str, Any] = {
        "schedule": job.name,
        "skip": None,
        "steps_s": times,
        "host_per_op_s": launch.gather_objects(per_op),
        "pairs_run": launch.gather_objects(step.pairs_run),  # per rank, in the last step
        "pair_hidden_s": launch.gather_objects(tuple(hidden)),  # per rank: (hid, to hide)
    }
    if settings.trace:
        row["trace"] = launch.gather_objects(step.trace)  # every rank's ops of the last step, as executed
    return row, False


# ---- the command's side -----------------------------------------------------------------------


def run_emulate(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """Emulate ``names`` on ``args.pp`` processes and predict each; the results as plain data.

    Reads ``args.emulate``, ``args.emulate_skew``, ``args.pp``, ``args.microbatches``,
    ``args.iterations``, ``args.warmup``, ``args.timeout``, ``args.pp_emulate_nccl`` and
    ``args.seed``; optional: ``args.pp_expert_comm``, ``args.overlap_moe_expert_parallel_comm``,
    ``args.pp_seq_slices`` and ``args.emulate_trace`` (no flag: also return each rank's executed
    ops of the last step with their times, ``trace`` in each row). A bad flag raises
    ``RequestError`` (naming it) before any process starts. Under torchrun or srun only rank 0
    gets the results; the others get {}."""
    from .. import launch

    costs = parse_emulate(args.emulate, args.emulate_skew, args.pp, getattr(args, "pp_expert_comm", None))
    slices = getattr(args, "pp_seq_slices", DEFAULT_SLICES)
    jobs = plan_jobs(args, names, costs)
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
            if "pairs_run" in row:
                out["pairs_run"] = row["pairs_run"]
            if job.paired and "pair_hidden_s" in row:
                out["pair_overlap"] = pair_overlap(row["pair_hidden_s"])
        if job.schedule is not None:
            out.update(pair_figures(job, emulated_costs(job.schedule, c)))
        rows.append(out)
    add_hidden_fractions(settings.jobs, rows)
    return {
        "mode": "emulate",
        "pp": settings.pp,
        "microbatches": settings.microbatches,
        "iterations": settings.iterations,
        "warmup": settings.warmup,
        "costs_ms": {"F": c.forward * 1e3, "B": c.backward * 1e3, "W": c.weight * 1e3},
        "expert_comm_ms": c.expert_comm * 1e3,
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


def pair_figures(job: EmulateJob, costs: EmulatedCosts) -> dict[str, Any]:
    """``pairs`` (the job's pair count), ``expert_comm_s`` (the all-to-all seconds of one rank's
    step, the most of any rank: what the unpaired step exposes, 2 m T at uniform costs) and, for
    a paired job, ``in_pairs_fraction``: the share of that which the replay hides inside the
    pairs (``pairs.hidden_seconds`` summed on the rank that hides the most): short of 1 where
    the warm-up and cool-down leave ops unpaired."""
    assert job.schedule is not None and job.lowered is not None
    comm = max(sum(costs.expert_comm_time(op) for op in ops if op.is_compute) for ops in job.schedule.ranks)
    figures: dict[str, Any] = {"pairs": pairs.count(job.lowered), "expert_comm_s": comm}
    if job.paired:
        hidden = [0.0] * job.lowered.pp
        for rank, first, second in pairs.iter_pairs(job.lowered):
            hidden[rank] += pairs.hidden_seconds(pairs.op_of(first), pairs.op_of(second), costs)
        figures["in_pairs_fraction"] = max(hidden) / comm if comm > 0 else None
    return figures


def pair_overlap(per_rank: list[tuple[float, float]]) -> float | None:
    """Of the all-to-all the replay hides inside the pairs, the share the runner hid (every
    rank's pairs over the timed steps; 1.0: each pair took what the replay prices it at)."""
    hid, hideable = (sum(values) for values in zip(*per_rank)) if per_rank else (0.0, 0.0)
    return hid / hideable if hideable > 0 else None


def add_hidden_fractions(jobs: list[EmulateJob], rows: list[dict[str, Any]]) -> None:
    """Each measured paired row against its unpaired row of the same run: ``hidden_fraction`` =
    (unpaired measured - paired measured) / ``expert_comm_s``, the share of a rank's all-to-all
    the pairs took off the step; ``predicted_hidden_fraction`` the same of the predictions."""
    unpaired = {job.name: row for job, row in zip(jobs, rows) if not job.paired}
    for job, row in zip(jobs, rows):
        alone = unpaired.get(job.base)
        if not job.paired or alone is None or row.get("skip") or alone.get("skip"):
            continue
        comm = row["expert_comm_s"]
        for key, value in (("hidden_fraction", "measured_s"), ("predicted_hidden_fraction", "predicted_s")):
            row[key] = (alone[value] - row[value]) / comm if comm > 0 else None


def format_emulate_table(results: dict[str, Any]) -> str:
    """A header line, then one row per schedule: the prediction, the measured median, its
    ``sim_error``, min and max; then the runner's host time per compute op (mean over ranks)
    and the error left once the prediction charges it (``host_error``); with overlapped pairs
    also each row's pair count, and for a paired row its hidden fractions (measured, predicted;
    :func:`add_hidden_fractions`), the share of the all-to-all inside its pairs
    (:func:`pair_figures`) and the share of that the runner hid (:func:`pair_overlap`)."""
    paired = any(row.get("pairs") for row in results["rows"])
    header = (
        "schedule", "v", "k", "predicted s", "measured s", "sim_error", "min s", "max s",
        "host ms/op", "host_error",
    )  # fmt: skip
    if paired:
        header += ("pairs", "hidden", "predicted hidden", "in pairs", "pair overlap")
    table = [header]
    skipped = []
    for row in results["rows"]:
        if row.get("skip"):
            skipped.append(f"{row['schedule']}: skipped, {row['skip']}")
            continue
        table.append(_cells(row) + (_pair_cells(row) if paired else ()))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [_headline(results)]
    for r in table:
        cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines + skipped)


def _headline(results: dict[str, Any]) -> str:
    c = results["costs_ms"]
    skew = results.get("skew")
    expert = results.get("expert_comm_ms") or 0.0
    return (
        f"emulated compute F,B,W = {c['F']:g},{c['B']:g},{c['W']:g} ms per microbatch and rank"
        + (f", skew {','.join(f'{s:g}' for s in skew)}" if skew else "")
        + (f", expert all-to-all {expert:g} ms per F and per B" if expert else "")
        + f"; pp {results['pp']}, {results['microbatches']} microbatches, {results['iterations']} steps "
        f"after {results['warmup']} warm-up; {results['backend']}"
        + (" under NCCL emulation" if results.get("emulate_nccl") else "")
        + f"; p2p latency {results['latency_s'] * 1e6:.0f} us (measured, fed to the simulator)"
    )


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    host = row["host_per_op_s"]
    return (
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


def _pair_cells(row: dict[str, Any]) -> tuple[str, ...]:
    def share(key: str) -> str:
        value = row.get(key)
        return "" if value is None else f"{value:.0%}"

    return (
        str(row.get("pairs", 0)),
        share("hidden_fraction"),
        share("predicted_hidden_fraction"),
        share("in_pairs_fraction"),
        share("pair_overlap"),
    )
