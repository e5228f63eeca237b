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
        **(
            {"EP": str(c.layout.ep), "ETP": str(c.layout.expert_tp), "ovl": "yes" if c.pairs else "no"}
            if plan.problem.shape.experts
            else {}
        ),
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
    lines.extend(expert_lines(best))
    lines.extend(fp8_lines(best))
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
        *expert_lines(plan),
        *fp8_lines(plan),
    ]


def fp8_lines(plan: PlanResult) -> list[str]:
    problem = plan.problem
    if not problem.fp8:
        return []
    return [
        f"  FP8 ({problem.fp8}): linear and expert GEMMs at {problem.profile.fp8_peak_flops / 1e12:.0f} "
        f"TFLOP/s x {problem.profile.fp8_gemm_efficiency:.2f} with their casts; MFU against the BF16 peak, "
        "as published FP8 runs report it"
    ]


GROUPED_GEMM_DATA_TOKENS = 2048  # the smallest per-expert batch the cited grouped-GEMM data covers


def expert_lines(plan: PlanResult) -> list[str]:
    """A mixture-of-experts plan's lines: what it activates, its expert layout and all-to-all,
    and the assumptions the prediction rests on (docs/planner.md, "Mixture of experts")."""
    summary, problem = plan.experts, plan.problem
    if summary is None:
        return []
    shape, c = problem.shape, plan.candidate
    layout = c.layout
    overlap = f"EP overlap on ({plan.pairs} overlapped F&B pairs simulated)" if c.pairs else "EP overlap off"
    profile = problem.profile
    if profile.grouped_gemm_efficiency:
        grouped = f"its grouped GEMMs at {profile.grouped_gemm_efficiency:.0%} of the peak (the profile's)"
    else:
        grouped = (
            f"its grouped GEMMs at the dense GEMMs' {profile.gemm_efficiency:.0%} of the peak: the profile "
            "has no grouped-GEMM measurement (optimistic)"
        )
    lines = [
        f"  experts: {shape.experts} routed, top-{shape.topk}, {summary.moe_layers} MoE layers; "
        f"{shape.activated_params() / 1e9:.1f}B of {shape.total_params() / 1e9:.1f}B parameters activated "
        f"per token (MFU counts these); EP {layout.ep} x ETP {layout.expert_tp}, expert DP "
        f"{layout.parallel.expert_dp}; {problem.dispatcher} dispatcher; {overlap}",
        f"  expert all-to-all: {summary.nvlink_bytes / 2**20:.1f} MiB over NVLink + "
        f"{summary.ib_bytes / 2**20:.1f} MiB over InfiniBand per rank, {summary.one_alltoall * 1e3:.2f} ms, "
        f"4 per MoE layer and microbatch; {summary.alltoall_seconds:.2f} s per step on the busiest rank; "
        f"overlapped pairs hide up to {summary.hidden_seconds:.2f} s a step on a rank",
        f"  memory: routed experts' weights, gradients and optimizer state "
        f"{plan.memory.experts / 2**30:.1f} GiB of the static parts",
        f"  assumed: routing {'balanced' if problem.moe_imbalance == 1 else 'imbalanced'} "
        f"(busiest expert rank x{problem.moe_imbalance:g} of its share; --pp-moe-imbalance), as published "
        f"MoE benchmarks force it; {summary.tokens_per_expert:.0f} tokens per local expert, {grouped}",
    ]
    if summary.tokens_per_expert < GROUPED_GEMM_DATA_TOKENS:
        lines.append(
            f"  caution: {summary.tokens_per_expert:.0f} tokens per local expert is below what the "
            "grouped-GEMM data covers (docs/planner.md); such small GEMMs run below the roofline, so "
            "the expert GEMMs are optimistic"
        )
    return lines


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
