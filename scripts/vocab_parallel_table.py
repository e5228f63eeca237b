#!/usr/bin/env python3
"""Print the two tables of docs/vocab_parallel.md's "Figures": vocabulary parallelism (the S and
T passes of Yeung et al., MLSys'25) against none, for Llama-3 8B and Gemma-2 9B, first under 1F1B,
then under V-Half (the paper's memory-balanced pairing) and ZB-H1.

    python scripts/vocab_parallel_table.py
    python scripts/vocab_parallel_table.py --pp 4 --microbatches-per-rank 2 --schedules v-half v-min

Simulator, FLOP model, as ``megatron-pp-ext simulate --model llama3-8b --seq-length 4096
--schedule S --pp P --microbatches M --pp-vocab-parallel vocab-1|vocab-2 --json`` computes it with
its defaults: sequence 4096, micro-batch 1, bf16, TP=1, DP=1, no distributed optimizer, 400 TFLOP/s
at 50% (200 TFLOP/s delivered), p2p 50 GB/s, m = 4p, layers split as the runtime splits them
(``stage_layers``). Gemma-2 9B is no preset and no config (its head dimension, 256, is not
hidden/heads, which a ``configs/*.yaml`` cannot express), so its shape is handed to the function
``simulate`` runs. Peak is activations plus weights, fp32 gradients and Adam state; act is
activations only; max/min is over ranks.
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.commands import simulate as simulate_command
from megatron_pp_ext.schedule.models import ModelShape, get_model
from megatron_pp_ext.schedule.replay import SimResult

SEQ_LENGTH = 4096
GIB = 2**30
MODELS: dict[str, ModelShape] = {
    "llama3-8b": get_model("llama3-8b"),
    # Gemma-2 9B: 42 layers, h 3584, 16 heads of 256, 8 KV heads, GeGLU 14336, V 256000.
    "gemma2-9b": ModelShape("gemma2-9b", 42, 3584, 16, 8, 256, 14336, 256000),
}
VARIANTS = ("none", "vocab-1", "vocab-2")
HEADER = (
    "| model | schedule | p | m | vocab | makespan (s) | bubble | busy max/min | peak GiB (max) "
    "| peak max/min | act GiB (max) | act max/min |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def max_over_min(values: list[float]) -> float:
    return max(values) / min(values)


def simulated(
    model: str, schedule_name: str, pp: int, microbatches: int, variant: str
) -> tuple[SimResult, list[float]]:
    """``simulate --model MODEL --schedule S --pp P --microbatches M --pp-vocab-parallel V``
    (its defaults, its vocabulary passes and message order: the run's FLOP costs), with Gemma-2
    9B's shape given directly, and each rank's total memory in bytes."""
    parser = argparse.ArgumentParser()
    simulate_command.add_parser(parser.add_subparsers())
    flags = ["--schedule", schedule_name, "--pp", str(pp), "--microbatches", str(microbatches)]
    args = parser.parse_args(["simulate", *flags, "--pp-vocab-parallel", variant])
    args.model, args.model_shape, args.seq_length = model, MODELS[model], SEQ_LENGTH
    result = simulate_command.simulate_one(args, schedule_name)
    memory = simulate_command.rank_memory(args, result) or []
    return result, [parts.total for parts in memory]


def row(model: str, schedule_name: str, pp: int, microbatches: int, variant: str) -> str:
    """One line of the document's tables."""
    result, totals = simulated(model, schedule_name, pp, microbatches, variant)
    activations = result.peak_memory_per_rank
    return (
        f"| {model} | {schedule_name} | {pp} | {microbatches} | {variant} | {result.makespan:.3f} "
        f"| {result.bubble_rate:.3f} | {result.busy_max_over_min:.3f} | {max(totals) / GIB:.1f} "
        f"| {max_over_min(totals):.3f} | {max(activations) / GIB:.1f} | {max_over_min(activations):.2f} |"
    )


def table(schedules: list[str], models: list[str], pps: list[int], per_rank: int) -> list[str]:
    """Every (model, schedule, p, variant) row, models outermost, then schedules, p, variants."""
    lines = [HEADER]
    for model in models:
        for schedule_name in schedules:
            for pp in pps:
                for variant in VARIANTS:
                    lines.append(row(model, schedule_name, pp, per_rank * pp, variant))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--pp", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--microbatches-per-rank", type=int, default=4, help="m = this x p")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=None,
        help="one table of these schedules (default: the document's two, 1f1b, then v-half and zb-h1)",
    )
    args = parser.parse_args(argv)
    groups = [args.schedules] if args.schedules else [["1f1b"], ["v-half", "zb-h1"]]
    tables = ["\n".join(table(group, args.models, args.pp, args.microbatches_per_rank)) for group in groups]
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
