"""The search's answer as text: the ranked table, the top plan's memory, and why the rest lost."""

from __future__ import annotations

from ..schedule.layer_split import split_flags
from .emit import parallel_flags
from .predict import Prediction
from .search import SearchResult
from .step import PlanResult, layer_runs


def plan_row(rank: int, plan: PlanResult) -> dict[str, str]:
    c, m = plan.candidate, plan.memory.to_gib()
    return {
        "#": str(rank),
        "TP": str(c.layout.tp),
        "CP": str(c.layout.cp),
        "PP": str(c.layout.pp),
        "DP": str(c.layout.dp),
        "schedule": c.schedule,
        "v": str(c.vpp),
        "k": str(c.slices),
        "mb": str(c.micro_batch),
        "offload": c.offload,
        "recompute": c.recompute,
        "step s": f"{plan.step_time:.3f}",
        "tok/s/GPU": f"{plan.tokens_per_s_per_gpu:.0f}",
        "MFU": f"{plan.mfu:.1%}",
        "GiB": f"{m['total']:.1f}",
        "= W+G+O": f"{m['weights']:.1f}+{m['gradients']:.1f}+{m['optimizer']:.1f}",
        "+ act": f"{m['activations']:.1f}",
        "+ comm": f"{m['comm_buffers']:.1f}",
        "+ rsv": f"{m['reserved']:.1f}",
        "bubble": f"{plan.bubble:.3f}",
    }


def table(rows: list[dict[str, str]]) -> str:
    headers = list(rows[0])
    widths = {h: max(len(h), *(len(r[h]) for r in rows)) for h in headers}
    lines = ["  ".join(h.rjust(widths[h]) for h in headers)]
    lines.append("  ".join("-" * widths[h] for h in headers))
    lines += ["  ".join(r[h].rjust(widths[h]) for h in headers) for r in rows]
    return "\n".join(lines)


def summary(result: SearchResult, title: str) -> str:
    lines = [title, table([plan_row(i + 1, p) for i, p in enumerate(result.plans)])]
    best = result.plans[0]
    capacity = best.problem.profile.memory_bytes / 2**30
    lines.append(
        f"top plan, per GPU: {best.memory_gib:.1f} GiB = {memory_parts(best)} (of {capacity:.1f}); "
        f"{step_parts(best)}"
    )
    lines.extend(f"  note: {note}" for note in best.notes)
    lines.extend(uneven_splits_of(result.plans))
    lines.append(rejections(result))
    return "\n".join(lines)


def uneven_splits_of(plans: list[PlanResult]) -> list[str]:
    """One line per plan of the table whose layers Megatron splits unevenly: the split and its flags."""
    lines = []
    for rank, plan in enumerate(plans, 1):
        c = plan.candidate
        if c.split is not None and c.layers is not None:
            lines.append(f"  plan {rank}: layers {layer_runs(c.layers)} ({' '.join(split_flags(c.split))})")
    return lines


def rejections(result: SearchResult) -> str:
    proof = (
        "the top plans are proven by the bounds" if result.proven else "simulation budget spent: best found"
    )
    lines = [
        f"searched {result.considered} candidates, simulated {result.simulated} in {result.seconds:.1f} s "
        f"({proof}); not in the table:"
    ]
    for reason, count in result.rejected.most_common():
        lines.append(f"  {reason}: {count} (e.g. {result.examples[reason]})")
    return "\n".join(lines)


def memory_parts(plan: PlanResult) -> str:
    """'weights W + gradients G + ... + reserved R' in GiB: one GPU's memory by part."""
    parts = plan.memory.to_gib()
    return (
        f"weights {parts['weights']:.1f} + gradients {parts['gradients']:.1f} + optimizer "
        f"{parts['optimizer']:.1f} + activations {parts['activations']:.1f} + communication buffers "
        f"{parts['comm_buffers']:.1f} + reserved {parts['reserved']:.1f}"
    )


def step_parts(plan: PlanResult) -> str:
    """Where the step goes: the pipeline and what the data-parallel step adds to it."""
    return (
        f"step = pipeline {plan.pipeline_time:.3f} s + exposed gradient sync "
        f"{plan.grad_sync_exposed:.3f} s + optimizer {plan.optimizer_time:.3f} s + exposed parameter "
        f"all-gather {plan.param_gather_exposed:.3f} s; {plan.microbatches} microbatches of "
        f"{plan.candidate.micro_batch} per DP rank"
    )


def plan_lines(plan: PlanResult) -> list[str]:
    """A plan's prediction: throughput, memory by part, where the step goes."""
    capacity = plan.problem.profile.memory_bytes / 2**30
    fits = "fits" if plan.fits else "DOES NOT FIT"
    return [
        f"  {plan.step_time:.3f} s/step, {plan.tokens_per_s_per_gpu:.0f} tokens/s per GPU, "
        f"{plan.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {plan.mfu:.1%}, bubble {plan.bubble:.3f}",
        f"  memory per GPU: {plan.memory_gib:.1f} GiB of {capacity:.1f} ({fits}) = {memory_parts(plan)}",
        f"  {step_parts(plan)}",
        *(f"  note: {note}" for note in plan.notes),
    ]


def prediction(result: Prediction, title: str, notes: list[str]) -> str:
    """``plan --from-args``: the run, then the best alternative and the flags that get it."""
    run = result.run
    lines = [title, f"the run: {run.candidate.label()}", *plan_lines(run)]
    lines += [f"  note: {note}" for note in notes]
    alternative = result.alternative
    if alternative is None:
        if result.search.plans:
            lines.append("best alternative: none faster found (the search's best is this run or slower)")
        else:
            lines.append("best alternative: the search found no plan that fits")
    else:
        gain = f"{result.speedup:.2f}x the run's throughput" if run.fits else "the run does not fit"
        lines += [
            f"best alternative: {alternative.candidate.label()} ({gain})",
            *plan_lines(alternative),
            "  flags: " + " ".join(parallel_flags(alternative)),
        ]
    lines.append(rejections(result.search))
    return "\n".join(lines)
