"""One candidate plan, evaluated: its schedule replayed by the simulator, plus what a training
step adds around the pipeline (data-parallel gradient sync, the optimizer, parameter gathers)
and every part of a GPU's memory.

Step time = the slowest rank's end, where a rank ends when both its last op and its gradient
reduce-scatters are done. Each model chunk's reduce-scatter (``overlap_grad_reduce``) starts once
the chunk's last weight gradient is in (the plugin's runtime) or bucket by bucket during that last
backward (Megatron's own schedules), on one communication stream per rank, so chunks that finish
early hide theirs behind the rest of the pipeline. Then the distributed optimizer's Adam step
(bandwidth-bound over this rank's shard) and what the parameter all-gather adds: with
``overlap_param_gather`` the first bucket, and the rest beyond the chunk's first forward.

Large microbatch counts are simulated with fewer microbatches (at least 2p) and extended by the
busiest rank's time per microbatch: the steady state repeats, so the makespan grows by that per
microbatch and the activation peak (reached in the steady state) does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..schedule.completion import FREE
from ..schedule.generators import SCHEDULES, Costs, RequestError, generate
from ..schedule.ir import Op, OpKind, Placement, Schedule
from ..schedule.layer_split import LayerSplitFlags
from ..schedule.lowering import lower
from ..schedule.memory_model import padded_vocab, stage_layers, static_memory
from ..schedule.models import ModelShape
from ..schedule.offload import OffloadError, OffloadPolicy, apply_offload
from ..schedule.pairing import pair
from ..schedule.pairs import count as count_pairs
from ..schedule.pairs import hidden_seconds, iter_pairs, op_of
from ..schedule.partition import PartitionError
from ..schedule.run_costs import RunShape, run_costs
from ..schedule.simulate import SimResult, simulate
from ..schedule.validate import ScheduleError
from ..schedule.vocab import VocabError, add_vocab_passes, vocab_static_memory
from .costs import LayerTimes, PlanCosts
from .devices import GIB, DeviceProfile
from .kernels import Kernels
from .layout import Layout

OPTIMIZER_BYTES_PER_PARAM = 34  # fp32 grad, master, m, v read; master, m, v, bf16 weight written


class Rejection(Exception):
    """A candidate that cannot run (or cannot fit): ``reason`` groups it in the summary."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Problem:
    """What the user asks for: a model at a sequence length on ``gpus`` GPUs of ``profile``, and
    sequences per step. The micro-batch size is a choice of the plan (``Candidate.micro_batch``),
    searched or pinned (``Pins.micro_batch``) like TP or PP."""

    shape: ModelShape
    seq_length: int
    gpus: int
    profile: DeviceProfile
    global_batch: int
    gpus_per_node: int = 8
    # when messages complete (schedule/completion.py): sends that never wait by default, as the
    # published runs the cost model is checked against (Megatron's batched p2p) behave;
    # IN_ORDER for NCCL's in-order completion of the plugin's unbatched messages
    completion: str = FREE
    # mixture of experts: megatron-core's token dispatcher (--moe-token-dispatcher-type: alltoall,
    # or flex for DeepEP / HybridEP), and the busiest expert rank's routed tokens over the
    # balanced share (--pp-moe-imbalance; 1: balanced, as the published benchmarks force it)
    dispatcher: str = "alltoall"
    moe_imbalance: float = 1.0
    fp8: str | None = None  # --fp8-format: Transformer Engine's linears in FP8 (the profile's FP8 peak)


@dataclass(frozen=True)
class Candidate:
    """One plan to evaluate. The search varies layout, schedule, chunks, slices, micro-batch size
    and (only to fit) offload and full recomputation; the rest is what a pinned run (``plan
    --from-args``) says."""

    layout: Layout
    schedule: str
    vpp: int
    slices: int
    offload: str = "none"  # none | auto | full | selective (--pp-offload)
    recompute: str = "none"  # none | selective | full (--recompute-granularity)
    recompute_layers: int | None = None  # full, --recompute-method block: layers per stage
    tp_comm_overlap: bool = False  # --tp-comm-overlap (Transformer Engine)
    overlap_grad_reduce: bool = True  # --overlap-grad-reduce
    grad_reduce_in_fp32: bool = False  # --accumulate-allreduce-grads-in-fp32 (Megatron: bf16 by default)
    # Megatron's own schedules dispatch each gradient bucket during the chunk's last backward; the
    # plugin's runtime starts a chunk's reduce after its last weight gradient (runtime/grad_sync.py).
    grad_reduce_buckets: bool = False
    overlap_param_gather: bool = True  # --overlap-param-gather (distributed optimizer)
    attention: str = "flash"  # or "unfused" (--attention-backend local|unfused; Megatron before 2023)
    vocab: str = "none"  # --pp-vocab-parallel vocab-1 | vocab-2
    micro_batch: int = 1  # --micro-batch-size: sequences per microbatch
    # zb-auto's activation limit in M (the 1F1B peak); None: 1 M. Zero Bubble's ZB-2p is 2.
    memory_limit: float | None = None
    # transformer layers of each virtual stage when the run splits them itself (Zero Bubble's
    # --allow-padding-num-layers: first and last stage one layer short); None: ``stage_layers``
    layers: tuple[int, ...] | None = None
    # Megatron's flags that give ``layers`` (``--decoder-first/last-pipeline-num-layers``, ...),
    # where the search chose them; --emit writes them
    split: LayerSplitFlags | None = None
    # --overlap-moe-expert-parallel-comm: forward and backward of two microbatches as overlapped
    # pairs (schedule/pairing.py), each one's expert all-to-all behind the other's compute
    pairs: bool = False

    def label(self) -> str:
        extra = [f"micro-batch {self.micro_batch}"] if self.micro_batch > 1 else []
        extra += [f"offload {self.offload}"] if self.offload != "none" else []
        if self.recompute != "none":
            block = f" (block {self.recompute_layers})" if self.recompute_layers is not None else ""
            extra.append(f"recompute {self.recompute}{block}")
        extra += ["tp-comm-overlap"] if self.tp_comm_overlap else []
        extra += [self.vocab] if self.vocab != "none" else []
        extra += ["no grad-reduce overlap"] if not self.overlap_grad_reduce else []
        extra += [f"memory limit {self.memory_limit:g} M"] if self.memory_limit is not None else []
        extra += [f"layers {layer_runs(self.layers)}"] if self.layers is not None else []
        extra += ["EP overlap"] if self.pairs else []
        return f"{self.layout.label()} {self.schedule} v{self.vpp} k{self.slices}" + "".join(
            f", {e}" for e in extra
        )


def pairing_refusal(problem: Problem, candidate: Candidate) -> str | None:
    """Why ``candidate`` cannot run overlapped F&B pairs (the runtime's refusals of
    ``--overlap-moe-expert-parallel-comm``, ``runtime/expert_overlap.py``), or None."""
    layout = candidate.layout
    for refused, why in (
        (not problem.shape.experts, f"{problem.shape.name} has no experts"),
        (layout.ep == 1, "EP 1 has no expert all-to-all to hide"),
        (layout.cp > 1, "not with context parallelism"),
        (candidate.slices > 1, "not with sequence slices"),
        (candidate.vocab != "none", "not with vocabulary parallelism"),
        (candidate.offload != "none", "not with activation offload"),
        (candidate.recompute == "full", "not with full recomputation"),
    ):
        if refused:
            return why
    return None


def layer_runs(layers: tuple[int, ...]) -> str:
    """Layers per virtual stage, three or more repeats folded: ``(1, 2, 2, 2, 1)`` -> ``"1/2*3/1"``."""
    runs: list[list[int]] = []
    for count in layers:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return "/".join(
        f"{count}*{repeat}" if repeat > 2 else "/".join([str(count)] * repeat) for count, repeat in runs
    )


@dataclass
class MemoryBreakdown:
    """One GPU's memory in bytes (the rank with the largest total)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float
    reserved: float
    experts: float = 0.0  # the routed experts' share of weights, gradients and optimizer (in them)

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.comm_buffers
            + self.reserved
        )

    def to_gib(self) -> dict[str, float]:
        parts = {k: v / GIB for k, v in self.__dict__.items() if k != "experts" or v}
        return {**{k: round(v, 3) for k, v in parts.items()}, "total": round(self.total / GIB, 3)}


@dataclass(frozen=True)
class ExpertSummary:
    """What a mixture-of-experts plan's report states: the expert all-to-all per step on the rank
    with the most of it, how much its overlapped pairs hide, one all-to-all's bytes by link, and
    the tokens each local expert's GEMM takes."""

    alltoall_seconds: float  # every expert all-to-all of the step on that rank
    hidden_seconds: float  # the most any rank's overlapped pairs hide (scaled from the simulated ones)
    nvlink_bytes: float  # one all-to-all of one microbatch (first slice), per rank
    ib_bytes: float
    one_alltoall: float  # its seconds
    tokens_per_expert: float  # m_e of the first slice
    moe_layers: int


@dataclass
class PlanResult:
    problem: Problem
    candidate: Candidate
    microbatches: int
    simulated_microbatches: int
    step_time: float
    pipeline_time: float
    grad_sync_exposed: float
    optimizer_time: float
    bubble: float
    memory: MemoryBreakdown
    model_flops: float
    offloaded_units: int = 0
    notes: list[str] = field(default_factory=list)
    param_gather_exposed: float = 0.0
    pairs: int = 0  # overlapped F&B pairs in the simulated schedule (EP overlap)
    experts: ExpertSummary | None = None  # a mixture-of-experts model's all-to-all and expert GEMMs

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.problem.profile.memory_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        p = self.problem
        return p.global_batch * p.seq_length / self.step_time / p.gpus

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (causal attention, no recomputation)."""
        return self.model_flops / (self.step_time * self.problem.gpus) / 1e12

    @property
    def mfu(self) -> float:
        p = self.problem
        return self.model_flops / (self.step_time * p.gpus * p.profile.peak_flops)

    def to_dict(self) -> dict[str, Any]:
        c, lay = self.candidate, self.candidate.layout
        return {
            "tp": lay.tp,
            "cp": lay.cp,
            "pp": lay.pp,
            "dp": lay.dp,
            "vpp": c.vpp,
            "stage_layers": None if c.layers is None else list(c.layers),  # None: an even split
            "schedule": c.schedule,
            "slices": c.slices,
            "offload": c.offload,
            "recompute": c.recompute,
            "recompute_layers": c.recompute_layers,
            "tp_comm_overlap": c.tp_comm_overlap,
            "overlap_grad_reduce": c.overlap_grad_reduce,
            "grad_reduce_in_fp32": c.grad_reduce_in_fp32,
            "grad_reduce_buckets": c.grad_reduce_buckets,
            "overlap_param_gather": c.overlap_param_gather,
            "attention": c.attention,
            "vocab_parallel": c.vocab,
            "sequence_parallel": lay.parallel.sp,
            "distributed_optimizer": lay.parallel.distributed_optimizer,
            "microbatches": self.microbatches,
            "micro_batch_size": c.micro_batch,
            "global_batch_size": self.problem.global_batch,
            "step_time_s": self.step_time,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "bubble": self.bubble,
            "memory_gib": self.memory_gib,
            "memory_parts_gib": self.memory.to_gib(),
            "fits": self.fits,
            "pipeline_time_s": self.pipeline_time,
            "grad_sync_exposed_s": self.grad_sync_exposed,
            "optimizer_s": self.optimizer_time,
            "param_gather_exposed_s": self.param_gather_exposed,
            "simulated_microbatches": self.simulated_microbatches,
            "offloaded_units": self.offloaded_units,
            "fp8": self.problem.fp8,  # --fp8-format, or None (BF16)
            **(self._moe_dict() if self.problem.shape.experts else {}),
        }

    def _moe_dict(self) -> dict[str, Any]:
        lay, p = self.candidate.layout, self.problem
        return {
            "ep": lay.ep,
            "etp": lay.expert_tp,
            "expert_overlap": self.candidate.pairs,
            "overlapped_pairs": self.pairs,
            "dispatcher": p.dispatcher,
            "moe_imbalance": p.moe_imbalance,
            "expert_memory_gib": self.memory.experts / GIB,
            "activated_params": p.shape.activated_params(),
        }


def microbatches_of(problem: Problem, candidate: Candidate) -> int:
    """Microbatches per DP rank and step: the global batch over DP x micro-batch size."""
    return problem.global_batch // (candidate.layout.dp * candidate.micro_batch)


UNIT_BUDGET = 4_000  # (stage, microbatch, slice) units one search simulation may hold


def simulated_count(microbatches: int, candidate: Candidate, full: bool) -> int:
    """Microbatches to simulate: all of them, or enough for the steady state (2p, at least 4),
    fewer when a microbatch has many units (v chunks x k slices reach it sooner)."""
    if full:
        return microbatches
    layout = candidate.layout
    count = min(microbatches, max(2 * layout.pp, 4))
    per_microbatch = layout.pp * candidate.vpp * candidate.slices
    if count * per_microbatch > UNIT_BUDGET:
        count = min(count, max(2, -(-UNIT_BUDGET // per_microbatch)))
    needed = SCHEDULES[candidate.schedule].min_microbatches(layout.pp, candidate.vpp, candidate.slices)
    return max(count, min(needed, microbatches))


@lru_cache(maxsize=64)
def _lowered(
    name: str,
    pp: int,
    microbatches: int,
    vpp: int,
    slices: int,
    costs: Costs | None,
    vocab: str = "none",
    memory_limit: float | None = None,
    run: RunShape | None = None,
    pairs: bool = False,
    pairing_replays: int | None = None,
) -> Schedule:
    """Generated and lowered once; layouts with the same pipeline shape and run share it. The
    overlapped pairs are taken, the vocabulary passes placed and the messages ordered as the
    runtime does it for ``run`` (``schedule/run_costs.py``; unit costs without one)."""
    schedule = generate(
        name, pp, microbatches, vpp=vpp, slices=slices, costs=costs, memory_limit=memory_limit
    )
    order = None if run is None else run_costs(run, schedule, vocab)
    if pairs:
        schedule = pair(schedule, order, pairing_replays)
    return lower(add_vocab_passes(schedule, vocab, order), order)


_OFFLOADED: dict[tuple[int, str, float], tuple[Schedule, Schedule]] = {}


def _offloaded(schedule: Schedule, mode: str, ratio: float) -> Schedule:
    """``schedule`` with PipeOffload's ``mode`` policy (auto at ratio k, rounded so layouts
    share it)."""
    key = (id(schedule), mode, ratio)
    hit = _OFFLOADED.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    if len(_OFFLOADED) >= 16:
        _OFFLOADED.clear()
    offloaded = apply_offload(schedule, OffloadPolicy(mode, ratio=ratio if mode == "auto" else None))
    _OFFLOADED[key] = (schedule, offloaded)
    return offloaded


def offload_ratio(schedule: Schedule, costs: PlanCosts) -> float:
    """PipeOffload's k from the cost model: copy time over compute time of one microbatch's
    units (``offload.ratio_from_costs`` in closed form: every microbatch is alike)."""
    kinds = (OpKind.F, OpKind.B, OpKind.W) if schedule.splits_backward else (OpKind.F, OpKind.BW)
    copy = compute = 0.0
    for stage in range(schedule.num_stages):
        for j in range(schedule.slices):
            compute += sum(costs.duration(Op(kind, stage, 0, j)) for kind in kinds)
            copy += costs.copy_time(Op(OpKind.OFFLOAD, stage, 0, j))
    if compute <= 0:
        raise OffloadError("the cost model gives no compute time to hide copies behind", "--pp-offload")
    return copy / compute


def build_schedule(
    candidate: Candidate,
    microbatches: int,
    unit_costs: Costs | None = None,
    run: RunShape | None = None,
    pairing_replays: int | None = None,
) -> Schedule:
    """``candidate``'s schedule as the runtime resolves it for ``run``; :class:`Rejection` if it
    cannot be built."""
    try:
        return _lowered(
            candidate.schedule,
            candidate.layout.pp,
            microbatches,
            candidate.vpp,
            candidate.slices,
            unit_costs if candidate.schedule == "zb-auto" else None,
            candidate.vocab,
            candidate.memory_limit if candidate.schedule == "zb-auto" else None,
            run,
            candidate.pairs,
            pairing_replays,
        )
    except RequestError as error:
        raise Rejection(f"schedule: {error.flag}", str(error)) from None
    except VocabError as error:
        raise Rejection("schedule: --pp-vocab-parallel", str(error)) from None


def peak_activations(schedule: Schedule, costs: PlanCosts) -> list[float]:
    """Each rank's activation peak without offload, from its op order alone: the simulator's
    rule (F holds its activation from its start, B keeps the W share, W and BW free) applied in
    program order, which is time order on one rank, so no event replay is needed."""
    peaks = []
    for ops in schedule.ranks:
        level = peak = 0.0
        held: dict[tuple[int, int, int], float] = {}
        for op in ops:
            kind = op.kind
            if kind is OpKind.F:
                level += costs.activation(op)
                peak = max(peak, level)
            elif kind is OpKind.B:
                share = costs.weight_share(op)
                held[op.unit] = share
                level += share - costs.activation(op)
                peak = max(peak, level)
            elif kind is OpKind.W:
                level -= held.pop(op.unit)
            elif kind is OpKind.BW:
                level -= costs.activation(op)
            elif kind is OpKind.S:
                level += costs.vocab_activation(op)
                peak = max(peak, level)
            elif kind is OpKind.T:
                level -= costs.vocab_activation(op)
        peaks.append(peak)
    return peaks


def stage_params(
    shape: ModelShape, layers: list[int], tp: int, vocab_over: Placement | None = None
) -> list[int]:
    """Parameters of each virtual stage on one TP rank (as ``memory_model.rank_params``); with
    ``vocab_over`` (vocabulary parallelism) each rank's first stage holds its 1/p of the
    embedding and the output layer instead of the first and last stage holding them whole."""
    layer = shape.layer_params() // tp + 2 * shape.hidden
    params = [count * layer for count in layers]
    params[-1] += shape.hidden
    if vocab_over is None:
        vocab = padded_vocab(shape.vocab, tp) // tp * shape.hidden
        params[0] += vocab
        params[-1] += vocab
        return params
    shards = tp * vocab_over.pp
    shard = padded_vocab(shape.vocab, shards) // shards * shape.hidden
    for rank in range(vocab_over.pp):
        params[min(vocab_over.stages_of(rank))] += 2 * shard
    return params


def pipeline_of(
    problem: Problem, candidate: Candidate, microbatches: int, pairing_replays: int | None = None
) -> tuple[Schedule, PlanCosts, list[int]]:
    """The schedule ``evaluate`` replays for ``candidate`` with ``microbatches``, its cost model
    and the layers of each virtual stage (zb-auto planned with the cost model's layer times).
    Raises :class:`Rejection` if it cannot be built."""
    layout = candidate.layout
    try:
        layers = _stage_layers(problem.shape.layers, layout.pp * candidate.vpp, candidate.layers)
    except ValueError as error:
        raise Rejection("too few layers", str(error)) from None
    # The runtime's shape has no experts yet (models.megatron_shape, ModelConfig.shape): its
    # message order and overlapped pairs are chosen at the dense shape's FLOPs, so the plan takes
    # them there too (as simulate does); the replay still times the experts.
    dense = problem.shape.as_dense()
    run = RunShape(dense, problem.seq_length, tuple(layers) if candidate.layers else None)
    try:
        if candidate.schedule == "zb-auto":  # planned with the cost model's times: the model first,
            schedule = generate("1f1b", layout.pp, microbatches)  # on a schedule of its stages
        else:
            schedule = build_schedule(candidate, microbatches, run=run, pairing_replays=pairing_replays)
    except RequestError as error:
        raise Rejection(f"schedule: {error.flag}", str(error)) from None
    except PartitionError as error:
        raise Rejection("indivisible: slices", str(error)) from None
    try:
        costs = plan_costs(problem, candidate, schedule, layers)
    except PartitionError as error:
        raise Rejection("indivisible: slices", str(error)) from None
    if candidate.schedule == "zb-auto":
        lt = costs.layer_seconds()
        unit = Costs(lt.forward, lt.backward, lt.weight)
        schedule = build_schedule(candidate, microbatches, unit, run, pairing_replays)
    return schedule, costs, layers


def plan_costs(problem: Problem, candidate: Candidate, schedule: Any, layers: list[int]) -> PlanCosts:
    """The cost model of ``candidate``'s ``schedule`` (or a stub of it: what PlanCosts reads)."""
    return PlanCosts(
        problem.shape,
        schedule,
        problem.seq_length,
        candidate.layout,
        problem.profile,
        candidate.micro_batch,
        candidate.recompute,
        layers,
        candidate.recompute_layers,
        candidate.tp_comm_overlap,
        candidate.attention,
        candidate.vocab,
        problem.dispatcher,
        problem.fp8 is not None,
        problem.moe_imbalance,
    )


def evaluate(
    problem: Problem,
    candidate: Candidate,
    full: bool = False,
    check_memory: bool = True,
    pairing_replays: int | None = None,
) -> PlanResult:
    """Simulate ``candidate``. Raises :class:`Rejection` if it cannot be built, or, without
    offload and with ``check_memory``, if its memory (known before any replay) does not fit.
    ``pairing_replays`` caps the replays that choose overlapped pairs (``pairing.pair``)."""
    m = microbatches_of(problem, candidate)
    m_sim = simulated_count(m, candidate, full)
    if m_sim > m:
        raise Rejection(
            "schedule: microbatches", f"{candidate.schedule} needs {m_sim} microbatches, the batch gives {m}"
        )
    schedule, costs, layers = pipeline_of(problem, candidate, m_sim, pairing_replays)
    offloaded = 0
    if candidate.offload == "none" and check_memory:
        memory = _memory(problem, candidate, schedule, costs, peak_activations(schedule, costs), layers)
        if memory.total > problem.profile.memory_bytes:
            raise Rejection("out of memory", f"{candidate.label()}: {memory.total / GIB:.1f} GiB")
    if candidate.offload == "none":
        run = schedule
    else:
        try:
            ratio = round(offload_ratio(schedule, costs), 2) if candidate.offload == "auto" else 0.0
            run = _offloaded(schedule, candidate.offload, ratio)
        except OffloadError as error:
            raise Rejection("schedule: offload", str(error)) from None
        offloaded = run.meta.get("offloaded_units", 0)
    try:
        result = simulate(run, costs, completion=problem.completion)
    except ScheduleError as error:
        raise Rejection("schedule: simulation", str(error)) from None
    return _assemble(problem, candidate, schedule, costs, result, m, layers, offloaded)


def _stage_layers(total: int, stages: int, given: tuple[int, ...] | None) -> list[int]:
    """Layers of each virtual stage: ``stage_layers``'s split, or the run's own (``given``)."""
    if given is None:
        return stage_layers(total, stages)
    if len(given) != stages or sum(given) != total or min(given) < 0:
        raise ValueError(f"layers {list(given)} are not {total} layers over {stages} stages")
    return list(given)


def _per_microbatch_busy(schedule: Any, costs: PlanCosts) -> list[float]:
    """Compute seconds of one microbatch (all slices) on each rank, less what its overlapped pairs
    hide: a rank whose simulated F and B ops are a share q in pairs hides q of each stage's
    all-to-alls behind the partner op (``pairs.hidden_seconds`` of the stage's F and B, as the
    pairs of one chunk position would) in the steady state the extension repeats."""
    backward = OpKind.B if schedule.splits_backward else OpKind.BW
    kinds = (OpKind.F, OpKind.B, OpKind.W) if schedule.splits_backward else (OpKind.F, OpKind.BW)
    share = _paired_share(schedule)
    busy = [0.0] * schedule.pp
    for stage in range(schedule.num_stages):
        rank = schedule.placement.rank_of(stage)
        for j in range(schedule.slices):
            busy[rank] += sum(costs.duration(Op(kind, stage, 0, j)) for kind in kinds)
            if share[rank]:
                hidden = hidden_seconds(Op(OpKind.F, stage, 0, j), Op(backward, stage, 0, j), costs)
                busy[rank] -= share[rank] * hidden
    return busy


def _paired_share(schedule: Any) -> list[float]:
    """Per rank, the share of its F and B (or BW) ops that are in overlapped pairs."""
    paired = [0] * schedule.pp
    for rank, _, _ in iter_pairs(schedule):
        paired[rank] += 2
    if not any(paired):
        return [0.0] * schedule.pp
    kinds = (OpKind.F, OpKind.B, OpKind.BW)
    return [count / max(1, sum(op.kind in kinds for op in ops)) for count, ops in zip(paired, schedule.ranks)]


def _assemble(
    problem: Problem,
    candidate: Candidate,
    schedule: Schedule,
    costs: PlanCosts,
    result: SimResult,
    m: int,
    layers: list[int],
    offloaded: int,
) -> PlanResult:
    layout, shape, profile = candidate.layout, problem.shape, problem.profile
    kernels = Kernels(profile)
    m_sim = schedule.microbatches
    per_mb = _per_microbatch_busy(schedule, costs)
    extra = (m - m_sim) * max(per_mb)
    makespan = result.makespan + extra
    busy = [b + (m - m_sim) * pm for b, pm in zip(result.busy_per_rank, per_mb)]
    bubble = sum((makespan - b) / makespan for b in busy) / len(busy) if makespan > 0 else 0.0

    # Data-parallel gradient reduce-scatter per chunk, on one comm stream per rank. With
    # overlap_grad_reduce the plugin starts a chunk's reduce after its last weight gradient;
    # Megatron's own schedules reduce a bucket (max(40M, 1M x DP) parameters) as soon as the
    # chunk's last backward has produced it: the reduce starts with that backward and ends no
    # sooner than one bucket after it.
    group = layout.dp * layout.cp
    params = stage_params(shape, layers, layout.tp, schedule.placement if candidate.vocab != "none" else None)
    sharded = layout.parallel.distributed_optimizer
    grad_bytes = 4 if candidate.grad_reduce_in_fp32 else shape.bytes_per_element
    bucket = max(40e6, 1e6 * group)
    step_end = makespan
    for rank in range(schedule.pp):
        stages = sorted(schedule.placement.stages_of(rank))
        ready = sorted(zip(_stage_ends(result, rank, stages), (params[s] for s in stages)))
        stream = 0.0
        for (end, last_backward), count in ready:
            seconds = kernels.collective(grad_bytes * count, group, layout.dp_intra) * (1 if sharded else 2)
            if candidate.overlap_grad_reduce and candidate.grad_reduce_buckets:
                start = end + extra - last_backward
                stream = max(
                    stream + seconds, start + seconds, end + extra + seconds * min(1.0, bucket / count)
                )
            elif candidate.overlap_grad_reduce:
                stream = max(stream, end + extra) + seconds
            else:
                stream = max(stream, makespan) + seconds
        step_end = max(step_end, stream)
    grad_exposed = step_end - makespan

    rank_params = [0] * schedule.pp
    for stage, count in enumerate(params):
        rank_params[schedule.placement.rank_of(stage)] += count
    most = max(rank_params)
    shard = most / (group if sharded else 1)
    optimizer = kernels.memory(OPTIMIZER_BYTES_PER_PARAM * shard + 4 * most)
    gather = (
        _param_gather_exposed(candidate, schedule, result, params, group, bucket, kernels) if sharded else 0.0
    )
    step_time = step_end + optimizer + gather

    memory = _memory(problem, candidate, schedule, costs, result.peak_memory_per_rank, layers)
    flops = _model_flops(schedule, costs) * m * layout.dp
    notes = [] if m_sim == m else [f"simulated {m_sim} of {m} microbatches, extended by the steady state"]
    return PlanResult(
        problem=problem,
        candidate=candidate,
        microbatches=m,
        simulated_microbatches=m_sim,
        step_time=step_time,
        pipeline_time=makespan,
        grad_sync_exposed=grad_exposed,
        optimizer_time=optimizer,
        param_gather_exposed=gather,
        bubble=bubble,
        memory=memory,
        model_flops=flops,
        offloaded_units=offloaded,
        notes=notes,
        pairs=count_pairs(schedule),
        experts=_expert_summary(schedule, costs, m) if shape.experts else None,
    )


def _expert_summary(schedule: Schedule, costs: PlanCosts, m: int) -> ExpertSummary:
    """The step's expert all-to-all on the rank with the most of it (one microbatch's, x m) and
    the most a rank's overlapped pairs hide (the simulated pairs', x m / simulated microbatches)."""
    kinds = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)
    per_rank = [0.0] * schedule.pp
    for stage in range(schedule.num_stages):
        rank = schedule.placement.rank_of(stage)
        for j in range(schedule.slices):
            per_rank[rank] += sum(costs.expert_comm_time(Op(kind, stage, 0, j)) for kind in kinds)
    hidden = [0.0] * schedule.pp
    for rank, first, second in iter_pairs(schedule):
        hidden[rank] += hidden_seconds(op_of(first), op_of(second), costs)
    busiest = max(range(schedule.pp), key=lambda r: per_rank[r])
    nvlink, ib = costs.alltoall_parts(0)
    return ExpertSummary(
        alltoall_seconds=per_rank[busiest] * m,
        hidden_seconds=max(hidden) * m / schedule.microbatches,
        nvlink_bytes=nvlink,
        ib_bytes=ib,
        one_alltoall=costs.alltoall_seconds(0),
        tokens_per_expert=costs.tokens_per_expert(0),
        moe_layers=sum(costs.moe_layers),
    )


def _param_gather_exposed(
    candidate: Candidate,
    schedule: Schedule,
    result: SimResult,
    params: list[int],
    group: int,
    bucket: float,
    kernels: Kernels,
) -> float:
    """Seconds the distributed optimizer's parameter all-gather adds to the step. Without
    ``overlap_param_gather`` it runs after the optimizer, whole. With it, Megatron's forward
    pre-hook waits for a bucket's gather and dispatches the next one, in the first forward of
    each chunk: the first bucket waits, the rest hide behind that forward. A rank's wait delays
    the pipeline only beyond the time its first forward waited for its input anyway."""
    link = candidate.layout.dp_intra
    element = 2  # bf16 parameters
    first: dict[int, tuple[float, float]] = {}
    for event in result.events:
        if event.op.kind is OpKind.F and (
            event.op.stage not in first or event.start < first[event.op.stage][0]
        ):
            first[event.op.stage] = (event.start, event.end - event.start)
    worst = 0.0
    for rank in range(schedule.pp):
        stages = sorted(schedule.placement.stages_of(rank))
        waited = 0.0
        for stage in stages:
            whole = kernels.collective(element * params[stage], group, link)
            if not candidate.overlap_param_gather:
                waited += whole
                continue
            head = whole * min(1.0, bucket / max(1, params[stage]))
            waited += head + max(0.0, whole - head - first.get(stage, (0.0, 0.0))[1])
        slack = first.get(stages[0], (0.0, 0.0))[0] if candidate.overlap_param_gather else 0.0
        worst = max(worst, waited - slack)
    return max(0.0, worst)


def _stage_ends(result: SimResult, rank: int, stages: list[int]) -> list[tuple[float, float]]:
    """(end, duration) of the last weight-gradient op of each of ``stages`` (on ``rank``)."""
    last: dict[int, tuple[float, float]] = {}
    for event in result.events:
        if event.rank == rank and event.op.kind in (OpKind.W, OpKind.BW):
            if event.end >= last.get(event.op.stage, (0.0, 0.0))[0]:
                last[event.op.stage] = (event.end, event.end - event.start)
    return [last.get(s, (result.makespan, 0.0)) for s in stages]


def _model_flops(schedule: Schedule, costs: PlanCosts) -> float:
    """Model FLOPs of one microbatch (forward, input and weight gradients; no recompute; with
    vocabulary parallelism the output layer's S and T on every rank)."""
    total = 0.0
    last = schedule.num_stages - 1
    for j in range(schedule.slices):
        for stage in range(schedule.num_stages):
            total += sum(costs.flops(Op(kind, stage, 0, j)) for kind in (OpKind.F, OpKind.B, OpKind.W))
        if costs.vocab != "none":
            total += schedule.pp * sum(costs.flops(Op(kind, last, 0, j)) for kind in (OpKind.S, OpKind.T))
    return total


def _memory(
    problem: Problem,
    candidate: Candidate,
    schedule: Schedule,
    costs: PlanCosts,
    peaks: list[float],
    layers: list[int],
) -> MemoryBreakdown:
    """The rank with the largest total: static parts, activation peak, buffers, reserve."""
    layout, shape = candidate.layout, problem.shape
    static = static_parts(shape, schedule.placement, layout.parallel, layers, candidate.vocab)
    e = shape.bytes_per_element
    longest = candidate.micro_batch * max(costs.lengths)
    buffers = 4 * longest * shape.hidden * e / layout.parallel.sequence_split  # p2p in flight
    if layout.tp > 1:
        buffers += 2 * longest / layout.cp * shape.hidden * e  # SP all-gathered layer inputs
    if layout.cp > 1:
        buffers += longest * 2 * shape.kv_width / layout.tp * e  # one slice's gathered K/V
    transient = costs.recompute_working_set()
    best: MemoryBreakdown | None = None
    for parts, peak in zip(static, peaks):
        candidate_memory = MemoryBreakdown(
            weights=parts.weights,
            gradients=parts.gradients,
            optimizer=parts.optimizer,
            activations=peak + transient,
            comm_buffers=buffers,
            reserved=problem.profile.reserved_bytes,
            experts=parts.experts,
        )
        if best is None or candidate_memory.total > best.total:
            best = candidate_memory
    assert best is not None
    return best


def lower_bound_memory(
    problem: Problem,
    candidate: Candidate,
    costs: PlanCosts,
    schedule: Schedule,
    in_flight: tuple[int, ...] | None = None,
) -> float:
    """Bytes some rank must hold at least, without offload: its static parts and activations.
    The rank holding the last stage holds, when the last stage starts its first backward, every
    slice of microbatch 0 on all of its stages (they all ran their forwards and none of their
    backwards yet); with ``in_flight`` (each rank's most forward units held at once by the
    schedule's op order, ``search.units_in_flight``) every rank holds that many of its smallest."""
    layout = candidate.layout
    layers = costs.layers
    static = static_parts(problem.shape, schedule.placement, layout.parallel, layers, candidate.vocab)
    rank = schedule.placement.rank_of(schedule.num_stages - 1)
    held = sum(
        costs.activation(Op(OpKind.F, stage, 0, j))
        for stage in schedule.placement.stages_of(rank)
        for j in range(schedule.slices)
    )
    bound = [parts.weights + parts.gradients + parts.optimizer for parts in static]
    worst = bound[rank] + held
    for r, units in enumerate(in_flight or ()):
        smallest = min(
            costs.activation(Op(OpKind.F, stage, 0, j))
            for stage in schedule.placement.stages_of(r)
            for j in range(schedule.slices)
        )
        worst = max(worst, bound[r] + units * smallest)
    return worst + problem.profile.reserved_bytes


def static_parts(
    shape: ModelShape, placement: Placement, parallel: Any, layers: list[int], vocab: str
) -> list[Any]:
    """Weights, gradients and optimizer state per rank, the vocabulary spread when it is."""
    if vocab == "none":
        return static_memory(shape, placement, parallel, layers)
    return vocab_static_memory(shape, placement, parallel, layers)


def lower_bound_time(schedule: Any, costs: PlanCosts, microbatches: int, paired: bool = False) -> float:
    """The busiest rank's compute for the whole step: no schedule can finish sooner. Closed form:
    the rank's dense and MoE layers times one such layer's F+B+W over the slices (with overlapped
    pairs, ``paired``, less the MoE layers' all-to-alls, which a pair may hide), the layers
    recomputation reruns, and the output layer (or every rank's vocabulary passes)."""
    split = schedule.splits_backward

    def per_layer(times: LayerTimes) -> float:
        return (times.forward + times.backward + times.weight) if split else (times.forward + times.fused)

    slices = range(schedule.slices)
    dense = sum(per_layer(costs.layer_seconds(j)) for j in slices)
    dense_rerun = sum(costs.layer_seconds(j).recompute for j in slices)
    moe = moe_rerun = 0.0
    if costs.shape.experts:
        moe = sum(per_layer(costs.moe_layer_seconds(j)) for j in slices)
        moe_rerun = sum(costs.moe_layer_seconds(j).recompute for j in slices)
        if paired:  # dispatch and combine in F, their gradients in B
            moe -= sum(4 * costs.alltoall_seconds(j) for j in slices)
    head = sum(per_layer(costs.head_seconds(j)) for j in slices)
    placement = schedule.placement
    last = placement.rank_of(schedule.num_stages - 1)
    if costs.vocab != "none":  # every rank runs its share of the output layer
        shared = sum(sum(costs.vocab_seconds(j)) for j in slices)
    busiest = 0.0
    for rank in range(schedule.pp):
        stages = placement.stages_of(rank)
        moe_layers = sum(costs.moe_layers[s] for s in stages)
        dense_layers = sum(costs.layers[s] for s in stages) - moe_layers
        rerun_moe = sum(costs.recomputed_moe_layers(s) for s in stages)
        rerun_dense = sum(costs.recomputed_layers(s) for s in stages) - rerun_moe
        output = shared if costs.vocab != "none" else (head if rank == last else 0.0)
        busy = dense_layers * dense + moe_layers * moe + rerun_dense * dense_rerun + rerun_moe * moe_rerun
        busiest = max(busiest, busy + output)
    return busiest * microbatches


__all__ = [
    "Candidate",
    "MemoryBreakdown",
    "PlanResult",
    "Problem",
    "Rejection",
    "evaluate",
    "lower_bound_memory",
    "lower_bound_time",
    "pipeline_of",
]
