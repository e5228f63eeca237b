"""A given run, predicted: every layout choice pinned (``plan --from-args``, ``--from-sbatch``, the
published runs of ``published.py``), evaluated with every microbatch, and the free search's best
plan beside it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..schedule.memory_model import ParallelError, check_experts
from .layout import layout_problem
from .pins import PinError, Pins
from .search import PAIRED_FULL_UNITS, SearchResult, search
from .step import Candidate, PlanResult, Problem, Rejection, evaluate, pairing_refusal

PREDICT_FULL_UNITS = 40_000  # one run is replayed whole up to this many (stage, microbatch, slice) units

# layout_problem's reasons -> the flag that fixes them
REASON_FLAGS = {
    "indivisible: TP": "--tensor-model-parallel-size",
    "TP across nodes": "--tensor-model-parallel-size",
    "indivisible: sequence": "--seq-length",
    "indivisible: layers": "--pipeline-model-parallel-size",
    "indivisible: batch": "--global-batch-size",
}


def pinned_candidate(problem: Problem, pins: Pins) -> Candidate:
    """The one candidate ``pins`` describe (TP, CP, PP, chunks, schedule and slices all pinned; the
    micro-batch size too, Megatron's 1 when not). Raises PinError for a layout Megatron would
    refuse."""
    missing = [pins.flag(n) for n in ("tp", "cp", "pp", "schedule") if getattr(pins, n) is None]
    if missing:
        raise PinError(missing[0], f"a run to predict pins {', '.join(missing)}")
    pins.check(problem.shape, problem.gpus, problem.gpus_per_node)
    layout = next(replace(pins, ep=None, etp=None).layouts(problem.gpus, problem.gpus_per_node))
    if pins.ep is not None or pins.etp is not None:  # Megatron's defaults: EP 1, ETP = TP
        try:
            layout = replace(layout, ep=pins.ep or 1, etp=pins.etp)
            check_experts(problem.shape, layout.parallel)
        except ParallelError as error:
            raise PinError(error.flag, str(error)) from None
        except ValueError as error:
            raise PinError(pins.flag("ep"), str(error)) from None
    micro_batch = pins.micro_batch or 1
    found = layout_problem(layout, problem.shape, problem.seq_length, problem.global_batch, micro_batch)
    if found and not (found[0] == "indivisible: layers" and not pins.even_layers):
        reason, detail = found
        raise PinError(REASON_FLAGS.get(reason, "--from-args"), detail)
    vpp = pins.vpp or 1
    if pins.layers_per_virtual_stage is not None:
        vpp = problem.shape.layers // (layout.pp * pins.layers_per_virtual_stage)
    candidate = Candidate(
        layout,
        pins.schedule,  # type: ignore[arg-type]
        vpp,
        pins.slices or 1,
        micro_batch=micro_batch,
        layers=pins.stage_layers,
        pairs=bool(pins.pairs),
        **pins.candidate_options(),
    )
    refusal = pairing_refusal(problem, candidate) if candidate.pairs else None
    if refusal:
        raise PinError(pins.flag("pairs"), f"{pins.flag('pairs')}: {refusal}")
    return candidate


def predict(problem: Problem, pins: Pins) -> PlanResult:
    """The pinned run through the cost model and simulator, every microbatch when the schedule
    stays small enough; its memory is reported, not checked (``fits`` says)."""
    candidate = pinned_candidate(problem, pins)
    layout = candidate.layout
    microbatches = problem.global_batch // (layout.dp * candidate.micro_batch)
    limit = PAIRED_FULL_UNITS if candidate.pairs else PREDICT_FULL_UNITS
    full = layout.pp * candidate.vpp * candidate.slices * microbatches <= limit
    try:
        return evaluate(problem, candidate, full=full, check_memory=False)
    except Rejection as error:
        raise PinError(pins.flag("schedule"), f"{candidate.label()}: {error.detail}") from None


@dataclass
class Prediction:
    run: PlanResult
    search: SearchResult

    @property
    def alternative(self) -> PlanResult | None:
        """The search's best plan when it beats the run (or the run does not fit)."""
        best = self.search.plans[0] if self.search.plans else None
        if best is None or (self.run.fits and best.step_time >= self.run.step_time):
            return None
        return best

    @property
    def speedup(self) -> float:
        alternative = self.alternative
        return self.run.step_time / alternative.step_time if alternative else 1.0


def predict_and_compare(problem: Problem, pins: Pins, max_simulations: int = 300, top: int = 5) -> Prediction:
    """The run, and the free search over the same model, batch and GPUs, as the plugin would run
    it (Transformer Engine's TP overlap kept as the run has it; the micro-batch size searched)."""
    run = predict(problem, pins)
    free = Pins(tp_comm_overlap=pins.tp_comm_overlap)
    found = search(problem, top=top, max_simulations=max_simulations, pins=free)
    return Prediction(run, with_run(found, run, top))


def with_run(found: SearchResult, run: PlanResult, top: int) -> SearchResult:
    """The search's plans with the run among them when it fits and would rank: the search prunes
    by estimates before it simulates, so it may miss a layout it could have chosen, but it never
    answers with plans slower than the run it was shown."""
    if not run.fits or any(plan.candidate == run.candidate for plan in found.plans):
        return found
    plans = sorted([*found.plans, run], key=lambda plan: plan.step_time)[:top]
    return replace(found, plans=plans)
