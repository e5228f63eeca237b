#!/usr/bin/env python3
"""How far selective offload lowers the activation peak of interleaved 1F1B (simulator, unit costs).

For each pipeline size and chunk count, the peak with the first chunks offloaded, as a share of
the peak without offload: on rank 0 and over all ranks, with reloads issued just before the
backward (lookahead 0) and one compute op ahead (lookahead 1, the default).

    python scripts/selective_offload_table.py
    python scripts/selective_offload_table.py --pp 4 8 16 --microbatches-per-rank 4
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.offload import OffloadPolicy, apply_offload
from megatron_pp_ext.schedule.simulate import simulate


def peak_shares(pp: int, microbatches: int, chunks: int, offloaded: tuple[int, ...], lookahead: int):
    """(rank-0 share, share of the highest rank peak) of the peak without offload."""
    schedule = generate("interleaved-1f1b", pp, microbatches, vpp=chunks)
    without = simulate(schedule).peak_memory_m
    policy = OffloadPolicy("selective", offloaded, lookahead=lookahead)
    with_copies = simulate(apply_offload(schedule, policy)).peak_memory_m
    return with_copies[0] / without[0], max(with_copies) / max(without)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--microbatches-per-rank", type=int, default=4, help="m = this x p")
    args = parser.parse_args(argv)
    cases = [(2, (0,)), (4, (0, 1)), (4, (0,))]
    print("| v | offloaded chunks | p | m | rank 0, lookahead 0 | rank 0, lookahead 1 | max rank, lookahead 1 |")
    print("|---|---|---|---|---|---|---|")
    for chunks, offloaded in cases:
        for pp in args.pp:
            m = args.microbatches_per_rank * pp
            rank0_now, _ = peak_shares(pp, m, chunks, offloaded, 0)
            rank0_ahead, highest = peak_shares(pp, m, chunks, offloaded, 1)
            listed = ",".join(map(str, offloaded))
            print(f"| {chunks} | {listed} | {pp} | {m} | {rank0_now:.3f} | {rank0_ahead:.3f} | {highest:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
