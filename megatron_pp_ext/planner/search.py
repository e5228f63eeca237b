"""The search: every valid layout and pipeline choice, pruned by cheap bounds, the rest simulated.

1. Layouts: every TP x CP x PP x DP factorisation of the GPU count that Megatron accepts for the
   model, sequence and batch (``layout.layout_problem``), and whose weights, gradients and
   optimizer state fit at all; for a mixture-of-experts model each also with every expert layout
   (EP dividing the experts, ETP = TP or 1: ``layout.expert_layouts``).
2. Pipeline choices per layout: each schedule with its chunk counts (even layer splits, and
   Megatron's uneven ones where the layers do not divide or where one beats the even split with
   the output layer on the last rank: ``layer_split.uneven_splits``), slice
   counts for the sequence-sliced families (slices of at least ``MIN_SLICE`` tokens), micro-batch
   sizes (powers of two dividing a DP rank's share of the batch, unless pinned: grown from 1 until
   the memory bound no longer fits), and, only where the plain choice cannot fit, activation
   offload or full recomputation (they cost time, so they never win otherwise).
3. Bounds without simulating: a memory lower bound (what the last stage's rank must hold when
   its first backward starts) rejects what cannot fit, and a time lower bound (the busiest rank's
   compute) orders the rest.
4. Branch and bound: candidates are simulated in order of their time bound; once N plans fit,
   anything whose bound is above the N-th best step time cannot enter the top N and is pruned.
   A budget of simulations caps the work; the result says whether the top N is proven.
5. The top N are simulated again with every microbatch (the search simulates at most 2p).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from types import SimpleNamespace

from ..schedule.flops import head_layers
from ..schedule.generators import SCHEDULES, RequestError, generate
from ..schedule.ir import OpKind, Placement
from ..schedule.layer_split import LayerSplitFlags, megatron_stage_layers, uneven_splits
from ..schedule.memory_model import stage_layers
from ..schedule.partition import PartitionError
from .costs import PlanCosts
from .layout import Layout, divisors, layout_problem
from .pins import SLICED_FAMILIES, Pins
from .step import (
    Candidate,
    PlanResult,
    Problem,
    Rejection,
    evaluate,
    lower_bound_memory,
    lower_bound_time,
    microbatches_of,
    pairing_refusal,
    plan_costs,
    simulated_count,
    static_parts,
)

MIN_SLICE = 4096  # tokens: shorter slices leave the GEMMs too small to be worth it
MAX_SLICES = 32
MAX_UNITS_PER_RANK = 160  # chunks x slices of one microbatch on a rank (SlimPipe's largest: 5 x 32)


@dataclass
class SearchResult:
    plans: list[PlanResult]
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    considered: int = 0
    simulated: int = 0
    pruned: int = 0
    proven: bool = True
    seconds: float = 0.0

    def reject(self, reason: str, detail: str, count: int = 1) -> None:
        self.rejected[reason] += count
        self.examples.setdefault(reason, detail)


@cache
def units_in_flight(name: str, pp: int, microbatches: int, vpp: int, slices: int) -> tuple[int, ...] | None:
    """Each rank's most forward units (stage x slice of a microbatch) held at once in ``name``'s
    op order, a backward freeing its unit (it keeps less than the forward's activation); None
    where the schedule cannot be made at these sizes or is planned from costs (zb-auto: its op
    order depends on the cost model, so no count here bounds it)."""
    if name == "zb-auto":
        return None
    try:
        schedule = generate(name, pp, microbatches, vpp=vpp, slices=slices)
    except (RequestError, PartitionError, ValueError):
        return None
    counts = []
    for ops in schedule.ranks:
        level = peak = 0
        for op in ops:
            if op.kind is OpKind.F:
                level += 1
                peak = max(peak, level)
            elif op.kind in (OpKind.B, OpKind.BW):
                level -= 1
        counts.append(peak)
    return tuple(counts)


@cache
def splits_backward(name: str) -> bool:
    """Whether ``name`` splits backward into B and W (checked on a small instance)."""
    spec = SCHEDULES[name]
    vpp = spec.default_vpp
    slices = max(1, spec.min_slices(2, vpp))
    return generate(
        name, 2, max(4, spec.min_microbatches(2, vpp, slices)), vpp=vpp, slices=slices
    ).splits_backward


def chunk_options(name: str, layers: int, pp: int) -> list[int]:
    """Chunks per rank ``name`` can take with an even split of ``layers`` over ``pp`` ranks."""
    spec = SCHEDULES[name]
    if spec.allowed_vpp is not None:
        return [v for v in spec.allowed_vpp if layers % (pp * v) == 0]
    if layers % pp:
        return []
    return [v for v in divisors(layers // pp) if v >= max(2, spec.min_vpp)]


def chunk_splits(
    name: str, layers: int, pp: int, ends: tuple[float, float] = (1.0, 1.0)
) -> list[tuple[int, LayerSplitFlags | None]]:
    """(chunks per rank, Megatron's split flags) ``name`` can take over ``pp`` ranks: the even
    splits, and Megatron's uneven ones (``uneven_splits``: every virtual stage keeps a layer)
    where the layers do not divide or where they beat the even split, the first and last rank
    carrying ``ends`` (the embedding's and the output layer's work, in layers)."""
    options: list[tuple[int, LayerSplitFlags | None]] = [(v, None) for v in chunk_options(name, layers, pp)]
    spec = SCHEDULES[name]
    counts = (
        spec.allowed_vpp if spec.allowed_vpp is not None else range(max(2, spec.min_vpp), layers // pp + 1)
    )
    return options + [(v, split) for v in counts for split in uneven_splits(layers, pp, v, ends=ends)]


def slice_options(name: str, seq_length: int, multiple: int, pp: int, vpp: int) -> list[int]:
    """Slice counts: 1 for whole-sequence schedules; powers of two from 2 for the sliced ones,
    each slice a multiple of the layout's sequence multiple and at least ``MIN_SLICE`` tokens."""
    if name not in SLICED_FAMILIES:
        return [1]
    needed = SCHEDULES[name].min_slices(pp, vpp)
    options = []
    k = 2
    while k <= MAX_SLICES and seq_length // k >= MIN_SLICE:
        if seq_length % (k * multiple) == 0 and k >= needed:
            options.append(k)
        k *= 2
    return options


def pipeline_choices(
    problem: Problem, layout: Layout, names: list[str], pins: Pins | None = None
) -> list[tuple[str, int, int, LayerSplitFlags | None]]:
    """(schedule, chunks per rank, slices, Megatron's split flags or None for an even split) for
    ``layout``, within ``pins``; one pipeline rank runs 1F1B only."""
    pins = pins or Pins()
    layers = problem.shape.layers
    multiple = math.lcm(8, layout.parallel.sequence_multiple)
    # the last stage's output layer, unless vocabulary parallelism spreads it over every rank
    head = head_layers(problem.shape, problem.seq_length) if (pins.vocab or "none") == "none" else 0.0
    ends = (0.0, round(head, 2))
    choices = []
    for name in pins.schedules(names):
        if layout.pp == 1 and name not in ("1f1b", "slimpipe"):
            continue
        for vpp, split in chunk_splits(name, layers, layout.pp, ends) if layout.pp > 1 else [(1, None)]:
            if not pins.chunks_allowed(layers, layout.pp, vpp):
                continue
            for k in slice_options(name, problem.seq_length, multiple, layout.pp, vpp):
                if vpp * k <= MAX_UNITS_PER_RANK and pins.slices_allowed(k):
                    choices.append((name, vpp, k, split))
    return choices


def _stub(candidate: Candidate) -> SimpleNamespace:
    """What PlanCosts and the bounds read of a schedule, without generating one."""
    spec = SCHEDULES[candidate.schedule]
    layout = candidate.layout
    stages = layout.pp * candidate.vpp
    return SimpleNamespace(
        meta={"partition": spec.default_partition},
        slices=candidate.slices,
        num_stages=stages,
        pp=layout.pp,
        placement=Placement(layout.pp, stages, spec.placement),
        splits_backward=splits_backward(candidate.schedule),
    )


# The bounds' cost models, shared by candidates that differ only in schedule and pairing (what a
# cost model reads of the schedule is its stages, slices and partition).
_BOUND_COSTS: dict[tuple, PlanCosts] = {}


def bounds(problem: Problem, candidate: Candidate) -> tuple[float, float]:
    """(time lower bound in s, memory lower bound in bytes; 0 when offloading)."""
    stub = _stub(candidate)
    layers = (
        list(candidate.layers) if candidate.layers else stage_layers(problem.shape.layers, stub.num_stages)
    )
    key = (
        problem, candidate.layout, candidate.micro_batch, candidate.recompute, candidate.recompute_layers,
        candidate.tp_comm_overlap, candidate.attention, candidate.vocab, tuple(layers), stub.num_stages,
        stub.slices, stub.meta["partition"],
    )  # fmt: skip
    costs = _BOUND_COSTS.get(key)
    if costs is None:
        if len(_BOUND_COSTS) >= 4096:
            _BOUND_COSTS.clear()
        costs = _BOUND_COSTS[key] = plan_costs(problem, candidate, stub, layers)
    m = microbatches_of(problem, candidate)
    seconds = lower_bound_time(stub, costs, m, paired=candidate.pairs)
    if candidate.offload == "none":
        counted = simulated_count(m, candidate, False)
        in_flight = units_in_flight(
            candidate.schedule, candidate.layout.pp, counted, candidate.vpp, candidate.slices
        )
        memory = lower_bound_memory(problem, candidate, costs, stub, in_flight)  # type: ignore[arg-type]
        return seconds, memory
    return seconds, 0.0


def static_fits(problem: Problem, layout: Layout, vocab: str = "none") -> float:
    """Largest weights + gradients + optimizer state of a rank, plus the reserve (bytes)."""
    layers = stage_layers(problem.shape.layers, layout.pp)
    static = static_parts(problem.shape, Placement(layout.pp, layout.pp), layout.parallel, layers, vocab)
    return max(p.weights + p.gradients + p.optimizer for p in static) + problem.profile.reserved_bytes


def memory_savers(candidate: Candidate, pins: Pins | None = None) -> list[Candidate]:
    """Variants that trade time for memory, where not pinned: offload, and recomputation where
    the plugin runs Megatron's (whole sequences, no CP, fused backward): full, and selective when
    the attention is unfused (with a flash kernel it would keep nothing less)."""
    pins = pins or Pins()
    name, k = candidate.schedule, candidate.slices
    offloads = [candidate.offload] if pins.offload is not None else ["none", "auto"]
    recomputes = [candidate.recompute]
    if pins.recompute is None and k == 1 and candidate.layout.cp == 1 and not splits_backward(name):
        recomputes += (["selective"] if candidate.attention == "unfused" else []) + ["full"]
    variants = [
        replace(candidate, offload=offload, recompute=recompute)
        for recompute in recomputes
        for offload in offloads
        if (offload, recompute) != (candidate.offload, candidate.recompute)
    ]
    # overlapped pairs run neither offload nor full recomputation: the unpaired twin saves memory
    return [v for v in variants if not v.pairs or (v.offload == "none" and v.recompute != "full")]


def micro_batch_options(problem: Problem, layout: Layout, pins: Pins) -> list[int]:
    """Micro-batch sizes to try on ``layout``, smallest first: the pin, or the powers of two that
    divide a DP rank's share of the global batch (Megatron needs a whole number of microbatches).
    In the cost model a larger one pays fewer launch gaps and latencies per token and gives the
    DP parameter gather and gradient reduce a longer first forward and last backward to hide
    behind, but leaves fewer microbatches to fill the pipeline and holds more activations."""
    if pins.micro_batch is not None:
        return [pins.micro_batch]
    per_rank = problem.global_batch // layout.dp
    sizes = [1]
    while per_rank % (sizes[-1] * 2) == 0:
        sizes.append(sizes[-1] * 2)
    return sizes


def enough_microbatches(problem: Problem, candidate: Candidate) -> bool:
    """Whether the candidate's batch gives its schedule the microbatches it needs (DualPipeV)."""
    layout = candidate.layout
    needed = SCHEDULES[candidate.schedule].min_microbatches(layout.pp, candidate.vpp, candidate.slices)
    return microbatches_of(problem, candidate) >= needed


def _group(candidate: Candidate) -> tuple:
    """Candidates that differ only in chunks and slices: their estimates err alike (not across
    micro-batch sizes: the microbatch count changes the bubble the estimate guesses)."""
    return (
        candidate.layout,
        candidate.schedule,
        candidate.offload,
        candidate.recompute,
        candidate.micro_batch,
    )


Progress = Callable[["SearchResult", int, "float | None"], None]
ESTIMATE_MARGIN = 0.01  # stop once the estimates are this much slower than the N-th best

# Share of 1F1B's fill-and-drain idle time each schedule keeps, with T_F = T_B = T_W
# (REFERENCE.md secs. 1-4): only to order the queue; the simulator decides.
BUBBLE_SHARE = {
    "zb-h1": 1 / 3,
    "zb-auto": 1 / 3,
    "uniform-interleaved": 1 / 3,
    "zb-h2": 0.05,
    "v-min": 2 / 3,
    "v-half": 1 / 2,
    "v-zb": 0.05,
    "dualpipev": 0.3,
}


def estimated_bubble(candidate: Candidate, microbatches: int) -> float:
    """Idle time over busy time: (p-1) units of 1/(v k) microbatch each, against m microbatches."""
    p = candidate.layout.pp
    units = candidate.vpp * candidate.slices * microbatches
    return BUBBLE_SHARE.get(candidate.schedule, 1.0) * (p - 1) / units


class _Search:
    """The branch and bound of :func:`search` (state shared by its steps)."""

    def __init__(self, problem: Problem, top: int, progress: Progress | None, pins: Pins) -> None:
        self.problem, self.top, self.progress, self.pins = problem, top, progress, pins
        self.result = SearchResult(plans=[])
        self.heap: list[tuple[float, int, float, Candidate]] = []
        self.best: list[PlanResult] = []
        # simulated step over the queue's estimate, per group and per schedule
        self.correction: dict[tuple, float] = {}
        self.schedule_correction: dict[str, float] = {}
        self.saved: set[Candidate] = set()

    def push(self, candidate: Candidate) -> bool:
        """Queue ``candidate`` by its estimate; False when its bounds already reject it."""
        self.result.considered += 1
        try:
            seconds, memory = bounds(self.problem, candidate)
        except (PartitionError, ValueError) as error:
            self.result.reject("indivisible: slices", f"{candidate.label()}: {error}")
            return False
        if memory > self.problem.profile.memory_bytes:
            self.result.reject("out of memory", f"{candidate.label()}: at least {memory / 2**30:.1f} GiB")
            self.save_memory(candidate)
            return False
        m = microbatches_of(self.problem, candidate)
        estimate = seconds * (1 + estimated_bubble(candidate, m))
        heapq.heappush(self.heap, (estimate, self.result.considered, seconds, candidate))
        return True

    def push_micro_batches(self, candidate: Candidate, sizes: list[int]) -> None:
        """``candidate`` at each of ``sizes`` (ascending), stopping at the first that its bounds
        reject: a larger micro-batch holds more activations and slices no differently, so it
        cannot pass either (the rejected one still gets its memory savers)."""
        for size in sizes:
            sized = replace(candidate, micro_batch=size)
            if size != sizes[0] and not enough_microbatches(self.problem, sized):
                return
            if not self.push(sized):
                return

    def save_memory(self, candidate: Candidate) -> None:
        plain = replace(
            candidate, offload=self.pins.offload or "none", recompute=self.pins.recompute or "none"
        )
        if candidate == plain and candidate not in self.saved:
            self.saved.add(candidate)
            for saver in memory_savers(candidate, self.pins):
                self.push(saver)

    def threshold(self) -> float:
        return self.best[self.top - 1].step_time if len(self.best) >= self.top else math.inf

    def run(self, max_simulations: int) -> None:
        """Pop by estimate; prune by the bound (exact) or by a simulated shape's own ratio."""
        result = self.result
        while self.heap:
            estimate, _, bound, candidate = heapq.heappop(self.heap)
            threshold = self.threshold()
            if estimate > threshold * (1 + ESTIMATE_MARGIN):
                left = len(self.heap) + 1
                result.reject(
                    "slower than the top plans (estimate)",
                    f"{candidate.label()}: about {estimate:.2f} s",
                    left,
                )
                self.heap.clear()
                break
            if bound >= threshold:
                result.reject(
                    "slower than the top plans (bound)", f"{candidate.label()}: at least {bound:.2f} s"
                )
                continue
            factor = self.correction.get(_group(candidate), self.schedule_correction.get(candidate.schedule))
            if factor is not None and estimate * factor > threshold * (1 + ESTIMATE_MARGIN):
                about = f"{candidate.label()}: about {estimate * factor:.2f} s"
                result.reject("slower than the top plans (estimate)", about)
                continue
            if result.simulated >= max_simulations:
                result.proven = False
                left = len(self.heap) + 1
                result.reject(
                    "not simulated (budget)", f"{candidate.label()} and the rest of the queue", left
                )
                self.heap.clear()
                break
            self.evaluate(candidate, estimate)
            if self.progress is not None:
                self.progress(result, len(self.heap), self.best[0].step_time if self.best else None)

    def evaluate(self, candidate: Candidate, estimate: float) -> None:
        try:
            plan = evaluate(self.problem, candidate, pairing_replays=SEARCH_PAIRING_REPLAYS)
        except Rejection as error:
            self.result.reject(
                error.reason,
                error.detail if candidate.label() in error.detail else f"{candidate.label()}: {error.detail}",
            )
            if error.reason == "out of memory":
                self.save_memory(candidate)
            return
        self.result.simulated += 1
        factor = plan.step_time / estimate if estimate > 0 else 1.0
        self.correction[_group(candidate)] = min(factor, self.correction.get(_group(candidate), factor))
        self.schedule_correction.setdefault(candidate.schedule, factor)
        if not plan.fits:
            self.result.reject("out of memory", f"{candidate.label()}: {plan.memory_gib:.1f} GiB")
            self.save_memory(candidate)
            return
        if candidate.pairs and not plan.pairs:  # pairing took no pair: its unpaired twin
            self.result.reject("EP overlap: no pair that does not lengthen the step", candidate.label())
            return
        self.best.append(plan)
        self.best.sort(key=lambda p: p.step_time)


# Replays one paired candidate's pairing may take in the search (``pairing.pair``: one a rank
# where all its pairs go at once, one a pair where not); past it the rest stays unpaired, so the
# search may rank such a plan a little slower than the run, which pairs them all, would be.
SEARCH_PAIRING_REPLAYS = 48
PAIRED_FULL_UNITS = 256  # a paired plan is replayed whole only this small: pairing replays the step per pair


def search(
    problem: Problem,
    top: int = 10,
    schedules: list[str] | None = None,
    max_simulations: int = 300,
    progress: Progress | None = None,
    pins: Pins | None = None,
) -> SearchResult:
    """Rank plans for ``problem`` within ``pins``; the result's ``plans`` fit in memory, best
    first. A mixture-of-experts model's candidates come with and without overlapped F&B pairs
    (only with when ``pins.pairs`` asks for them)."""
    start = time.perf_counter()
    pins = pins or Pins()
    state = _Search(problem, top, progress, pins)
    result = state.result
    options = pins.candidate_options()
    for layout in pins.layouts(problem.gpus, problem.gpus_per_node, problem.shape):
        found = layout_problem(
            layout, problem.shape, problem.seq_length, problem.global_batch, pins.micro_batch or 1
        )
        if found:
            result.reject(*found)
            continue
        static = static_fits(problem, layout, pins.vocab or "none")
        if static > problem.profile.memory_bytes:
            result.reject(
                "out of memory: weights, gradients, optimizer",
                f"{layout.label()}: {static / 2**30:.1f} GiB before any activation",
            )
            continue
        choices = pipeline_choices(problem, layout, schedules or list(SCHEDULES), pins)
        if not choices:
            result.reject("no schedule for the pins", f"{layout.label()}: {', '.join(pins.pinned) or 'none'}")
        sizes = micro_batch_options(problem, layout, pins)
        for name, vpp, k, split in choices:
            layers = (
                None
                if split is None
                else tuple(megatron_stage_layers(problem.shape.layers, layout.pp, vpp, split))
            )
            candidate = Candidate(layout, name, vpp, k, layers=layers, split=split, **options)
            for pairs in (False, True):
                variant = replace(candidate, pairs=pairs)
                if pins.pairs_allowed(pairs) and not (pairs and pairing_refusal(problem, variant)):
                    state.push_micro_batches(variant, sizes)
    state.run(max_simulations)
    result.plans = _resimulate(problem, state.best[:top])
    result.seconds = time.perf_counter() - start
    return result


FULL_SIMULATION_UNITS = 20_000


def _resimulate(problem: Problem, plans: list[PlanResult]) -> list[PlanResult]:
    """The plans again with every microbatch simulated (when the schedule stays small enough);
    a plan whose full replay no longer fits is dropped."""
    final = []
    for plan in plans:
        c = plan.candidate
        units = c.layout.pp * c.vpp * c.slices * plan.microbatches
        limit = PAIRED_FULL_UNITS if c.pairs else FULL_SIMULATION_UNITS
        if plan.simulated_microbatches < plan.microbatches and units <= limit:
            try:
                plan = evaluate(problem, c, full=True)
            except Rejection:
                continue
            if not plan.fits:
                continue
        final.append(plan)
    final.sort(key=lambda p: p.step_time)
    return final
