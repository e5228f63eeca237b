"""The Megatron hook: megatron-core's ``get_forward_backward_func`` returns our schedules.

    from megatron_pp_ext import megatron as pp_ext
    pretrain(..., extra_args_provider=pp_ext.add_args)      # adds --pp-schedule and its knobs
    pp_ext.install(get_args())                              # before the training loop starts

After :func:`install`, ``megatron.core.pipeline_parallel.get_forward_backward_func`` (and every
module that imported it by name, as Megatron-LM's ``megatron/training/training.py`` does) returns
a function with Megatron's signature (forward_step_func, data_iterator, model, num_microbatches,
seq_length, micro_batch_size, forward_only, ...) and return value (the loss dicts on the rank that
computes the loss). Nothing inside Megatron is changed; :meth:`Installed.uninstall` undoes it.
With ``--pp-offload`` the schedule copies activations to host memory (PipeOffload); ``auto``
settles how many once the model runs, from k measured on the device (or the flags' throughputs).
With ``--pp-attn-redistribution CAP`` a sliced schedule's heavy slices hand up to CAP of their
attention (their oldest K/V slices) to a lighter partner rank at each step (SlimPipe).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..schedule.generators import SCHEDULES, Costs, RequestError, generate
from ..schedule.ir import Schedule
from ..schedule.layer_split import SplitError, megatron_args_split
from ..schedule.lowering import lower
from ..schedule.models import ModelShape, megatron_shape
from ..schedule.offload import OffloadError, OffloadPolicy, add_offload_args, apply_offload, parse_chunks
from ..schedule.partition import PartitionError, slice_lengths
from ..schedule.run_costs import RunShape, run_costs


class OptionError(ValueError):
    """A pipeline option that cannot work; ``flag`` names the command-line flag to change."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.reason = message


REDISTRIBUTION = "--pp-attn-redistribution"
VOCAB_FLAG = "--pp-vocab-parallel"
VOCAB_CHOICES = ("none", "vocab-1", "vocab-2")

# Generator flags and the names this adapter gives them on Megatron's command line.
MEGATRON_FLAGS = {
    "--schedule": "--pp-schedule",
    "--vpp": "--pp-chunks",
    "--slices": "--pp-seq-slices",
    "--microbatches": "--global-batch-size / --micro-batch-size (the number of microbatches)",
    "--pp": "--pipeline-model-parallel-size",
    "--memory-limit": "--pp-memory-limit",
}


def in_user_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with the schedule generator's flag names (``--slices``, ``--vpp``) written as
    the user's command line spells them (``flags``; names only, not descriptions)."""
    for ours, theirs in flags.items():
        if " " not in theirs:
            message = re.sub(rf"(?<![\w-]){re.escape(ours)}(?![\w-])", theirs, message)
    return message


@dataclass(frozen=True)
class PipelineOptions:
    """What the flags choose. ``chunks`` is chunks (virtual stages) per rank; None: the
    schedule's default (1, or 2 for V-shape and interleaved schedules)."""

    schedule: str = "1f1b"
    chunks: int | None = None
    slices: int = 1
    slice_partition: str | None = None
    memory_limit: float | None = None
    costs: Costs = field(default_factory=Costs)
    p2p_timeout: float = 300.0
    offload: str = "none"  # none, full, selective or auto
    offload_chunks: str | tuple[int, ...] | None = None  # "0,1" as the flag gives it, or indices
    offload_lookahead: int = 1
    host_bandwidth: float | None = None  # bytes/s for auto; None: measured
    compute_throughput: float | None = None  # FLOP/s for auto; None: measured
    attn_redistribution: float = 0.0  # SlimPipe's cap on the attention a heavy slice hands away
    vocab_parallel: str = "none"  # none, vocab-1 or vocab-2 (docs/vocab_parallel.md)
    calculate_per_token_loss: bool = False  # Megatron's flag: vocabulary parallelism with slices needs it
    emulate_nccl: bool = False  # NCCL's creation and launch-order rules on gloo (docs/nccl.md)
    # Megatron's --overlap-moe-expert-parallel-comm, for our schedules: overlapped F&B pairs
    # (schedule/pairing.py, runtime/expert_overlap.py)
    overlap_moe_expert_parallel_comm: bool = False
    # --pp-timeline FILE: record Megatron's profiling window (--profile-step-start/-end) as a
    # timeline beside the simulator's prediction (runtime/timeline.py)
    timeline: str | None = None
    profile_step_start: int = 10  # Megatron's defaults
    profile_step_end: int = 12
    # Megatron's --profile / --use-pytorch-profiler: each op a named range (NVTX, record_function)
    op_ranges: bool = False
    # count activation bytes per step (train reports them; pretrain_gpt.py does not pay for it)
    measure_memory: bool = True

    @classmethod
    def from_args(cls, args: Any) -> PipelineOptions:
        costs = getattr(args, "pp_zb_costs", None)
        return cls(
            schedule=getattr(args, "pp_schedule", "1f1b"),
            chunks=getattr(args, "pp_chunks", None),
            slices=1 if getattr(args, "pp_seq_slices", None) is None else args.pp_seq_slices,
            slice_partition=getattr(args, "pp_slice_partition", None),
            memory_limit=getattr(args, "pp_memory_limit", None),
            costs=costs if isinstance(costs, Costs) else parse_costs(costs or "1,1,1"),
            p2p_timeout=getattr(args, "pp_p2p_timeout", 300.0),
            offload=getattr(args, "pp_offload", "none"),
            offload_chunks=getattr(args, "pp_offload_chunks", None),
            offload_lookahead=getattr(args, "pp_offload_lookahead", 1),
            host_bandwidth=getattr(args, "pp_host_bandwidth", None),
            compute_throughput=getattr(args, "pp_compute_throughput", None),
            attn_redistribution=getattr(args, "pp_attn_redistribution", None) or 0.0,
            vocab_parallel=getattr(args, "pp_vocab_parallel", None) or "none",
            calculate_per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
            emulate_nccl=bool(getattr(args, "pp_emulate_nccl", False)),
            overlap_moe_expert_parallel_comm=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
            timeline=getattr(args, "pp_timeline", None),
            profile_step_start=getattr(args, "profile_step_start", 10),
            profile_step_end=getattr(args, "profile_step_end", 12),
            op_ranges=bool(getattr(args, "profile", False) or getattr(args, "use_pytorch_profiler", False)),
            measure_memory=False,  # Megatron-LM reports memory its own way
        )

    def schedule_for(
        self,
        pp: int,
        num_microbatches: int,
        flags: dict[str, str] = MEGATRON_FLAGS,
        run: RunShape | None = None,
    ) -> Schedule:
        """Generate (and so check) the schedule; a bad request raises :class:`OptionError` naming
        the flag, as ``flags`` translates the generator's flag names. The schedule comes lowered:
        its vocabulary passes placed and its messages ordered by the FLOP costs of ``run`` (the
        model and batch every rank knows alike: ``schedule/run_costs.py``), or at unit costs."""
        try:
            schedule = generate(
                self.schedule,
                pp,
                num_microbatches,
                vpp=self.chunks,
                slices=self.slices,
                costs=self.costs,
                memory_limit=self.memory_limit,
            )
        except RequestError as error:
            raise OptionError(in_user_flags(str(error), flags), flags.get(error.flag, error.flag)) from None
        if self.slice_partition:
            schedule.meta["partition"] = self.slice_partition
        self.check_redistribution(schedule, flags)
        costs = None if run is None else self.run_costs(schedule, run, flags)
        schedule = self.with_pairs(schedule, costs)
        schedule = lower(self.with_vocab(schedule, costs), costs)
        if self.offload == "auto":
            self.offload_policy()  # checks the flags; k is known once the model runs
        else:
            schedule = self.with_offload(schedule)  # copies added to the lowered order
        check_under_nccl(schedule)
        return schedule

    def run_costs(self, schedule: Schedule, run: RunShape, flags: dict[str, str] = MEGATRON_FLAGS) -> Any:
        """The FLOP costs every rank of ``run`` computes alike for ``schedule`` (with this
        vocabulary variant); too few layers or a sequence that cannot be cut raise
        :class:`OptionError`."""
        self.slice_lengths(schedule, run.seq_length, run.shape, flags)
        if run.layers_per_stage is not None and len(run.layers_per_stage) != schedule.num_stages:
            raise OptionError(
                f"the run's layer split has {len(run.layers_per_stage)} virtual stages, {schedule.name} on "
                f"{schedule.pp} pipeline ranks runs {schedule.num_stages}: set "
                "--num-virtual-stages-per-pipeline-rank to the schedule's chunks per rank",
                "--num-virtual-stages-per-pipeline-rank",
            )
        try:
            return run_costs(run, schedule, self.vocab_parallel)
        except ValueError as error:  # fewer layers than virtual stages
            raise OptionError(
                f"{error} ({schedule.name} on {schedule.pp} pipeline ranks has {schedule.num_stages} "
                f"virtual stages; use a --num-layers of at least {schedule.num_stages})",
                "--num-layers",
            ) from None

    def with_pairs(self, schedule: Schedule, costs: Any = None) -> Schedule:
        """``--overlap-moe-expert-parallel-comm``: the schedule's overlapped F&B pairs
        (``schedule/pairing.py``), taken where they do not lengthen the step at ``costs``."""
        if not self.overlap_moe_expert_parallel_comm:
            return schedule
        flag = "--overlap-moe-expert-parallel-comm"
        for given, what in (
            (schedule.slices > 1, f"sequence slices ({schedule.name} with {schedule.slices})"),
            (self.vocab_parallel != "none", VOCAB_FLAG),
            (self.offload != "none", "--pp-offload"),
            (self.attn_redistribution, "--pp-attn-redistribution"),
        ):
            if given:
                raise OptionError(f"overlapped pairs do not run with {what}: drop one of them", flag)
        from ..schedule.pairing import pair

        return pair(schedule, costs)

    def with_vocab(self, schedule: Schedule, costs: Any = None) -> Schedule:
        """``--pp-vocab-parallel``: the schedule with the vocabulary ops (before offload, which
        moves the chunks' activations and leaves S/T's state alone), placed by a replay at
        ``costs`` (default: unit costs), with sequence slices only under
        ``--calculate-per-token-loss`` (a slice's loss gradient is then known at its forward)."""
        if self.vocab_parallel == "none":
            return schedule
        if self.vocab_parallel not in VOCAB_CHOICES:
            raise OptionError(
                f"must be one of {', '.join(VOCAB_CHOICES)}, got {self.vocab_parallel!r}", VOCAB_FLAG
            )
        if schedule.slices > 1 and not self.calculate_per_token_loss:
            raise OptionError(
                f"{self.vocab_parallel} runs with sequence slices ({schedule.name} with {schedule.slices} "
                "slices) only with "
                "--calculate-per-token-loss (a slice's loss gradient needs the whole microbatch's token "
                "count otherwise): add it, use an unsliced schedule, or --pp-vocab-parallel none",
                VOCAB_FLAG,
            )
        from ..schedule.vocab import VocabError, add_vocab_passes

        try:
            return add_vocab_passes(schedule, self.vocab_parallel, costs)
        except VocabError as error:
            raise OptionError(str(error), VOCAB_FLAG) from None

    def check_redistribution(self, schedule: Schedule, flags: dict[str, str] = MEGATRON_FLAGS) -> None:
        """``--pp-attn-redistribution`` is a share in [0, 1] and needs sequence slices."""
        cap = self.attn_redistribution
        if not 0.0 <= cap <= 1.0:
            raise OptionError(f"CAP must be between 0 and 1 (0 turns it off), got {cap:g}", REDISTRIBUTION)
        if cap and schedule.slices < 2:
            slices = flags.get("--slices", "--slices")
            raise OptionError(
                f"moves attention between sequence slices, but {schedule.name} runs whole sequences: "
                f"add {slices} K (K >= 2) with a sliced schedule such as slimpipe, or set it to 0",
                REDISTRIBUTION,
            )

    def offload_policy(self, ratio: float | None = None) -> OffloadPolicy:
        try:
            chunks = parse_chunks(self.offload_chunks)
            return OffloadPolicy(self.offload, chunks, ratio, self.offload_lookahead)
        except OffloadError as error:
            raise OptionError(str(error), error.flag) from None

    def with_offload(self, schedule: Schedule, ratio: float | None = None) -> Schedule:
        """``schedule`` with the activation copies ``--pp-offload`` asks for (auto needs k)."""
        try:
            return apply_offload(schedule, self.offload_policy(ratio))
        except OffloadError as error:
            raise OptionError(str(error), error.flag) from None

    def slice_lengths(
        self, schedule: Schedule, seq_length: int, shape: ModelShape, flags: dict[str, str] = MEGATRON_FLAGS
    ) -> tuple[int, ...]:
        """How the runtime will cut ``seq_length`` for ``schedule`` (its partition, 8-token
        units); a sequence that cannot be cut raises :class:`OptionError` naming the flag and the
        nearest valid values, before any process starts."""
        partition = schedule.meta.get("partition", "uniform")
        try:
            return tuple(slice_lengths(partition, shape, seq_length, schedule.slices))
        except PartitionError as error:
            message = re.sub(r"(?<![\w-])--slices\b", flags.get("--slices", "--slices"), str(error))
            raise OptionError(message, flags.get(error.flag, error.flag)) from None


def run_shape(
    shape: ModelShape | None, seq_length: int | None, layers: tuple[int, ...] | None = None
) -> RunShape | None:
    """The run's FLOP costs depend on the model's ``shape``, the sequence length and the layers of
    each stage (``layers``, where the run does not split them evenly), which every rank knows
    alike (None without a shape or a sequence length: unit costs then)."""
    if shape is None or not seq_length:
        return None
    return RunShape(shape, int(seq_length), layers)


def chunks_per_rank(pp_chunks: int | None, virtual_stages: int | None) -> int | None:
    """Model chunks per rank from ``--pp-chunks`` or Megatron's
    ``--num-virtual-stages-per-pipeline-rank`` (one count, two names; train and pretrain_gpt.py
    take both); None: neither given, the schedule's default."""
    if pp_chunks is not None and virtual_stages and pp_chunks != virtual_stages:
        raise OptionError(
            f"--pp-chunks {pp_chunks} and --num-virtual-stages-per-pipeline-rank {virtual_stages} "
            "disagree: give one of them",
            "--num-virtual-stages-per-pipeline-rank",
        )
    return pp_chunks if pp_chunks is not None else virtual_stages or None


def _losses_pair(runtime: Any, schedule: Schedule) -> Any:
    """The world group's pair (loss rank, last rank) that ``_move_losses`` talks over. NCCL
    creates it at its first use, blocking both: the hook creates it before the first step, the
    two ranks first (nothing else is pending on either then; the other ranks do not wait for it),
    so the step's own warm-up and order are untouched."""
    from ..runtime.creation import Communicator

    ranks = runtime.comm.ranks
    source, last = schedule.loss_rank, schedule.pp - 1
    members = tuple(sorted((ranks[source], ranks[last])))
    return Communicator(1, members, f"losses pair {source}-{last}", None, ranks[source])


def check_under_nccl(schedule: Schedule) -> None:
    """Refuse, before the first step, a schedule that would hang under NCCL as the runtime runs
    it (``schedule/nccl_check.py``): every communicator created up front in one global order
    (``runtime/creation.py``), rendezvous sends and completion in launch order across
    communicators (lowering puts the step's messages in one global order,
    ``schedule/message_order.py``). SlimPipe's attention redistribution needs the slice lengths
    for its plan: the runtime checks the schedule with it before its first step
    (``runtime/executor.prepare``)."""
    from ..schedule.nccl_check import check_nccl

    hang = check_nccl(schedule, strict=True, warmed=True)
    if hang is not None:
        raise OptionError(
            f"{schedule.name} would hang under NCCL: {hang.message()}; choose another schedule or "
            "vocabulary variant",
            "--pp-schedule",
        )


def parse_costs(text: str) -> Costs:
    try:
        values = [float(part) for part in str(text).split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or min(values) <= 0:
        raise OptionError(f"expected three positive numbers F,B,W, got {text!r}", "--pp-zb-costs")
    return Costs(forward=values[0], backward=values[1], weight=values[2])


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: adds the pipeline-schedule flags."""
    group = parser.add_argument_group(title="megatron_pp_ext pipeline schedules")
    group.add_argument(
        "--pp-schedule",
        default="1f1b",
        metavar="NAME",
        help=f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b)",
    )
    group.add_argument(
        "--pp-chunks",
        type=int,
        default=None,
        help="model chunks (virtual stages) per pipeline rank; default: the schedule's",
    )
    group.add_argument(
        "--pp-seq-slices",
        type=int,
        default=1,
        help="sequence slices per microbatch (Seq1F1B, SlimPipe, sliced ZB/V-shape)",
    )
    group.add_argument(
        "--pp-slice-partition",
        choices=("uniform", "balanced"),
        default=None,
        help="how to cut the sequence into slices; default: the schedule's",
    )
    group.add_argument(
        "--pp-memory-limit", type=float, default=None, help="activation limit in units of M for zb-auto"
    )
    group.add_argument("--pp-zb-costs", default="1,1,1", help="F,B,W op costs that zb-auto plans with")
    group.add_argument(
        "--pp-p2p-timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits for a peer before failing with the op and peer named",
    )
    group.add_argument(
        "--pp-emulate-nccl",
        action="store_true",
        help="on gloo, impose NCCL's rules: each communicator is created at its first use, blocking "
        "until every member arrives, and each rank's communication completes in launch order, so "
        "an order that would hang under NCCL hangs here too (until --pp-p2p-timeout names it)",
    )
    group.add_argument(
        REDISTRIBUTION,
        type=float,
        default=0.0,
        metavar="CAP",
        help="SlimPipe attention redistribution for sliced schedules: at each step a heavy slice "
        "hands its oldest K/V slices, up to CAP (0..1) of its attention, to a lighter rank (0 = off)",
    )
    group.add_argument(
        VOCAB_FLAG,
        choices=VOCAB_CHOICES,
        default="none",
        help="vocabulary parallelism: the embedding and output layer split over the pipeline ranks, "
        "run as the paper's S/T passes (vocab-1: two barriers, vocab-2: one); see docs/vocab_parallel.md",
    )
    group.add_argument(
        "--pp-timeline",
        metavar="FILE.json",
        default=None,
        help="record the steps of Megatron's profiling window (--profile-step-start .. "
        "--profile-step-end) on every rank and write a Perfetto trace FILE.json and its picture "
        "(FILE.png): the run's ops beside the simulator's prediction at the measured op costs",
    )
    add_offload_args(parser)
    return parser


class Installed:
    """The installed hook: builds one PipelineRuntime per model-chunk list and one schedule per
    microbatch count, on first use (every pipeline rank reaches the first training step together,
    which is when the p2p groups are created).

    ``losses_on_last_rank``: return the loss dicts on the pipeline's last rank, where Megatron-LM's
    ``train_step`` and ``evaluate`` read them, even when the schedule computes the loss on another
    rank (V-shape: rank 0); that rank then returns an empty list. Off, they stay where computed.
    ``wrap_forward_step``: applied to Megatron's ``forward_step_func`` at each call. ``args``:
    Megatron-LM's parsed arguments, where the model's shape is read for the run's costs."""

    def __init__(
        self,
        options: PipelineOptions,
        losses_on_last_rank: bool = False,
        wrap_forward_step: Callable[[Callable], Callable] | None = None,
        args: Any = None,
    ) -> None:
        self.options = options
        self.losses_on_last_rank = losses_on_last_rank
        self.wrap_forward_step = wrap_forward_step
        self._runtimes: dict[tuple[int, ...], Any] = {}
        self._schedules: dict[tuple[int, int, RunShape | None], Schedule] = {}
        self._auto_offload: dict[tuple[int, int, int], Schedule] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        self.last_result: Any = None  # the runtime's StepResult of the last call
        self.last_wait_seconds = 0.0  # time the last call spent blocked on peers
        # --pp-vocab-parallel: this rank's runtime.vocab_ops.VocabSetup, set before the first step
        # by whoever built the chunks (setup_vocab_parallel, before DDP wrapping)
        self.vocab: Any = None
        # optimizer post-validation: settles the previous step at the next step's validation
        # gate (``PipelineRuntime.step``); set by the training loop that owns the optimizer
        self.gate: Callable[[], bool] | None = None
        # the whole model's shape, which the run's FLOP costs come from (schedule/run_costs.py):
        # set by whoever builds the model (train), else read from Megatron-LM's ``args``
        self.model: ModelShape | None = None
        # the layers of each virtual stage where the run splits them unevenly: set by whoever
        # builds the model (train), else read from Megatron-LM's ``args`` (``stage_layers``)
        self.layers: tuple[int, ...] | None = None
        self.args = args

    @property
    def comm(self) -> Any:
        """The pipeline's PipeComm once a step has run (None before): collectives outside the
        step launch through its queue to keep this rank's communication order."""
        runtimes = list(self._runtimes.values())
        return runtimes[0].comm if runtimes else None

    # -- what Megatron calls ------------------------------------------------------------------

    def get_forward_backward_func(self, pp_size: int | None = None, vp_size: int | None = None) -> Callable:
        return self.forward_backward_func

    def flush_timelines(self) -> list[str]:
        """Write the ``--pp-timeline`` files once its window is over (collective; a no-op before
        and after): train calls it between steps, the next step does otherwise."""
        written = [runtime.timeline.flush() for runtime in self._runtimes.values() if runtime.timeline]
        return [path for path in written if path]

    def forward_backward_func(self, **kwargs: Any) -> list[Any]:
        from ..runtime import forward_backward

        self.flush_timelines()
        models = kwargs["model"] if isinstance(kwargs["model"], (list, tuple)) else [kwargs["model"]]
        runtime = self._runtime(models, kwargs.get("pg_collection"), kwargs.get("p2p_communicator"))
        run = run_shape(self.model_shape(), kwargs.get("seq_length"), self.stage_layers())
        schedule = self.schedule(runtime.comm.size, kwargs["num_microbatches"], run)
        if self.options.offload == "auto":
            schedule = self.auto_offload(schedule, runtime, kwargs["seq_length"])
        if self.wrap_forward_step is not None:
            kwargs = {**kwargs, "forward_step_func": self.wrap_forward_step(kwargs["forward_step_func"])}
        moves_losses = self.losses_on_last_rank and schedule.loss_rank != schedule.pp - 1
        if moves_losses:  # before the step's own warm-up: see _losses_pair
            runtime.comm.creation.warm_up([_losses_pair(runtime, schedule)])
        waited = runtime.comm.wait_seconds
        gate = None if kwargs.get("forward_only") else self.gate
        losses = forward_backward(runtime, schedule, gate=gate, **kwargs)
        self.last_result = runtime.last_result
        self.last_wait_seconds = runtime.comm.wait_seconds - waited
        self.last_creation = runtime.comm.creation  # the communicators warmed up, and in how long
        if moves_losses:
            losses = self._move_losses(runtime, schedule, losses)
        return losses

    def _move_losses(self, runtime: Any, schedule: Schedule, losses: list[Any]) -> list[Any]:
        """Send the loss dicts from the rank that computed them to the pipeline's last rank."""
        import torch.distributed as dist

        rank = runtime.comm.rank
        ranks = runtime.comm.ranks
        runtime.comm.creation.use(_losses_pair(runtime, schedule), "moving the losses")  # warmed
        if rank == schedule.loss_rank:
            cpu = [{key: value.detach().cpu() for key, value in item.items()} for item in losses]
            dist.send_object_list([cpu], dst=ranks[schedule.pp - 1])
            return []
        if rank == schedule.pp - 1:
            received: list[Any] = [None]
            dist.recv_object_list(received, src=ranks[schedule.loss_rank])
            return [{key: value.to(runtime.device) for key, value in item.items()} for item in received[0]]
        return losses

    # -- pieces -------------------------------------------------------------------------------

    def model_shape(self) -> ModelShape | None:
        """The whole model's shape: :attr:`model`, else Megatron-LM's args (padded vocabulary)."""
        args = self.args
        if self.model is None and getattr(args, "num_layers", None) and getattr(args, "hidden_size", None):
            self.model = megatron_shape(args, getattr(args, "padded_vocab_size", None) or 1)
        return self.model

    def stage_layers(self) -> tuple[int, ...] | None:
        """Layers of each virtual stage as megatron-core builds them under Megatron-LM's split
        flags (``--decoder-first/last-pipeline-num-layers``, ``--account-for-embedding/loss-in-
        pipeline-split``, ``--pipeline-model-parallel-layout``); None when the run has none (an
        even split) or megatron-core refuses the split (it names the flag itself). :attr:`layers`
        where set."""
        if self.layers is not None:
            return self.layers
        pp = getattr(self.args, "pipeline_model_parallel_size", None)
        if not pp:
            return None
        chunks = getattr(self.args, "virtual_pipeline_model_parallel_size", None) or 1
        try:
            return megatron_args_split(self.args, pp, chunks)
        except SplitError:
            return None

    def schedule(self, pp: int, num_microbatches: int, run: RunShape | None = None) -> Schedule:
        """The schedule of a step (``run``: resolved with the run's costs, as steps run it)."""
        key = (pp, num_microbatches, run)
        if key not in self._schedules:
            self._schedules[key] = self.options.schedule_for(pp, num_microbatches, run=run)
        return self._schedules[key]

    def auto_offload(self, schedule: Schedule, runtime: Any, seq_length: int) -> Schedule:
        """``--pp-offload auto``: k from the model width, the sequence length and this device's
        throughputs (measured once, unless the flags give them)."""
        key = (schedule.pp, schedule.microbatches, seq_length)
        if key not in self._auto_offload:
            from ..runtime.offload_probe import offload_ratio_on

            ratio = offload_ratio_on(
                runtime.device,
                runtime.config.hidden_size,
                seq_length,
                runtime.dtype,
                self.options.compute_throughput,
                self.options.host_bandwidth,
            )
            self._auto_offload[key] = self.options.with_offload(schedule, ratio)
        return self._auto_offload[key]

    def _runtime(self, models: list[Any], pg_collection: Any = None, p2p_communicator: Any = None) -> Any:
        """The runtime of these chunks, on the pipeline group of ``p2p_communicator`` or
        ``pg_collection`` where the caller passes them (megatron-core's custom process groups),
        else of Megatron's parallel state."""
        key = tuple(id(model) for model in models)
        if key not in self._runtimes:
            import torch.distributed as dist
            from megatron.core.utils import get_model_config

            from ..runtime import PipeComm, PipelineRuntime

            ranks = dist.get_process_group_ranks(pipeline_group(pg_collection, p2p_communicator))
            config = get_model_config(models[0])
            comm = PipeComm(
                ranks=ranks,
                timeout_s=self.options.p2p_timeout,
                emulate_nccl=self.options.emulate_nccl or None,  # None: MEGATRON_PP_EXT_EMULATE_NCCL
            )
            self._runtimes[key] = PipelineRuntime(
                models,
                comm,
                (1, 1, getattr(config, "hidden_size", None) or 1),  # each step gives its shape
                config.pipeline_dtype or config.params_dtype,
                config,
                attn_redistribution=self.options.attn_redistribution,
                vocab=self.vocab,
                measure_memory=self.options.measure_memory,
                cp_group=getattr(pg_collection, "cp", None),
            )
            self._observe(self._runtimes[key])
        return self._runtimes[key]

    def _observe(self, runtime: Any) -> None:
        """``--pp-timeline`` and Megatron's profiling flags on a new runtime."""
        from ..runtime.timeline import TimelineRecorder

        options = self.options
        if options.timeline:
            runtime.timeline = TimelineRecorder(
                options.timeline, options.profile_step_start, options.profile_step_end
            )
        runtime.op_ranges = options.op_ranges

    def patch(self) -> None:
        """Point every reference to megatron-core's get_forward_backward_func at ours."""
        from megatron.core import pipeline_parallel
        from megatron.core.pipeline_parallel import schedules

        original = schedules.get_forward_backward_func
        targets = {pipeline_parallel, schedules}
        for module in list(sys.modules.values()):
            if getattr(module, "get_forward_backward_func", None) is original:
                targets.add(module)
        for module in targets:
            self._patched.append((module, "get_forward_backward_func", module.get_forward_backward_func))
            module.get_forward_backward_func = self.get_forward_backward_func

    def uninstall(self) -> None:
        for module, name, value in reversed(self._patched):
            setattr(module, name, value)
        self._patched.clear()
        for runtime in self._runtimes.values():
            runtime.comm.close()
        self._runtimes.clear()


def pipeline_group(pg_collection: Any = None, p2p_communicator: Any = None) -> Any:
    """The pipeline's process group: the caller's (``p2p_communicator.pp_group``, else
    ``pg_collection.pp``), else Megatron's parallel state's; neither is one line naming both."""
    for group in (getattr(p2p_communicator, "pp_group", None), getattr(pg_collection, "pp", None)):
        if group is not None:
            return group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "no pipeline group: pass pg_collection (with .pp) or p2p_communicator to the "
            "forward_backward_func, or initialise megatron.core.parallel_state"
        )
    return parallel_state.get_pipeline_model_parallel_group()


_active: Installed | None = None


def install(
    args: Any = None,
    options: PipelineOptions | None = None,
    losses_on_last_rank: bool = False,
    wrap_forward_step: Callable[[Callable], Callable] | None = None,
    **overrides: Any,
) -> Installed:
    """Install the hook with options from Megatron's parsed ``args`` (see :func:`add_args`),
    or ``options``, and/or keyword overrides (``schedule="zb-h1"``, ``slices=4``, ...).
    Installing again replaces the previous hook. If ``args`` carries the pipeline size and
    microbatch count (Megatron's ``pipeline_model_parallel_size``, ``global_batch_size``,
    ``micro_batch_size``, ``data_parallel_size``), the schedule is generated now, so a bad flag
    fails before training; with ``--pp-seq-slices`` and ``seq_length`` the cut of the sequence
    is checked too. Sliced schedules need model chunks built with the sliced layer spec
    (``layer_spec(sliced=True)`` and ``megatron_pp_ext.megatron.sliced.enable_slicing``)."""
    global _active
    if options is None:
        options = PipelineOptions.from_args(args) if args is not None else PipelineOptions()
    if overrides:
        options = dataclasses.replace(options, **overrides)
    if options.schedule not in SCHEDULES:
        choices = ", ".join(SCHEDULES)
        raise OptionError(f"unknown schedule {options.schedule!r}; choose from {choices}", "--pp-schedule")
    pp = getattr(args, "pipeline_model_parallel_size", None)
    microbatches = num_microbatches(args)
    if pp and microbatches is not None:
        schedule = options.schedule_for(pp, microbatches)  # fail early, with the flag named
        if schedule.slices > 1 and getattr(args, "seq_length", None):
            lengths = options.slice_lengths(schedule, args.seq_length, megatron_shape(args))
            _check_context_parallel(lengths, args)
    if _active is not None:
        _active.uninstall()
    hook = Installed(options, losses_on_last_rank, wrap_forward_step, args)
    hook.patch()
    _active = hook
    return hook


def _check_context_parallel(lengths: tuple[int, ...], args: Any) -> None:
    """Under --context-parallel-size every slice is cut into 2 x CP pieces (Megatron-LM's
    ``get_batch`` cuts each slice the runtime hands it); refuse slices that cannot be."""
    from ..runtime.context_parallel import check_cp_slices

    try:
        check_cp_slices(lengths, args)
    except ValueError as error:
        raise OptionError(str(error), "--pp-seq-slices") from None


def num_microbatches(args: Any) -> int | None:
    """Microbatches per step from Megatron's batch arguments (None if they are missing)."""
    try:
        data_parallel = getattr(args, "data_parallel_size", None) or 1
        return args.global_batch_size // (args.micro_batch_size * data_parallel)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None
