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
from ..planner.emit import megatron_flags, sbatch
from ..planner.model import SHAPE_FLAGS, ModelError, resolve
from ..planner.report import summary
from ..planner.search import SearchResult, search
from ..planner.step import Problem
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
    parser.add_argument("--gpu", default="h100-80gb", choices=list(devices.PROFILES), help="GPU model")
    parser.add_argument("--profile", help="a device profile JSON (from --calibrate) instead of --gpu")
    parser.add_argument(
        "--global-batch-size", type=int, help="sequences per step (default: 4M tokens' worth, at least 1)"
    )
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain)")
    parser.add_argument("--top", type=int, default=10, help="plans to show")
    parser.add_argument("--schedules", help="comma-separated schedules to consider (default: all)")
    parser.add_argument("--max-simulations", type=int, default=300, help="simulations the search may run")
    parser.add_argument("--json", action="store_true", help="print the plans as a JSON list, best first")
    parser.add_argument(
        "--emit", choices=("flags", "sbatch"), help="print the top plan as Megatron flags or sbatch"
    )
    parser.add_argument("--output", help="with --emit sbatch or --calibrate: the file to write")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's GPU into --output")
    shape = parser.add_argument_group("Megatron's shape flags (override the model's)")
    for flag in SHAPE_FLAGS:
        shape.add_argument(flag, type=int, default=None)
    shape.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP (three matrices)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate(args)
    problem, spec = problem_from_args(args)
    progress = Progress()
    result = search(
        problem,
        top=args.top,
        schedules=schedules_from_args(args),
        max_simulations=args.max_simulations,
        progress=progress,
    )
    progress.done()
    if not result.plans:
        raise UsageError("--gpus", no_plan_message(problem, spec.name, result), flag_in_message=True)
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
        print(summary(result, title))
    return 0


def problem_from_args(args: argparse.Namespace) -> tuple[Problem, Any]:
    """The search problem the flags describe; one line naming the flag when they cannot."""
    if not args.model:
        raise UsageError(
            "--model", "which model? give a config name (e.g. llama2-70b), a YAML file or a preset"
        )
    flags = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in SHAPE_FLAGS}
    flags["--swiglu"] = args.swiglu
    try:
        spec = resolve(args.model, flags)
    except ModelError as error:
        raise UsageError(error.flag, str(error)) from None
    seq = args.seq_length if args.seq_length is not None else spec.section.get("seq_length") or 4096
    for flag, value in (
        ("--seq-length", seq),
        ("--gpus", args.gpus),
        ("--micro-batch-size", args.micro_batch_size),
        ("--gpus-per-node", args.gpus_per_node),
        ("--top", args.top),
    ):
        if value is None:
            raise UsageError(flag, "is required")
        if value < 1:
            raise UsageError(flag, f"must be at least 1, got {value}")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise UsageError("--global-batch-size", f"must be at least 1, got {args.global_batch_size}")
    batch = args.global_batch_size or max(1, DEFAULT_TOKENS_PER_STEP // seq)
    if batch % args.micro_batch_size:
        raise UsageError(
            "--global-batch-size", f"{batch} is not a multiple of --micro-batch-size {args.micro_batch_size}"
        )
    return (
        Problem(
            shape=spec.shape,
            seq_length=seq,
            gpus=args.gpus,
            profile=profile_from_args(args),
            global_batch=batch,
            micro_batch=args.micro_batch_size,
            gpus_per_node=min(args.gpus_per_node, args.gpus),
        ),
        spec,
    )


def profile_from_args(args: argparse.Namespace) -> devices.DeviceProfile:
    if not args.profile:
        return devices.get_profile(args.gpu)
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


def no_plan_message(problem: Problem, name: str, result: SearchResult) -> str:
    """One line: no layout works, and the commonest reasons why."""
    reasons = "; ".join(
        f"{reason} x{count} (e.g. {result.examples[reason]})"
        for reason, count in result.rejected.most_common(2)
    )
    return (
        f"no plan for {name} at {problem.seq_length} tokens on --gpus {problem.gpus} x "
        f"{problem.profile.name}: {reasons or 'no layout to try'}"
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
        profile = measure(devices.get_profile(args.gpu))
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
