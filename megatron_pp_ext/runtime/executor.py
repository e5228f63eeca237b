"""The executor: runs one rank's lowered op list on its model chunks.

:class:`PipelineRuntime` is built once per pipeline rank (it creates the p2p groups) and runs
one training step per :meth:`PipelineRuntime.step`, in the shape of Megatron's
``forward_backward_func``: the user's ``forward_step_func``, one data iterator per chunk,
``num_microbatches``, ``forward_only``; it returns the per-microbatch loss dicts on the rank that
holds the last virtual stage (rank 0 for V-shape schedules) and an empty list elsewhere.

Ops run strictly in list order. F/B/W/BW run on the chunk of their stage; RECV ops post their
receive (lowering puts them in the step's global message order, ``schedule/message_order.py``)
and the op that needs the tensor waits for it (with a deadline, see ``p2p.py``); SEND ops are
asynchronous and release the stage output's storage
once sent (Megatron's ``deallocate_output_tensor``). Two consecutive stages on the same rank (the
tip of a V) hand over in memory. Weight gradients land in ``param.grad`` (or ``main_grad``);
zeroing them, finalising them (``finalize_model_grads``) and the optimizer step are the caller's.
OFFLOAD/RELOAD ops move a unit's saved activations to host memory and back (``offload.py``;
``runtime.offload`` is the engine, with its host pool).
Schedules with sequence slices cut each microbatch as ``slicing.py`` says: the chunks need sliced
attention (``build_chunks(..., sliced=True)``), messages have the slice's shape. With
``attn_redistribution`` > 0 heavy slices hand their oldest K/V to a partner rank
(``redistribution.py``). Chunks wrapped in megatron-core's DDP are driven through the model
config's ``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func`` (``grad_sync.py``); under
sequence parallelism messages carry this rank's 1/TP of the sequence, under context parallelism
its 1/CP (its two pieces of every slice, ``attention/cp_layout.py``), and the loss of a sequence
is normalised over its tokens on all CP ranks (``context_parallel.py``).

Levels: :meth:`PipelineRuntime.step` (checks, plan, the validation gate's restart), then
``_attempt`` (one run: runners, slices, the step's features), then :meth:`_StepRun.execute` (the
op loop), then ``_dispatch`` (one op). The per-step features (the validation gate, vocabulary
parallelism, gradient sync, offload, attention redistribution, slices, and the step's own
messages and stages) are collaborators, not branches of the loop: each is a ``StepFeature``
(``step_feature.py``: begin, before an op, after an op, finish, discard; the adapters are in
``features.py``), and ``_StepRun.features`` lists the ones the lowered schedule needs.

Overlapped pairs (``schedule/pairing.py``, ``meta["pairs"]``): the lowered list has the two ops
of a pair next to each other; the loop calls the features before both, runs them as one unit
(``_StepRun._pair``: the B begun, the F's plan forward with the B's plan backward beside it,
``expert_overlap.py``), then calls the features after both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config
from torch import Tensor

from ..schedule.gate import ValidationGate, gate_at_start, validation_gate
from ..schedule.ir import Op, OpKind, Schedule
from ..schedule.lowering import lower
from ..schedule.message_order import order_messages
from ..schedule.models import megatron_shape
from ..schedule.nccl_check import check_nccl
from ..schedule.pairs import first_ops, key_of
from ..schedule.validate import validate, weight_order_error
from . import sized_messages
from .context_parallel import check_cp_slices, context_parallel_group, cp_size_of
from .creation import Communicator
from .expert_overlap import CommLane, check_pairing
from .experts import expert_groups
from .features import (
    GateFeature,
    GradSyncFeature,
    OffloadFeature,
    RedistributionFeature,
    Restart,
    SlicingFeature,
    VocabFeature,
)
from .forward_contract import ForwardCall, check_first_val_step, checkpoint_argument, in_flight_limits, timed
from .grad_sync import GradSync
from .memory import ActivationMeter, Hold
from .offload import OffloadEngine, OffloadStats
from .p2p import PipeComm, PostedRecv
from .redistribution import AttentionCounts, Plan, Redistribution, StepRedistribution
from .slicing import SliceFn, StepSlicing, check_sliced_moe, plan_slices
from .stage import ForwardStepFunc, LossRecord, PendingBackward, StageRunner, deallocate
from .step_feature import OpFailure, PipelineError, StepFeature
from .timeline import OpRanges, StepTimeline, TimelineRecorder
from .vocab_ops import FORWARD_KINDS as VOCAB_FORWARD_KINDS
from .vocab_ops import VocabSetup, VocabStep
from .weight_grad import WeightGradStore

ShapeFn = Callable[[Op], Sequence[int]]


@dataclass
class StepResult:
    """One step of one rank. ``losses``: Megatron's forward_data_store (loss dicts in
    microbatch order) on the loss rank, empty elsewhere."""

    losses: list[Any]
    num_tokens: int | Tensor
    is_loss_rank: bool
    peak_activation_bytes: int | None  # None when the runtime does not measure memory
    peak_memory_allocated: int | None = None  # torch.cuda.max_memory_allocated on GPU
    op_count: dict[str, int] = field(default_factory=dict)
    offload: OffloadStats | None = None  # what the activation copies did, when the schedule has any
    attention: AttentionCounts | None = None  # attention computed and moved (sliced schedules)
    restarted: bool = False  # post-validation rolled the previous step back: the ops ran twice
    pairs: int = 0  # overlapped pairs run (each an F and a B as one unit)


@dataclass(frozen=True)
class _StepArgs:
    """What one :meth:`PipelineRuntime.step` runs, for each of its attempts."""

    schedule: Schedule
    lowered: Schedule
    forward_step_func: ForwardStepFunc
    forward_only: bool
    collect_non_loss_data: bool
    tensor_shape: Sequence[int] | ShapeFn | None
    slice_lengths: tuple[int, ...]  # empty for a whole-sequence schedule
    slice_batch: SliceFn | None
    vocab_parallel: bool
    plan: Plan  # SlimPipe's attention delegations (empty without)
    first_val_step: bool | None = None  # Megatron's: FP8 weight refresh in forward-only steps
    # microbatches in flight per stage of this rank (partial activation checkpoints; empty without)
    in_flight: dict[int, int] = field(default_factory=dict)
    variable_shapes: bool = False  # config.variable_seq_lengths: messages carry their shape
    paired: bool = False  # overlapped pairs (schedule/pairing.py): run through the schedule plan


class _Replay:
    """The step's data iterators, keeping what they hand out so a restart reads it again."""

    def __init__(self, iterators: Sequence[Iterator[Any] | None]) -> None:
        self._sources = list(iterators)
        self._taken: list[list[Any]] = [[] for _ in self._sources]
        self.iterators: list[Iterator[Any] | None] = [
            None if source is None else self._record(index) for index, source in enumerate(self._sources)
        ]

    def _record(self, index: int) -> Iterator[Any]:
        for item in self._sources[index]:
            self._taken[index].append(item)
            yield item

    def rewind(self) -> None:
        self.iterators = [
            None if source is None else itertools.chain(taken, source)
            for source, taken in zip(self._sources, self._taken)
        ]


def prepare(schedule: Schedule, forward_only: bool = False, exchanges: Plan | None = None) -> Schedule:
    """The lowered, validated schedule the executor runs (forward ops only if ``forward_only``),
    its messages in the order that also places SlimPipe's attention ``exchanges`` (the plan of
    the schedule as run: ``forward_part`` of it if ``forward_only``)."""
    lowered = lower(schedule)
    validate(lowered)
    if forward_only:
        lowered = forward_part(lowered)
    if exchanges:
        lowered = order_messages(lowered, exchanges=exchanges)
        hang = check_nccl(lowered, strict=True, warmed=True, delegations=exchanges)
        if hang is not None:  # the message order is built not to: a bug, named before any step
            raise ValueError(
                f"--pp-attn-redistribution: {schedule.name} with its attention exchanges would hang "
                f"under NCCL: {hang.message()}; set --pp-attn-redistribution 0"
            )
    return lowered


def forward_part(schedule: Schedule) -> Schedule:
    """The forward ops of ``schedule`` (lowered or not). Forwards depend only on forwards, so
    dropping every backward op keeps a valid execution order and the order of every forward
    channel."""
    keep = (OpKind.F, OpKind.SEND_F, OpKind.RECV_F, *VOCAB_FORWARD_KINDS)
    return schedule.with_ranks([[op for op in ops if op.kind in keep] for ops in schedule.ranks])


class PipelineRuntime:
    """Executes schedules on this rank's model chunks.

    ``chunks[i]`` is this rank's i-th model chunk, i.e. the virtual stage ``s`` with
    ``placement.chunk_index(s) == i``. ``tensor_shape`` is the activation shape passed between
    stages (Megatron's ``(seq_length, micro_batch_size, hidden_size)``), or a function of the
    RECV op for schedules whose messages differ in shape. ``config`` is the chunks'
    TransformerConfig (``calculate_per_token_loss``, ``grad_scale_func``). ``attn_redistribution``
    is SlimPipe's cap on the attention a heavy slice hands to a partner (0..1, 0 off; sliced
    schedules only). ``vocab``: this rank's vocabulary-parallel setup
    (``vocab_ops.setup_vocab_parallel``), needed by schedules with vocabulary ops.
    ``deallocate_outputs``: free a stage output's storage once sent (Megatron's
    ``deallocate_output_tensor``); None: as ``config.deallocate_pipeline_outputs``. ``cp_group``:
    the context-parallel group where Megatron's parallel state has none (a ``pg_collection``)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        comm: PipeComm,
        tensor_shape: Sequence[int] | ShapeFn,
        dtype: torch.dtype,
        config: Any = None,
        deallocate_outputs: bool | None = None,
        attn_redistribution: float = 0.0,
        vocab: VocabSetup | None = None,
        warm_up: bool = True,
        measure_memory: bool = True,
        cp_group: Any = None,
    ) -> None:
        self.chunks = list(chunks)
        # count activation bytes (StepResult.peak_activation_bytes); off, the step pays nothing
        # for it (no saved-tensor hooks) and reports None
        self.measure_memory = measure_memory
        # create every communicator of a schedule before its first step, in one global order
        # (creation.py); off only to show what a lazy creation order does under --pp-emulate-nccl
        self.warm_up = warm_up
        self._warmed: set[tuple[int, int]] = set()  # (id of a prepared schedule, attention links)
        self.vocab = vocab
        if vocab is not None:
            vocab.vp.launch = comm.launch  # its step collectives queue with the p2p (launch_order.py)
        self.comm = comm
        self.rank = comm.rank
        self.shape_of = _shape_fn(tensor_shape)
        self.dtype = dtype
        self.config = config if config is not None else get_model_config(self.chunks[0])
        # Megatron frees a sent stage output's storage only under deallocate_pipeline_outputs
        # (Megatron-LM always sets it; train's models too)
        if deallocate_outputs is None:
            deallocate_outputs = bool(getattr(self.config, "deallocate_pipeline_outputs", False))
        self.deallocate_outputs = deallocate_outputs
        self.tensor_shape = tensor_shape
        self.device = next(self.chunks[0].parameters()).device
        self.stores = [WeightGradStore() for _ in self.chunks]
        _check_parallel_state(comm.size)
        # Under sequence (context) parallelism a message holds this rank's 1/TP (1/CP) of the sequence.
        self.sequence_share = _sequence_share(self.config)
        self.cp_group = context_parallel_group(self.config, cp_group)
        self.meter = ActivationMeter(enabled=measure_memory)
        self.offload = OffloadEngine(self.device)
        self.last_result: StepResult | None = None
        self._prepared: dict[tuple[str, bool], Schedule] = {}  # validated once per schedule
        self._gates: dict[tuple[str, bool], ValidationGate] = {}  # post-validation gates, once each
        self._in_flight: dict[tuple, dict[int, int]] = {}  # partial activation checkpoints, once each
        self.redistribution = Redistribution(comm, attn_redistribution, self.chunks)
        self._lane: CommLane | None = None  # overlapped pairs' all-to-alls, made at the first pair
        # --pp-timeline: which steps to record (runtime/timeline.py); None records nothing
        self.timeline: TimelineRecorder | None = None
        self._recording: StepTimeline | None = None  # this step's, when recorded
        # Megatron's --profile / --use-pytorch-profiler: every op a named range (timeline.py)
        self.op_ranges = False

    def lane(self) -> CommLane:
        """Where overlapped pairs run their communication nodes (a thread of its own on the host)."""
        if self._lane is None:  # on the host the plan needs the adapter's cpu_shim.install()
            self._lane = CommLane(on_host=self.device.type != "cuda", timeout_s=self.comm.timeout_s)
        return self._lane

    # ------------------------------------------------------------------------------------------

    def step(
        self,
        schedule: Schedule,
        forward_step_func: ForwardStepFunc,
        data_iterators: Sequence[Iterator[Any] | None] | Iterator[Any] | None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        tensor_shape: Sequence[int] | ShapeFn | None = None,
        slice_lengths: Sequence[int] | None = None,
        slice_batch: SliceFn | None = None,
        gate: Callable[[], bool] | None = None,
        first_val_step: bool | None = None,
    ) -> StepResult:
        """Run ``schedule`` (lowered here if it is not) for this rank: one training step (or a
        forward-only pass) over ``schedule.microbatches`` microbatches. ``tensor_shape``
        overrides the activation shape given at construction, for this step.

        With ``schedule.slices > 1``: ``slice_lengths`` (default: the schedule's partition of the
        sequence length of ``tensor_shape``) and ``slice_batch(batch, start, end, seq_length)``,
        which cuts a whole microbatch from the iterators to one slice (default:
        ``slicing.slice_batch``).

        ``gate`` (optimizer post-validation): called once, at this rank's validation gate
        (``schedule/gate.py``: before its first op that is not a forward), to settle the previous
        optimizer step. False means that step was redone: the forwards run so far used the
        weights it rolled back, so the step restarts from its first op with the same data (and
        RNG state), after dropping the messages in flight at the gate. Steps whose setup
        communicates or moves state (vocabulary parallelism, attention redistribution, offload)
        and forward-only steps take the gate before their first op.

        ``first_val_step``: Megatron's, for forward-only steps (whether their first microbatch
        refreshes Transformer Engine's FP8 weights; ``forward_contract.py``)."""
        if schedule.pp != self.comm.size:
            raise ValueError(
                f"schedule {schedule.name} has pp={schedule.pp}, the pipeline has {self.comm.size} ranks"
            )
        lengths = self._slice_lengths(schedule, tensor_shape, slice_lengths)
        if schedule.slices > 1:
            check_sliced_moe(self.config, schedule)
        paired = any(schedule.meta.get("pairs") or []) and not forward_only  # a pair on any rank
        if paired:
            check_pairing(self.config, schedule, self.chunks, forward_step_func)
        # SlimPipe's plan for the schedule as run (collective the first time), and the message
        # order that places its attention exchanges
        as_run = forward_part(schedule) if forward_only else schedule
        plan = self.redistribution.plan(as_run, lengths) if lengths else {}
        key = (schedule.to_json(), forward_only, lengths if plan else ())
        if key not in self._prepared:
            self._prepared[key] = prepare(schedule, forward_only, plan)
        lowered = self._prepared[key]
        stages = lowered.placement.stages_of(self.rank)
        if len(stages) != len(self.chunks):
            raise ValueError(
                f"rank {self.rank} holds stages {stages} under {schedule.name} "
                f"but was given {len(self.chunks)} chunks"
            )
        iterators = self._iterators(data_iterators)
        _check_forward_order(lowered, self.rank)
        vocab_parallel = schedule.vocab_parallel != "none"  # the lowered forward-only one has no T
        if vocab_parallel and self.vocab is None:
            raise ValueError(
                f"schedule {schedule.name} has {schedule.vocab_parallel} ops: build the PipelineRuntime "
                "with vocab=setup_vocab_parallel(...)"
            )
        if vocab_parallel and self.vocab is not None and self.vocab.variant != schedule.vocab_parallel:
            raise ValueError(
                f"schedule {schedule.name} is {schedule.vocab_parallel}, the chunks were set up for "
                f"{self.vocab.variant}"
            )

        variable = bool(getattr(self.config, "variable_seq_lengths", False))
        if variable:
            _check_variable_shapes(schedule, self.redistribution.cap)
        partial = getattr(self.config, "num_microbatches_with_partial_activation_checkpoints", None)
        step = _StepArgs(
            schedule,
            lowered,
            forward_step_func,
            forward_only,
            collect_non_loss_data,
            tensor_shape,
            lengths,
            slice_batch,
            vocab_parallel,
            plan,
            first_val_step,
            {} if partial is None else self._in_flight_limits(key, schedule),
            variable,
            paired,
        )
        self._recording = self.timeline.step_feature(self, forward_only) if self.timeline else None
        result = self._run(step, key, iterators, gate)
        if self.timeline is not None:
            self.timeline.step_done(self, lowered, forward_only)
        return result

    def _run(
        self,
        step: _StepArgs,
        key: tuple,
        iterators: list[Iterator[Any] | None],
        gate: Callable[[], bool] | None,
    ) -> StepResult:
        """The step's attempts: one, or two when the validation gate finds the previous
        optimizer step redone (the forwards before the gate run again)."""
        lowered, forward_only = step.lowered, step.forward_only
        gate_at, in_flight = 0, []
        at_start = forward_only or gate_at_start(lowered, bool(self.redistribution.cap))
        if gate is not None and not at_start:
            cut = self._gate(key, lowered)
            gate_at, in_flight = cut.positions[self.rank], cut.in_flight[self.rank]
        if gate is None or gate_at == 0:
            # nothing has run yet; if the previous step was redone, the peers restart theirs and
            # send again what they sent before their gates
            kept = gate() if gate is not None else True
            return self._attempt(step, iterators, drain=() if kept else in_flight)
        replay = _Replay(iterators)
        try:
            return self._attempt(step, replay.iterators, gate=(gate, gate_at))
        except Restart:
            replay.rewind()
            result = self._attempt(step, replay.iterators, drain=in_flight)
            result.restarted = True
            return result

    def _in_flight_limits(self, key: tuple, schedule: Schedule) -> dict[int, int]:
        """This rank's microbatches in flight per stage under ``schedule`` with its backwards
        (also for a forward-only step, as Megatron's 1F1B counts them), once per prepared key."""
        if key not in self._in_flight:
            self._in_flight[key] = in_flight_limits(lower(schedule), self.rank)
        return self._in_flight[key]

    def _communicators(self, lowered: Schedule, vocab_parallel: bool) -> list[Communicator]:
        """Every communicator a step of ``lowered`` talks over: the pairs of its SEND/RECV ops,
        the vocabulary channels, Megatron's CP group, the expert groups of MoE layers
        (``experts.py``) and the attention-redistribution links."""
        creation = self.comm.creation
        found = creation.pairs_of(lowered)
        if vocab_parallel and self.vocab is not None:
            found += [creation.group(f"vocab-{name}", group) for name, group in self.vocab.vp.groups.named()]
        if self.cp_group is not None:
            found.append(creation.group("context-parallel", self.cp_group))
        found += [creation.group(name, group) for name, group in expert_groups(self.config)]
        for (source, partner), group in self.redistribution.links().items():
            found.append(creation.link(source, partner, group))
        return found

    def _gate(self, key: tuple[str, bool], lowered: Schedule) -> ValidationGate:
        """The validation gates of a prepared schedule (``key`` as in ``_prepared``), once."""
        if key not in self._gates:
            self._gates[key] = validation_gate(lowered)
        return self._gates[key]

    def _attempt(
        self,
        step: _StepArgs,
        iterators: list[Iterator[Any] | None],
        gate: tuple[Callable[[], bool], int] | None = None,
        drain: Sequence[Op] = (),
    ) -> StepResult:
        """One run of the step's ops. ``gate``: (settle, position), raising :class:`Restart` when
        the forwards run before it must run again. ``drain``: RECV ops whose messages, sent by
        peers before a restart, are taken off their channels and dropped first."""
        lowered = step.lowered
        offload = self._begin_measuring(lowered)
        runners = self._runners(lowered, offload, step.vocab_parallel, step.paired)
        slicing, iterators, shape_of = self._slicing(step, iterators)
        self._warm_up_once(lowered, step.vocab_parallel)
        redistribution = None
        if slicing is not None:
            redistribution = self.redistribution.begin(step.plan, slicing.contexts, lowered.placement)
        sync = self._grad_sync(step)
        run = _StepRun(self, step, runners, iterators, shape_of, slicing)
        features = run.features(sync, offload, redistribution, gate)
        if self._recording is not None:  # the same recorder for a restarted attempt: it starts over
            features.append(self._recording)
        if self.op_ranges:
            features.append(OpRanges(self.device.type == "cuda"))
        try:
            for op in drain:
                run.drop_message(op)
            run.execute(features)
        except BaseException as error:
            for feature in reversed(features):
                feature.discard(error)
            raise
        attention = None if redistribution is None else redistribution.counts  # finished
        self.last_result = self._result(run, offload, attention)
        return self.last_result

    def _begin_measuring(self, lowered: Schedule) -> OffloadEngine | None:
        """A fresh activation meter (and peak of device memory) for the attempt; the offload
        engine, armed if this rank's ops offload (None if they do not)."""
        self.meter = ActivationMeter(enabled=self.measure_memory)
        for chunk in self.chunks:
            self.meter.exclude(chunk.parameters())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        params = [param for chunk in self.chunks for param in chunk.parameters()]
        return self.offload if self.offload.begin(self.meter, lowered.ranks[self.rank], params) else None

    def _warm_up_once(self, lowered: Schedule, vocab_parallel: bool) -> None:
        """Create every communicator of ``lowered`` before its first step (``creation.py``)."""
        warmed = (id(lowered), len(self.redistribution.links()))
        if self.warm_up and warmed not in self._warmed:
            communicators = self._communicators(lowered, vocab_parallel)
            self.comm.creation.warm_up(communicators, lowered.comm_digest())
            self._warmed.add(warmed)

    def _grad_sync(self, step: _StepArgs) -> GradSync:
        """Megatron's DDP calls for the attempt; the vocabulary shards' chunk syncs at the end."""
        late = [self.vocab.chunk_index] if step.vocab_parallel and self.vocab is not None else ()
        lowered = step.lowered
        chunk_of = lowered.placement.chunk_index
        return GradSync(self.config, self.chunks, lowered.ranks[self.rank], chunk_of, step.forward_only, late)

    def _runners(
        self, lowered: Schedule, offload: OffloadEngine | None, vocab_parallel: bool, paired: bool
    ) -> dict[int, StageRunner]:
        """A StageRunner per stage of this rank, for one attempt (through megatron-core's
        schedule plan when the step has overlapped pairs)."""
        lane = self.lane() if paired else None
        deferring = {op.stage for op in lowered.ranks[self.rank] if op.kind in (OpKind.B, OpKind.W)}
        runners = {
            stage: StageRunner(
                self.chunks[lowered.placement.chunk_index(stage)],
                stage,
                lowered.num_stages,
                self.config,
                self.meter,
                # the weight-gradient store only where this rank's ops defer W for the stage
                self.stores[lowered.placement.chunk_index(stage)] if stage in deferring else None,
                num_slices=lowered.slices,
                offload=offload,
                cp_group=self.cp_group,
                vocab_parallel=vocab_parallel,
                lane=lane,
            )
            for stage in lowered.placement.stages_of(self.rank)
        }
        if any(runner.store is not None and runner.store.te for runner in runners.values()):
            error = weight_order_error(lowered)  # before the step, not at its first W
            if error is not None:
                raise ValueError(
                    f"{lowered.name}: {error}; Transformer Engine computes deferred weight gradients "
                    "first in, first out: use a schedule that orders each stage's W like its B, or "
                    "--transformer-impl local"
                )
        return runners

    def _slicing(
        self, step: _StepArgs, iterators: list[Iterator[Any] | None]
    ) -> tuple[StepSlicing | None, list[Iterator[Any] | None], ShapeFn]:
        """The step's slices (None for a whole-sequence schedule), the iterators its forwards
        read (the slices' feeders) and the shape of its messages."""
        shape_of = self.shape_of if step.tensor_shape is None else _shape_fn(step.tensor_shape)
        if not step.slice_lengths:
            return None, iterators, shape_of
        full = self.tensor_shape if step.tensor_shape is None else step.tensor_shape
        slicing = StepSlicing(step.slice_lengths, self.chunks, iterators, step.slice_batch)
        return slicing, slicing.feeders, shape_of if callable(full) else slicing.shape_fn(full)

    def _result(
        self, run: _StepRun, offload: OffloadEngine | None, attention: AttentionCounts | None
    ) -> StepResult:
        return StepResult(
            losses=[run.losses.outputs[mb] for mb in sorted(run.losses.outputs)],
            num_tokens=run.losses.num_tokens,
            is_loss_rank=run.schedule.loss_rank == self.rank,
            peak_activation_bytes=self.meter.peak,
            peak_memory_allocated=torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else None,
            op_count=run.op_count,
            pairs=run.pairs,
            offload=None if offload is None else offload.stats,
            attention=attention,
        )

    def _slice_lengths(
        self, schedule: Schedule, tensor_shape: Sequence[int] | ShapeFn | None, lengths: Sequence[int] | None
    ) -> tuple[int, ...]:
        """The step's slice lengths (empty for a whole-sequence schedule): ``lengths``, or the
        schedule's partition of the activation shape's sequence."""
        if schedule.slices < 2:
            return ()
        full_shape = self.tensor_shape if tensor_shape is None else tensor_shape
        if lengths is None:
            if callable(full_shape):
                raise ValueError(
                    "a sliced schedule with a per-op tensor_shape needs slice_lengths: the runtime "
                    "cannot read the sequence length from a function"
                )
            lengths = plan_slices(schedule, int(full_shape[0]), megatron_shape(self.config))
        if len(lengths) != schedule.slices:
            raise ValueError(f"{len(lengths)} slice lengths for a schedule with {schedule.slices} slices")
        check_cp_slices(lengths, self.config)
        return tuple(lengths)

    def _iterators(self, data_iterators: Any) -> list[Iterator[Any] | None]:
        if isinstance(data_iterators, (list, tuple)):
            if len(data_iterators) != len(self.chunks):
                raise ValueError(f"{len(data_iterators)} data iterators for {len(self.chunks)} chunks")
            return list(data_iterators)
        if len(self.chunks) != 1:
            raise ValueError("with several model chunks, pass one data iterator per chunk (a list)")
        return [data_iterators]


def _check_parallel_state(pp_size: int) -> None:
    """Megatron's data-parallel group must not span our pipeline (it would all-reduce gradients
    of different stages): its pipeline size must be ours. Not initialised is fine."""
    if not parallel_state.model_parallel_is_initialized():
        return
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp != pp_size:
        raise ValueError(
            f"Megatron parallel state has PP={pp} but the pipeline has {pp_size} ranks: "
            f"initialise it with pipeline_model_parallel_size={pp_size}"
        )


def _check_variable_shapes(schedule: Schedule, redistribution: float) -> None:
    """``variable_seq_lengths`` runs whole-sequence schedules: slices, the vocabulary passes and
    SlimPipe's exchanges are cut from one known sequence length."""
    if schedule.slices > 1:
        what = f"sequence slices ({schedule.name} with {schedule.slices})"
    elif schedule.vocab_parallel != "none":
        what = f"vocabulary parallelism ({schedule.vocab_parallel})"
    elif redistribution:
        what = "attention redistribution"
    else:
        return
    raise ValueError(
        f"config.variable_seq_lengths is not supported with {what}: every microbatch of the "
        "step must be cut from one sequence length; turn variable_seq_lengths off or run an "
        "unsliced schedule without --pp-vocab-parallel and --pp-attn-redistribution"
    )


def _sequence_share(config: Any) -> int:
    """How many ranks share a message's sequence: TP under sequence parallelism, times CP
    (Megatron's ``get_tensor_shapes`` divides the sequence length the same way)."""
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    if not getattr(config, "sequence_parallel", False):
        return cp
    return int(getattr(config, "tensor_model_parallel_size", 1)) * cp


def _shape_fn(tensor_shape: Sequence[int] | ShapeFn) -> ShapeFn:
    if callable(tensor_shape):
        return tensor_shape
    shape = tuple(int(n) for n in tensor_shape)
    return lambda op: shape


def _check_forward_order(schedule: Schedule, rank: int) -> None:
    """Each chunk's forward_step_func pulls its data from the chunk's iterator, so a chunk must
    run its forwards in (microbatch, slice) order."""
    last: dict[int, tuple[int, int]] = {}
    for op in schedule.ranks[rank]:
        if op.kind != OpKind.F:
            continue
        key = (op.microbatch, op.slice)
        if op.stage in last and key < last[op.stage]:
            raise ValueError(
                f"rank {rank}: {op} runs after microbatch {last[op.stage]} of stage {op.stage}; "
                "forwards of one stage must follow the data order"
            )
        last[op.stage] = key


class _StepRun:
    """State of one step on one rank: messages received and not yet used, outputs not yet sent."""

    def __init__(
        self,
        runtime: PipelineRuntime,
        step: _StepArgs,
        runners: dict[int, StageRunner],
        iterators: list[Iterator[Any] | None],
        shape_of: ShapeFn,
        slicing: StepSlicing | None,
    ) -> None:
        self.rt = runtime
        self.slicing = slicing
        self.shape_of = shape_of
        self.collect_non_loss_data = step.collect_non_loss_data
        self.schedule = step.lowered
        self.runners = runners
        self.iterators = iterators
        self.forward_step_func = step.forward_step_func
        self.forward_only = step.forward_only
        self.step = step
        self.config = runtime.config
        self.losses = LossRecord()
        # (kind, stage, microbatch, slice) -> (tensor, hold). Inbox: inputs of F (kind F) and
        # output gradients of B/BW (kind B) of *this* stage, received or still in flight.
        # Outbox: what SEND ops send.
        self.inbox: dict[tuple[str, int, int, int], tuple[Tensor | PostedRecv, Hold]] = {}
        self.outbox: dict[tuple[str, int, int, int], tuple[Tensor, Hold]] = {}
        self.op_count: dict[str, int] = {}
        self.pairs = 0  # overlapped pairs run
        self.vocab: VocabStep | None = None
        if step.vocab_parallel and runtime.vocab is not None:
            self.vocab = VocabStep(
                runtime.vocab,
                self.schedule,
                runtime.rank,
                runners,
                self.iterators,
                runtime.meter,
                self.losses,
                self._message_shape,
                self._batch_shape,
                forward_only=self.forward_only,
                collect_non_loss_data=self.collect_non_loss_data,
            )

    def features(
        self,
        sync: GradSync,
        offload: OffloadEngine | None,
        redistribution: StepRedistribution | None,
        gate: tuple[Callable[[], bool], int] | None,
    ) -> list[StepFeature]:
        """The step's collaborators, in the order its end needs (``step_feature.py``): the gate
        settles before the messages are flushed, the vocabulary's collectives finish before the
        gradients sync, the stages are checked empty before offload and attention finish."""
        rank = self.rt.rank
        features: list[StepFeature] = []
        if gate is not None:
            features.append(GateFeature(*gate))  # takes the random state the attempt starts from
        features.append(_Messages(self))
        if self.vocab is not None:
            features.append(VocabFeature(self.vocab))
        features.append(GradSyncFeature(sync, rank))
        features.append(_Stages(self))
        if offload is not None:
            features.append(OffloadFeature(offload))
        if redistribution is not None:
            features.append(RedistributionFeature(redistribution, rank))
        if self.slicing is not None:
            features.append(SlicingFeature(self.slicing))
        return features

    def execute(self, features: Sequence[StepFeature]) -> None:
        """Run the rank's ops in order, the features called around each (``step_feature.py``)."""
        for feature in features:
            feature.begin()
        ops = self.schedule.ranks[self.rt.rank]
        starts = self._pair_starts() if self.step.paired else set()
        position = 0
        while position < len(ops):
            group = list(enumerate(ops[position : position + (2 if position in starts else 1)], position))
            for at, op in group:
                for feature in features:
                    feature.before(at, op)
                self.op_count[op.kind.value] = self.op_count.get(op.kind.value, 0) + 1
            with OpFailure(self.rt.rank, position, group[0][1]):
                if len(group) == 2:
                    self._pair(group[0][1], group[1][1])
                else:
                    self._dispatch(group[0][1])
                for at, op in group:
                    for feature in reversed(features):
                        feature.after(at, op)
            self.rt.comm.reap()
            position += len(group)
        for feature in features:
            feature.finish()

    def _pair_starts(self) -> set[int]:
        """Positions of this rank's ops that start an overlapped pair (the partner is next)."""
        ops = self.schedule.ranks[self.rt.rank]
        firsts = first_ops(self.schedule)[self.rt.rank]
        starts = set()
        for position, op in enumerate(ops):
            second = firsts.get(key_of(op))
            if second is None:
                continue
            if position + 1 >= len(ops) or key_of(ops[position + 1]) != second:
                raise PipelineError(
                    f"rank {self.rt.rank}: {op} is paired with {second}, which does not follow it"
                )
            starts.add(position)
        return starts

    def leftovers(self) -> list[str]:
        """What the step left behind (nothing, after a step that ran every op)."""
        found = [item for runner in self.runners.values() for item in runner.leftover()]
        if self.vocab is not None:
            found += self.vocab.leftover()
        return (
            found
            + [f"unused message {key}" for key in self.inbox]
            + [f"unsent output {key}" for key in self.outbox]
        )

    def settle_received(self) -> None:
        """Take in the receives posted before the gate (their senders sent before theirs, see
        ``schedule/gate.py``), so that a restarted step's receives match the next messages."""
        for tensor, _ in self.inbox.values():
            if isinstance(tensor, PostedRecv):
                tensor.wait()

    def drop_message(self, op: Op) -> None:
        """Take the message of RECV ``op`` that a peer sent before it restarted, and drop it."""
        direction = "F" if op.kind == OpKind.RECV_F else "B"
        what = f"{op} (sent before a restart: dropped)"
        self.rt.comm.post_recv(*self._wire(op), self.rt.device, op.peer, direction, what).wait()

    def _wire(self, op: Op) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the message of a SEND/RECV op: the tensor's, or, with variable
        sequence lengths, the bytes of a message that carries its shape (``sized_messages.py``)."""
        shape = self._message_shape(op)
        if not self.step.variable_shapes:
            return shape, self.rt.dtype
        return (sized_messages.wire_size(shape, self.rt.dtype),), torch.uint8

    def _dispatch(self, op: Op) -> None:
        kind = op.kind
        if kind == OpKind.F:
            self._forward(op)
        elif kind in (OpKind.B, OpKind.BW):
            self._backward(op, split=kind == OpKind.B)
        elif kind == OpKind.W:
            with timed(self.config, "backward-compute"):
                self.runners[op.stage].weight((op.microbatch, op.slice))
        elif kind in (OpKind.RECV_F, OpKind.RECV_B):
            direction = "F" if kind == OpKind.RECV_F else "B"
            posted = self.rt.comm.post_recv(*self._wire(op), self.rt.device, op.peer, direction, str(op))
            hold = self.rt.meter.hold(posted.buffer)
            self.inbox[(direction, op.stage, op.microbatch, op.slice)] = (posted, hold)
        elif kind in (OpKind.SEND_F, OpKind.SEND_B):
            self._send(op)
        elif kind == OpKind.OFFLOAD:
            self.rt.offload.offload(op.unit)
        elif kind == OpKind.RELOAD:
            self.rt.offload.reload(op.unit)
        elif op.is_vocab and self.vocab is not None:
            self._vocab_op(op)
        else:
            raise PipelineError(f"rank {self.rt.rank}: unknown op {op}")

    def _vocab_op(self, op: Op) -> None:
        """A vocabulary op; a failure (a collective past its deadline) names its channels."""
        assert self.vocab is not None
        creation = self.rt.comm.creation
        groups, variant = self.vocab.vp.groups, self.vocab.vp.variant
        for name, group in groups.of_op(op.kind, variant):
            creation.use(creation.group(f"vocab-{name}", group), str(op))
        try:
            self.vocab.run(op)
        except Exception as error:
            channels = [
                creation.group(f"vocab-{name}", group) for name, group in groups.of_op(op.kind, variant, True)
            ]
            where = ", ".join(f"{c.name} (global ranks {list(c.members)})" for c in channels)
            raise PipelineError(
                f"rank {self.rt.rank}: {op} failed on channel {where or 'none'}: {error}"
            ) from error

    def _message_shape(self, op: Op) -> tuple[int, ...]:
        """The shape a RECV gets: the (slice of the) sequence, this rank's share of it."""
        sequence, *rest = self.shape_of(op)
        share = self.rt.sequence_share
        if sequence % share:
            raise PipelineError(
                f"rank {self.rt.rank}: {op}: sequence length {sequence} is not divisible by the "
                f"{share} ranks that share it (tensor parallel under sequence parallelism x context "
                "parallel)"
            )
        return (sequence // share, *rest)

    def _batch_shape(self, op: Op) -> tuple[int, int]:
        """[b, s] of the op's unit (token ids, labels), from the activation shape [s, b, h]."""
        sequence, batch, *_ = self.shape_of(op)
        return int(batch), int(sequence) // cp_size_of(self.rt.config)  # this CP rank's tokens

    def _send(self, op: Op) -> None:
        direction = "F" if op.kind == OpKind.SEND_F else "B"
        tensor, hold = self.outbox.pop((direction, op.stage, op.microbatch, op.slice))
        too_long = None
        if self.step.variable_shapes:
            capacity = self._message_shape(op)
            if not sized_messages.fits(tensor, capacity):
                too_long = sized_messages.too_long_message(str(op), tensor.shape, capacity)
            wire = self.rt.comm.wire_device(tensor.device)
            tensor = sized_messages.pack(tensor.to(self.rt.dtype), capacity, wire)  # read as rt.dtype
        with timed(self.config, "forward-send" if direction == "F" else "backward-send"):
            self.rt.comm.send(tensor, op.peer, direction, str(op), on_done=hold.release)
        if too_long is not None:  # its header went out: the receiver names the shape too
            raise PipelineError(f"rank {self.rt.rank}: {too_long}")

    def _take(self, direction: str, stage: int, op: Op) -> Tensor:
        item = self.inbox.pop((direction, stage, op.microbatch, op.slice), None)
        if item is None:
            raise PipelineError(
                f"rank {self.rt.rank}: {op} has no {'input' if direction == 'F' else 'output gradient'}"
            )
        tensor, hold = item
        if isinstance(tensor, PostedRecv):
            with timed(self.config, "forward-recv" if direction == "F" else "backward-recv"):
                tensor = tensor.wait()  # posted by its RECV, in the step's message order
            if self.step.variable_shapes:
                capacity = self._message_shape(op)
                try:
                    tensor = sized_messages.unpack(tensor, self.rt.dtype, capacity, str(op))
                except sized_messages.TooLong as error:
                    raise PipelineError(f"rank {self.rt.rank}: {error}") from None
        hold.release()  # the runner holds what it keeps
        return tensor

    def _emit(self, direction: str, to_stage: int, op: Op, tensor: Tensor) -> None:
        """Hand ``tensor`` on: in memory if ``to_stage`` is on this rank, else to a SEND op."""
        item = (tensor, self.rt.meter.hold(tensor))
        if self.schedule.placement.rank_of(to_stage) == self.rt.rank:
            self.inbox[(direction, to_stage, op.microbatch, op.slice)] = item
        else:
            self.outbox[(direction, op.stage, op.microbatch, op.slice)] = item

    def _pair(self, first: Op, second: Op) -> None:
        """An overlapped pair: the B begun, the F run with the B's backward beside it, the B's
        input gradient handed on."""
        forward, backward = (first, second) if first.kind == OpKind.F else (second, first)
        runner = self.runners[backward.stage]
        output_grad = None if runner.is_last else self._take("B", backward.stage, backward)
        pending = runner.begin_backward(
            (backward.microbatch, backward.slice), output_grad, split=backward.kind == OpKind.B
        )
        self._forward(forward, partner=pending)
        self._hand_input_grad(backward, runner.end_backward(pending))
        self.pairs += 1

    def _forward(self, op: Op, partner: PendingBackward | None = None) -> None:
        runner = self.runners[op.stage]
        input_tensor = None if runner.is_first else self._take("F", op.stage, op)
        fed = self.vocab.embedding(op) if self.vocab is not None and runner.is_first else None
        chunk_index = self.schedule.placement.chunk_index(op.stage)
        step = self.step
        call = ForwardCall(
            op.microbatch,
            check_first_val_step(step.first_val_step, self.forward_only, (op.microbatch, op.slice) == (0, 0)),
            checkpoint_argument(self.config, step.in_flight, op.stage, op.microbatch),
        )
        slicing = self.slicing.running(chunk_index, op) if self.slicing else nullcontext()
        with slicing, timed(self.config, "forward-compute"):
            output = runner.forward(
                (op.microbatch, op.slice),
                input_tensor,
                self.forward_step_func,
                self.iterators[chunk_index],
                self.schedule.microbatches,
                self.losses,
                self.forward_only,
                self.collect_non_loss_data,
                fed_input=fed,
                call=call,
                partner=partner,
            )
        if output is None:
            return
        handoff = output.detach()
        if self.rt.deallocate_outputs and not self.forward_only:
            deallocate(output)
        if runner.is_last and self.vocab is not None:
            self.vocab.take_output(op, handoff)  # for BCAST_X: the output layer runs as S and T
        else:
            self._emit("F", op.stage + 1, op, handoff)

    def _backward(self, op: Op, split: bool) -> None:
        runner = self.runners[op.stage]
        if runner.is_last:
            output_grad = self.vocab.output_grad(op) if self.vocab is not None else None
        else:
            output_grad = self._take("B", op.stage, op)
        with timed(self.config, "backward-compute"):
            input_grad = runner.backward((op.microbatch, op.slice), output_grad, split)
        self._hand_input_grad(op, input_grad)

    def _hand_input_grad(self, op: Op, input_grad: Tensor | None) -> None:
        """A backward's input gradient to the previous stage (or the vocabulary's embedding)."""
        runner = self.runners[op.stage]
        if not runner.is_first:
            if input_grad is None:
                raise PipelineError(f"rank {self.rt.rank}: {op} produced no input gradient")
            self._emit("B", op.stage - 1, op, input_grad)
        elif self.vocab is not None:
            self.vocab.embedding_grad(op, input_grad)


class _Messages(StepFeature):
    """The step's p2p messages: flushed at the end, after the gate (a rank with forwards only
    settles before it waits for its sends); after a failure forgotten, or, when the gate
    restarts the step, the receives posted before it taken in (``_StepRun.settle_received``)."""

    def __init__(self, run: _StepRun) -> None:
        self.run = run

    def finish(self) -> None:
        self.run.rt.comm.flush()

    def discard(self, error: BaseException) -> None:
        if isinstance(error, Restart):
            self.run.settle_received()
        else:
            self.run.rt.comm.abandon()


class _Stages(StepFeature):
    """The stages' state: checked empty at the end (every unit ran backward and W, every message
    was used and sent), dropped after a failure."""

    def __init__(self, run: _StepRun) -> None:
        self.run = run

    def finish(self) -> None:
        leftovers = self.run.leftovers()
        if leftovers:
            raise PipelineError(f"rank {self.run.rt.rank}: step ended with " + "; ".join(leftovers[:5]))

    def discard(self, error: BaseException) -> None:
        for runner in self.run.runners.values():
            runner.discard()
