#!/usr/bin/env python3
"""How far selective offload lowers the activation peak (simulator, unit costs): Megatron's
interleaved 1F1B against PipeOffload's uniform interleaved schedule.

For each pipeline size and chunk count: each schedule's bubble and peak without offload, and its
peak with the first chunks offloaded as a share of interleaved 1F1B's peak without offload, on
rank 0 and over all ranks, with reloads issued just before the backward (lookahead 0) and one
compute op ahead (lookahead 1, the default).

    python scripts/selective_offload_table.py
    python scripts/selective_offload_table.py --pp 4 8 16 --microbatches-per-rank 4
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.offload import OffloadPolicy, apply_offload
from megatron_pp_ext.schedule.simulate import simulate

SCHEDULES = ("interleaved-1f1b", "uniform-interleaved")


def row(
    name: str, pp: int, microbatches: int, chunks: int, offloaded: tuple[int, ...], baseline: list[float]
) -> str:
    """``baseline``: interleaved 1F1B's peak per rank without offload, the table's yardstick."""
    schedule = generate(name, pp, microbatches, vpp=chunks)
    without = simulate(schedule)
    shares = []
    for lookahead in (0, 1):
        policy = OffloadPolicy("selective", offloaded, lookahead=lookahead)
        peaks = simulate(apply_offload(schedule, policy)).peak_memory_m
        shares.append((peaks[0] / baseline[0], max(peaks) / max(baseline)))
    (rank0_now, _), (rank0_ahead, highest) = shares
    listed = ",".join(map(str, offloaded))
    return (
        f"| {name} | {chunks} | {listed} | {pp} | {microbatches} | {without.bubble_rate:.3f} "
        f"| {max(without.peak_memory_m):.3f} | {rank0_now:.3f} | {rank0_ahead:.3f} | {highest:.3f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--microbatches-per-rank", type=int, default=4, help="m = this x p")
    args = parser.parse_args(argv)
    print(
        "| schedule | v | offloaded chunks | p | m | bubble | peak (M) | rank 0, lookahead 0 "
        "| rank 0, lookahead 1 | max rank, lookahead 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for chunks, offloaded in [(2, (0,)), (4, (0, 1))]:
        for pp in args.pp:
            microbatches = args.microbatches_per_rank * pp
            baseline = simulate(generate("interleaved-1f1b", pp, microbatches, vpp=chunks)).peak_memory_m
            for name in SCHEDULES:
                print(row(name, pp, microbatches, chunks, offloaded, baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
