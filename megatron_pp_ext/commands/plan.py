"""``megatron-pp-ext plan``: the best layout and schedule for a model, a sequence length and a
cluster, before anyone books GPUs.

Pure Python (``--calibrate`` aside, which imports torch to measure a GPU). The search and the
cost model live in ``megatron_pp_ext/planner/``; this module reads the flags, prints the answer
and turns the top plan into Megatron flags or a SLURM script.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

from ..planner import devices
from ..planner.costs import DISPATCHERS
from ..planner.emit import megatron_flags, parallel_flags, sbatch
from ..planner.megatron_args import ArgsError, read_args, read_sbatch
from ..planner.model import MOE_FLAGS, MOE_FREQ_FLAG, SHAPE_FLAGS, ModelError, resolve
from ..planner.pins import PinError, Pins
from ..planner.predict import predict_and_compare
from ..planner.report import prediction, summary
from ..planner.search import SearchResult, search
from ..planner.step import Problem
from ..schedule.completion import FREE, add_completion_argument
from ..schedule.generators import SCHEDULES
from .errors import UsageError

DEFAULT_TOKENS_PER_STEP = 1 << 22  # 4M tokens: the global batch when none is given


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="the best TP/CP/PP/DP layout and schedule for a model on a cluster (no torch needed)",
        description="Search parallel layouts and pipeline schedules, simulate each, rank them.",
    )
    parser.add_argument("--model", help="a config name (configs/), a config's YAML file, or a preset")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence (default: the config's)")
    parser.add_argument("--gpus", type=int, help="GPUs in the job")
    parser.add_argument(
        "--gpu",
        choices=list(devices.PROFILES),
        help="GPU model (default h100-80gb, or an sbatch file's cluster)",
    )
    parser.add_argument("--profile", help="a device profile JSON (from --calibrate) instead of --gpu")
    parser.add_argument(
        "--global-batch-size", type=int, help="sequences per step (default: 4M tokens' worth, at least 1)"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, help="sequences per microbatch, pinned (default: searched)"
    )
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node, the NVLink domain (default 8)")
    parser.add_argument("--top", type=int, default=10, help="plans to show")
    parser.add_argument("--schedules", help="comma-separated schedules to consider (default: all)")
    parser.add_argument("--max-simulations", type=int, default=300, help="simulations the search may run")
    add_completion_argument(parser, gloo=False)
    parser.add_argument("--json", action="store_true", help="print the plans as a JSON list, best first")
    parser.add_argument(
        "--emit", choices=("flags", "sbatch"), help="print the top plan as Megatron flags or sbatch"
    )
    parser.add_argument("--output", help="with --emit sbatch or --calibrate: the file to write")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's GPU into --output")
    given = parser.add_argument_group("a given run: predict it and show the best alternative")
    given.add_argument(
        "--from-args", metavar="COMMAND", help="a pretrain_gpt.py command line (torchrun's too)"
    )
    given.add_argument("--from-sbatch", metavar="FILE", help="one of scripts/slurm's sbatch files")
    pins = parser.add_argument_group("pins: Megatron's layout flags fix that part; the rest is searched")
    for flag in (
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
        "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank", "--pp-chunks",
        "--recompute-num-layers", "--pp-seq-slices",
    ):  # fmt: skip
        pins.add_argument(flag, type=int)
    pins.add_argument("--sequence-parallel", action="store_true", default=None)
    pins.add_argument("--use-distributed-optimizer", action="store_true", default=None)
    pins.add_argument("--tp-comm-overlap", action="store_true", help="Transformer Engine's TP overlap")
    pins.add_argument("--recompute-granularity", choices=("full", "selective"))
    pins.add_argument("--recompute-method", choices=("uniform", "block"))
    pins.add_argument("--pp-schedule", choices=list(SCHEDULES))
    pins.add_argument("--pp-offload", choices=("none", "auto", "full", "selective"))
    pins.add_argument("--pp-vocab-parallel", choices=("none", "vocab-1", "vocab-2"))
    pins.add_argument("--expert-model-parallel-size", type=int, help="EP (a mixture-of-experts model's)")
    pins.add_argument(
        "--expert-tensor-parallel-size", type=int, help="expert TP (default: searched, TP or 1)"
    )
    pins.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        default=None,
        help="overlapped F&B pairs hiding the expert all-to-all (default: searched, with and without)",
    )
    shape = parser.add_argument_group("Megatron's shape flags (override the model's)")
    for flag in (*SHAPE_FLAGS, *MOE_FLAGS):
        shape.add_argument(flag, type=int, default=None)
    shape.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP (three matrices)")
    shape.add_argument(MOE_FREQ_FLAG, help="MoE layers: every N-th, or a pattern such as ([0]*3+[1]*58)")
    moe = parser.add_argument_group("mixture of experts: how the run computes and routes")
    moe.add_argument(
        "--moe-token-dispatcher-type",
        choices=DISPATCHERS,
        help="alltoall (default) or flex (DeepEP / HybridEP: one cross-node copy per destination node)",
    )
    moe.add_argument(
        "--fp8-format",
        choices=("e4m3", "hybrid"),
        help="the linear layers in FP8 at the GPU's FP8 throughput (attention and router in BF16)",
    )
    moe.add_argument(
        "--pp-moe-imbalance",
        type=float,
        default=1.0,
        help="the busiest expert rank's routed tokens over the balanced share (default 1: balanced, "
        "as published MoE benchmarks force it); scales its expert GEMMs, all-to-all and routed activations",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate(args)
    if args.from_args is not None or args.from_sbatch is not None:
        return predict_run(args)
    problem, spec = problem_from_args(args)
    if args.emit == "sbatch" and spec.shape.experts:
        raise UsageError(
            "--emit",
            f"{spec.name} is a mixture-of-experts model: launch.sh writes no expert flags yet; use --emit "
            "flags (every Megatron flag of the plan, the experts' too)",
        )
    pins = pins_from_args(args, problem)
    progress = Progress()
    result = search(
        problem,
        top=args.top,
        schedules=schedules_from_args(args),
        max_simulations=args.max_simulations,
        progress=progress,
        pins=pins,
    )
    progress.done()
    if not result.plans:
        flag = pins.pinned[0] if pins.pinned else "--gpus"
        raise UsageError(flag, no_plan_message(problem, spec.name, result, pins), flag_in_message=True)
    if args.emit == "flags":
        print(shlex.join(megatron_flags(spec, result.plans[0])))
    elif args.emit == "sbatch":
        emit_sbatch(args, spec, result)
    elif args.json:
        print(json.dumps([plan.to_dict() for plan in result.plans]))
    else:
        title = (
            f"{spec.name} at {problem.seq_length} tokens on {problem.gpus} x {problem.profile.name} "
            f"({problem.gpus_per_node} per node), global batch {problem.global_batch}"
        )
        if pins.pinned:
            title += "; pinned: " + ", ".join(pins.pinned)
        print(summary(result, title + completion_note(problem)))
    return 0


def problem_from_args(args: argparse.Namespace) -> tuple[Problem, Any]:
    """The search problem the flags describe; one line naming the flag when they cannot."""
    if not args.model:
        raise UsageError(
            "--model", "which model? give a config name (e.g. llama2-70b), a YAML file or a preset"
        )
    flags = {
        flag: getattr(args, flag[2:].replace("-", "_")) for flag in (*SHAPE_FLAGS, *MOE_FLAGS, MOE_FREQ_FLAG)
    }
    flags["--swiglu"] = args.swiglu
    try:
        spec = resolve(args.model, flags)
    except ModelError as error:
        raise UsageError(error.flag, str(error)) from None
    seq = args.seq_length if args.seq_length is not None else spec.section.get("seq_length") or 4096
    for flag, value in (
        ("--seq-length", seq),
        ("--gpus", args.gpus),
        ("--gpus-per-node", gpus_per_node := args.gpus_per_node or 8),
        ("--top", args.top),
    ):
        if value is None:
            raise UsageError(flag, "is required")
        if value < 1:
            raise UsageError(flag, f"must be at least 1, got {value}")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise UsageError("--global-batch-size", f"must be at least 1, got {args.global_batch_size}")
    batch = args.global_batch_size or max(1, DEFAULT_TOKENS_PER_STEP // seq)
    profile = profile_from_args(args)
    return (
        Problem(
            shape=spec.shape,
            seq_length=seq,
            gpus=args.gpus,
            profile=profile,
            global_batch=batch,
            gpus_per_node=min(gpus_per_node, args.gpus),
            completion=args.comm_completion,
            **moe_options(args, spec.shape, profile),
        ),
        spec,
    )


def moe_options(
    args: argparse.Namespace,
    shape: Any,
    profile: devices.DeviceProfile,
    dispatcher: str | None = None,
    fp8: str | None = None,
) -> dict[str, Any]:
    """Problem's dispatcher, FP8 and imbalance from the flags (a --from-args line's own dispatcher
    and FP8 format where given); a flag the model or GPU cannot honour is refused."""
    fp8 = args.fp8_format or fp8
    if fp8 and profile.fp8_peak_flops <= 0:
        raise UsageError("--fp8-format", f"{profile.name} has no FP8 tensor cores (fp8_peak_flops 0)")
    moe_given = [
        flag
        for flag, value in (
            ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type),
            ("--pp-moe-imbalance", args.pp_moe_imbalance != 1.0 or None),
            ("--expert-model-parallel-size", args.expert_model_parallel_size),
            ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size),
            ("--overlap-moe-expert-parallel-comm", args.overlap_moe_expert_parallel_comm),
        )
        if value is not None
    ]
    if moe_given and not shape.experts:
        raise UsageError(
            moe_given[0], f"{moe_given[0]} needs a mixture-of-experts model ({shape.name} is dense)"
        )
    if not args.pp_moe_imbalance >= 1.0:
        raise UsageError(
            "--pp-moe-imbalance", f"must be at least 1 (balanced routing), got {args.pp_moe_imbalance}"
        )
    return {
        "dispatcher": args.moe_token_dispatcher_type or dispatcher or "alltoall",
        "moe_imbalance": args.pp_moe_imbalance,
        "fp8": fp8,
    }


def completion_note(problem: Problem) -> str:
    """The title's note when messages are replayed under NCCL's in-order completion."""
    return "" if problem.completion == FREE else f"; messages complete {problem.completion}"


def predict_run(args: argparse.Namespace) -> int:
    """``--from-args`` / ``--from-sbatch``: predict that run, then show the best alternative.
    Exit 2 when the run cannot run (one line) or does not fit (the full report)."""
    if args.from_args is not None and args.from_sbatch is not None:
        raise UsageError("--from-sbatch", "give --from-args or --from-sbatch, not both")
    source = "--from-args" if args.from_args is not None else "--from-sbatch"
    if args.model:
        raise UsageError("--model", f"the model comes from {source}'s command line: leave --model out")
    try:
        run = read_args(args.from_args) if args.from_args is not None else read_sbatch(args.from_sbatch)
    except ArgsError as error:
        raise UsageError(error.flag, str(error)) from None
    gpus = args.gpus or run.gpus
    if gpus is None:
        raise UsageError(
            "--gpus",
            f"{source}'s line does not say how many GPUs (no torchrun --nproc-per-node/--nnodes): "
            "add --gpus N",
        )
    pins = run.pins
    model_parallel = (pins.tp or 1) * (pins.cp or 1) * (pins.pp or 1)
    if gpus % model_parallel:
        raise UsageError(
            "--tensor-model-parallel-size",
            f"TP {pins.tp} x CP {pins.cp} x PP {pins.pp} = {model_parallel} does not divide the {gpus} GPUs "
            f"({'--gpus' if args.gpus else 'from the launcher'})",
        )
    profile = profile_from_args(args, run.cluster)
    problem = run.problem(
        profile,
        gpus,
        args.gpus_per_node,
        completion=args.comm_completion,
        **moe_options(args, run.shape, profile, run.dispatcher, run.fp8),
    )
    batch, per_node = problem.global_batch, problem.gpus_per_node
    try:
        result = predict_and_compare(problem, pins, args.max_simulations, args.top)
    except PinError as error:
        raise UsageError(error.flag, str(error)) from None
    if args.json:
        alternative = result.alternative
        print(
            json.dumps(
                {
                    "run": result.run.to_dict(),
                    "alternative": alternative.to_dict() if alternative else None,
                    "alternative_flags": parallel_flags(alternative) if alternative else None,
                    "speedup": result.speedup,
                    "notes": run.notes,
                }
            )
        )
    else:
        title = (
            f"{run.shape.name} at {problem.seq_length} tokens on {gpus} x {problem.profile.name} "
            f"({per_node} per node), global batch {batch}"
        )
        print(prediction(result, title + completion_note(problem), run.notes))
    return 0 if result.run.fits else 2


def pins_from_args(args: argparse.Namespace, problem: Problem) -> Pins:
    """The layout flags given on the command line as pins (none given: a free search), the
    micro-batch size among them."""
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise UsageError("--recompute-method", "needs --recompute-granularity full")
    block = args.recompute_method == "block"
    if args.recompute_num_layers is not None and not block:
        raise UsageError(
            "--recompute-num-layers",
            "is pinned with --recompute-method block (uniform recomputes every layer)",
        )
    vpp_flag = "--pp-chunks" if args.pp_chunks is not None else "--num-virtual-stages-per-pipeline-rank"
    try:
        pins = Pins(
            tp=args.tensor_model_parallel_size,
            cp=args.context_parallel_size,
            pp=args.pipeline_model_parallel_size,
            vpp=args.num_virtual_stages_per_pipeline_rank or args.pp_chunks,
            layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
            sequence_parallel=args.sequence_parallel,
            distributed_optimizer=args.use_distributed_optimizer,
            recompute=args.recompute_granularity,
            recompute_layers=(args.recompute_num_layers or 1) if block else None,
            schedule=args.pp_schedule,
            slices=args.pp_seq_slices,
            offload=args.pp_offload,
            vocab=args.pp_vocab_parallel,
            micro_batch=args.micro_batch_size,
            tp_comm_overlap=args.tp_comm_overlap,
            ep=args.expert_model_parallel_size,
            etp=args.expert_tensor_parallel_size,
            pairs=args.overlap_moe_expert_parallel_comm,
            flags={"vpp": vpp_flag},
        )
        pins.check(problem.shape, problem.gpus, problem.gpus_per_node, problem.global_batch)
    except PinError as error:
        raise UsageError(error.flag, str(error)) from None
    return pins


def profile_from_args(args: argparse.Namespace, cluster: str | None = None) -> devices.DeviceProfile:
    if not args.profile:
        gpu = args.gpu or {"a100": "a100-80gb"}.get(cluster or "", "h100-80gb")
        return devices.get_profile(gpu)
    try:
        return devices.load_profile(args.profile)
    except OSError as error:
        raise UsageError("--profile", f"cannot read {args.profile}: {error.strerror}") from None
    except (TypeError, ValueError) as error:
        raise UsageError("--profile", f"{args.profile}: {error}") from None


def schedules_from_args(args: argparse.Namespace) -> list[str] | None:
    if not args.schedules:
        return None
    names = [name.strip() for name in args.schedules.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCHEDULES]
    if unknown or not names:
        raise UsageError(
            "--schedules", f"unknown schedule(s) {', '.join(unknown)}; choose from {', '.join(SCHEDULES)}"
        )
    return names


def no_plan_message(problem: Problem, name: str, result: SearchResult, pins: Pins | None = None) -> str:
    """One line: no layout works, and the commonest reasons why."""
    reasons = "; ".join(
        f"{reason} x{count} (e.g. {result.examples[reason]})"
        for reason, count in result.rejected.most_common(2)
    )
    pinned = f" with {', '.join(pins.pinned)} pinned" if pins and pins.pinned else ""
    return (
        f"no plan for {name} at {problem.seq_length} tokens on --gpus {problem.gpus} x "
        f"{problem.profile.name}{pinned}: {reasons or 'no layout to try'}"
    )


def emit_sbatch(args: argparse.Namespace, spec: Any, result: SearchResult) -> None:
    command = "megatron-pp-ext plan " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])
    try:
        text = sbatch(spec, result.plans[0], command)
    except ValueError as error:
        raise UsageError("--emit", str(error)) from None
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def calibrate(args: argparse.Namespace) -> int:
    from ..planner.calibrate import NoGPU
    from ..planner.calibrate import calibrate as measure

    try:
        profile = measure(devices.get_profile(args.gpu or "h100-80gb"))
    except NoGPU as error:
        raise UsageError("--calibrate", str(error)) from None
    output = args.output or "gpu-profile.json"
    devices.save_profile(profile, output)
    print(f"wrote {output}: use it with megatron-pp-ext plan --profile {output}", file=sys.stderr)
    return 0


class Progress:
    """A line on stderr while a big search runs (at most twice a second)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def __call__(self, result: SearchResult, queued: int, best: float | None) -> None:
        now = time.perf_counter()
        every = 0.5 if sys.stderr.isatty() else 5.0
        if now - self.last < every or now - self.start < 1.0:
            return
        self.last = now
        best_text = f", best {best:.3f} s/step" if best is not None else ""
        end = "\r" if sys.stderr.isatty() else "\n"
        print(
            f"plan: simulated {result.simulated}, {queued} queued of {result.considered}{best_text}",
            end=end,
            file=sys.stderr,
            flush=True,
        )
        self.shown = True

    def done(self) -> None:
        if self.shown and sys.stderr.isatty():
            print(file=sys.stderr)
