"""``megatron-pp-ext bench``: time our schedules against torch.distributed.pipelining's or
megatron-core's own.

p processes (gloo on CPU with one thread each, NCCL on GPUs), one tiny megatron-core GPT with the
same weights and data for every run; per schedule the median step time (forward and backward
over m microbatches), the ratio ours/baseline per paired round where the baseline has the same
schedule (``--against megatron``: Megatron's 1F1B and interleaved 1F1B, and every other schedule
of ours against the faster of those two), and the peak activation bytes per rank. A benchmark,
not a test: it prints numbers; it asserts nothing but that ours and the baseline agree on the
first iteration's loss and gradient norm (printed as a check line).

Expert parallelism (``--model-size moe-tiny --expert-model-parallel-size E``, against Megatron):
p x E processes, E data-parallel pipelines timed together. ``--overlap-moe-expert-parallel-comm``
without ``--emulate``: every schedule of ours also runs paired (our overlapped F&B pairs), beside
itself unpaired, and Megatron's interleaved 1F1B row also runs its combined 1F1B (bench/job.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from ..bench.emulate import add_emulate_arguments
from ..bench.job import (
    DEFAULT_SLICES,
    MEGATRON_DEFAULT,
    MODEL_SIZES,
    BenchSettings,
    known_names,
    ordered_names,
    plan_row,
)
from .errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="time our pipeline schedules against torch.distributed.pipelining's or Megatron's own",
        description="Time one training step of each schedule (ours and the baseline's) on p processes.",
    )
    parser.add_argument(
        "--against",
        choices=("torch", "megatron"),
        default="torch",
        help="the baseline: torch.distributed.pipelining's schedules (default) or megatron-core's own "
        "1F1B and interleaved 1F1B (every other schedule against the faster of the two)",
    )
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes), default 2")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step, default 8")
    parser.add_argument(
        "--iterations",
        type=int,
        default=20,
        help="timed steps per schedule, taken in turns with the baseline (paired rounds), default 20",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, default 3")
    parser.add_argument(
        "--schedules",
        help="comma list of schedule names, or 'all' (the default; against Megatron: "
        f"{','.join(MEGATRON_DEFAULT)})",
    )
    parser.add_argument(
        "--pp-seq-slices",
        type=int,
        default=DEFAULT_SLICES,
        help=f"sequence slices per microbatch for Seq1F1B and SlimPipe, default {DEFAULT_SLICES}",
    )
    parser.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default="tiny",
        help="default tiny; moe-tiny: tiny with 4 experts per layer, top-2, the alltoall dispatcher",
    )
    parser.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Megatron's flag: ranks each stage's experts are split over (with --model-size moe-tiny "
        "and --against megatron): --pp x this many processes, as many data-parallel pipelines",
    )
    parser.add_argument("--seed", type=int, default=1234, help="weights and data seed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck transfer fails")
    parser.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        help="Megatron's flag: gloo with GPUs lets the ranks share them (compute on CUDA, every "
        "message, ours and Megatron's, staged through host memory): one GPU runs --pp 2-4",
    )
    parser.add_argument(
        "--pp-offload",
        default="none",
        help="comma list of our activation-offload policies (none, full, selective, auto): each "
        "schedule runs with each, and without offload, the reference for the overhead",
    )
    parser.add_argument(
        "--fine-grained-activation-offloading",
        action="store_true",
        help="Megatron's flag: against Megatron, the rows with --pp-offload run Megatron's schedule "
        "with its fine-grained activation offloading of --offload-modules (CUDA and Transformer Engine)",
    )
    parser.add_argument(
        "--offload-modules",
        nargs="+",
        default=[],
        help="Megatron's flag: the modules whose inputs Megatron offloads (core_attn, attn_proj, "
        "qkv_linear, attn_norm, mlp_norm, ...)",
    )
    parser.add_argument(
        "--min-offloaded-tensor-size",
        type=int,
        default=1024,
        help="Megatron's flag: its smallest offloaded tensor in bytes (default here 1024, the size "
        "below which our runtime keeps tensors too; Megatron's own default is 1048576)",
    )
    parser.add_argument(
        "--pp-emulate-nccl",
        action="store_true",
        help="run our schedules under NCCL's rules imposed on gloo (as train's flag; slower)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also show megatron-core's start-up warnings (quiet.py)"
    )
    add_emulate_arguments(parser)
    parser.add_argument(
        "--count-calls",
        action="store_true",
        help="also count the Python calls of one more step of each job on rank 0 (cProfile)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--save", help="also write the JSON results to this file")
    parser.set_defaults(run=run)


MIN_ROUNDS = 10  # paired rounds against Megatron: enough for a min / median / max worth reading


def selected(text: str | None, against: str = "torch") -> list[str]:
    names = known_names()
    if text is None and against == "megatron":
        return list(MEGATRON_DEFAULT)
    if text is None or text.strip() == "all":
        return names
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in names]
    if not chosen or unknown:
        raise UsageError(
            "--schedules", f"unknown schedule(s) {unknown or text!r}; choose from: {', '.join(names)}"
        )
    return list(dict.fromkeys(chosen))


def check(args: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--pp", args.pp, 2),
        ("--microbatches", args.microbatches, 1),
        ("--iterations", args.iterations, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < least:
            raise UsageError(flag, f"must be at least {least}, got {value}")
    if args.timeout <= 0:
        raise UsageError("--timeout", f"must be positive, got {args.timeout}")
    if args.pp_seq_slices < 1:
        raise UsageError("--pp-seq-slices", f"must be at least 1, got {args.pp_seq_slices}")
    if args.against == "megatron" and args.iterations < MIN_ROUNDS:
        raise UsageError(
            "--iterations",
            f"--iterations: {args.iterations} is too few paired rounds for --against megatron: "
            f"use {MIN_ROUNDS} or more",
        )
    if emulating(args) and args.against != "torch":
        raise UsageError(
            "--emulate", "emulated compute runs no model to compare with Megatron: drop --against"
        )
    if args.distributed_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--distributed-backend", "nccl needs GPUs and this machine has none: drop it")
    modes = offload_modes(args.pp_offload)
    if emulating(args) and (modes != ["none"] or args.distributed_backend):
        flag = "--pp-offload" if modes != ["none"] else "--distributed-backend"
        raise UsageError(flag, "emulated compute copies nothing and runs on no device: drop it")
    check_fine_grained(args, modes)
    check_experts(args, modes)


def offload_modes(text: str) -> list[str]:
    """``--pp-offload none,full`` -> ["none", "full"]: none first always (the reference)."""
    from ..schedule.offload import POLICIES

    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [mode for mode in chosen if mode not in POLICIES]
    if not chosen or unknown:
        raise UsageError(
            "--pp-offload", f"unknown policy {unknown or text!r}; choose from {', '.join(POLICIES)}"
        )
    return ["none", *dict.fromkeys(mode for mode in chosen if mode != "none")]


def check_fine_grained(args: argparse.Namespace, modes: list[str]) -> None:
    """Megatron's fine-grained activation offloading: its flags together, beside our offload rows,
    and only where it runs (CUDA copy streams, Transformer Engine's cpu_offload module)."""
    import importlib.util

    if args.offload_modules and not args.fine_grained_activation_offloading:
        raise UsageError(
            "--offload-modules", "needs --fine-grained-activation-offloading (as in Megatron-LM)"
        )
    if not args.fine_grained_activation_offloading:
        return
    flag = "--fine-grained-activation-offloading"
    if args.against != "megatron":
        raise UsageError(flag, "runs Megatron's schedules: add --against megatron")
    if not args.offload_modules:
        raise UsageError(flag, "needs --offload-modules (for instance core_attn attn_proj)")
    if modes == ["none"]:
        raise UsageError(flag, "pairs with our offload rows: add --pp-offload full (or selective, auto)")
    if args.min_offloaded_tensor_size < 0:
        raise UsageError(
            "--min-offloaded-tensor-size", f"must be at least 0, got {args.min_offloaded_tensor_size}"
        )
    import torch

    missing = [
        need
        for need, present in (
            ("a CUDA device (its copy streams)", torch.cuda.is_available()),
            (
                "Transformer Engine (its cpu_offload)",
                importlib.util.find_spec("transformer_engine") is not None,
            ),
        )
        if not present
    ]
    if missing:
        raise UsageError(
            flag,
            f"megatron-core's fine-grained activation offloading needs {' and '.join(missing)}: "
            "run it on a GPU machine with Transformer Engine, or drop the flag",
        )


def check_experts(args: argparse.Namespace, modes: list[str]) -> None:
    """Expert parallelism and overlapped pairs on the bench's real model, each refused in one
    line naming the flag (``--emulate`` checks its own pairs)."""
    from ..bench.job import experts_of

    pairs_flag, ep_flag = "--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size"
    ep, experts = args.expert_model_parallel_size, experts_of(args.model_size)
    if ep < 1:
        raise UsageError(ep_flag, f"must be at least 1, got {ep}")
    if emulating(args):
        if ep > 1:
            raise UsageError(ep_flag, "emulated compute runs no model: drop it")
        return
    pairs = args.overlap_moe_expert_parallel_comm
    if experts is None:
        if ep > 1 or pairs:
            raise UsageError(
                ep_flag if ep > 1 else pairs_flag,
                f"the {args.model_size} model has no experts: use --model-size moe-tiny"
                + ("" if ep > 1 else " --expert-model-parallel-size 2 (or --emulate F,B,W)"),
            )
        return
    if args.against != "megatron":
        raise UsageError(
            "--model-size", f"{args.model_size} runs against Megatron only: add --against megatron"
        )
    if experts % ep:
        raise UsageError(ep_flag, f"{ep} must divide the {experts} experts of {args.model_size}")
    if pairs and ep < 2:
        raise UsageError(pairs_flag, f"needs {ep_flag} 2 or more: with EP 1 there is no all-to-all to hide")
    if pairs and modes != ["none"]:
        raise UsageError(pairs_flag, "our pairs do not run with activation offload: drop --pp-offload")


def emulating(args: argparse.Namespace) -> bool:
    """Any of the emulation's flags (run_emulate refuses those given without --emulate).
    ``--overlap-moe-expert-parallel-comm`` alone pairs the real model's schedules (check_experts)."""
    return args.emulate is not None or args.emulate_skew is not None or args.pp_expert_comm is not None


def run(args: argparse.Namespace) -> int:
    from .. import launch
    from ..bench import report
    from ..bench.worker import worker
    from ..launcher_env import launcher_world

    check(args)
    if emulating(args):
        return run_emulated(args)
    names = ordered_names(selected(args.schedules, args.against), args.against)
    overlap = args.overlap_moe_expert_parallel_comm
    rows = [
        plan_row(
            name, args.pp, args.microbatches, args.model_size, args.against, args.pp_seq_slices, mode, overlap
        )
        for name in names
        for mode in offload_modes(args.pp_offload)
    ]
    if args.fine_grained_activation_offloading:
        # Megatron-LM asks for it with TE >= 2.10, "to avoid offloading weights"
        os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")
    world = launcher_world()
    processes = args.pp * args.expert_model_parallel_size
    if world is not None and world[1] != processes:
        raise UsageError("--pp", f"the launcher started {world[1]} processes for {processes} (--pp x EP)")
    settings = BenchSettings(
        pp=args.pp,
        microbatches=args.microbatches,
        iterations=args.iterations,
        warmup=args.warmup,
        model_size=args.model_size,
        rows=rows,
        output="",  # run_for_results gives it a file
        seed=args.seed,
        timeout=args.timeout,
        quiet=args.json,
        emulate_nccl=args.pp_emulate_nccl,
        against=args.against,
        count_calls=args.count_calls,
        distributed_backend=args.distributed_backend,
        offload_modules=tuple(args.offload_modules) if args.fine_grained_activation_offloading else (),
        min_offloaded_tensor_size=args.min_offloaded_tensor_size,
        ep=args.expert_model_parallel_size,
        overlap=overlap,
    )
    settings_for = lambda path: dataclasses.replace(settings, output=path)
    try:  # more ranks than GPUs under NCCL: refused before any starts (check_gpus)
        text = launch.run_for_results(worker, processes, settings_for, args.distributed_backend)
    except launch.LaunchError as error:
        raise UsageError("--pp", str(error)) from None
    if not text:  # another rank's process under torchrun/srun: rank 0 reports
        return 0
    results = json.loads(text)
    save(args, results)
    if args.json:
        print(json.dumps(results))
    else:
        print(report.header(results))
        print(report.format_table(report.table_rows(results)))
        offloaded = report.offload_rows(results)
        if offloaded:
            print("\nactivation offload against the same schedule without it (same run):")
            print(report.format_table(offloaded))
    return 0


def run_emulated(args: argparse.Namespace) -> int:
    """``--emulate F,B,W``: the lowered schedules with emulated compute and real messages,
    beside the simulator's prediction for the same costs (bench/emulate.py)."""
    from ..bench.emulate import format_emulate_table, run_emulate
    from ..schedule.generators import RequestError

    # default: Megatron's two schedules and what a user could switch to
    names = selected(args.schedules, "megatron")
    try:
        results = run_emulate(args, names)
    except RequestError as error:
        raise UsageError(error.flag, str(error)) from None
    if not results:  # another rank's process under torchrun/srun
        return 0
    save(args, results)
    print(json.dumps(results) if args.json else format_emulate_table(results))
    return 0


def save(args: argparse.Namespace, results: dict) -> None:
    if args.save:
        with open(args.save, "w") as handle_out:
            json.dump(results, handle_out, indent=1)
