#!/usr/bin/env python3
"""Print the comparison of every schedule against REFERENCE.md's table (unit costs F=B=W=1).

    python scripts/schedule_table.py > docs/schedule_table.md

B is 1F1B's bubble rate (p-1)/(m+p-1); M is one microbatch's activation over all layers. The
last peak column gives the largest rank's peak under each memory accounting of the simulator: a
unit's activation freed at its B, half of it kept until its W (the default), all of it kept until
its W (what the runtime's deferred W holds with flash attention, and what ``--model`` assumes).
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.schedule.costs import UniformCosts
from megatron_pp_ext.schedule.generators import SCHEDULES, RequestError, generate
from megatron_pp_ext.schedule.ir import Schedule
from megatron_pp_ext.schedule.simulate import simulate

# schedule -> (bubble as a multiple of B, rank-0 peak in M) from REFERENCE.md section 3.
TARGETS: dict[str, tuple[str, str]] = {
    "1f1b": ("B", "M"),
    "interleaved-1f1b": ("B/v", "M(1+1/v)"),
    "interleaved-1f1b-groups-of-p": ("B/v", "M(1+1/v)"),
    "zb-h1": ("B/3", "M"),
    "zb-h2": ("0", "2M"),
    "zb-auto": ("(limit-dependent)", "<= limit"),
    "v-min": ("2B/3", "M/3"),
    "v-half": ("B/2", "M/2"),
    "v-zb": ("0", "M"),
    "dualpipev": ("(p-1)(F&B+B-3W)", "(2p+1)/(2p) M"),
}


ACCOUNTINGS = (0.0, 0.5, 1.0)  # share of an F's activation kept from B to W


def peaks_by_accounting(schedule: Schedule) -> str:
    """The largest rank's peak (M) with the activation freed at B / half kept to W / all kept to W."""
    values = []
    for share in ACCOUNTINGS:
        costs = UniformCosts(
            num_stages=schedule.num_stages,
            num_slices=schedule.slices,
            chunks_per_rank=schedule.vpp,
            weight_fraction=share,
        )
        values.append(max(simulate(schedule, costs).peak_memory_m))
    return " / ".join(f"{value:.3f}" for value in values)


def rows(pp: int, microbatches: int) -> list[str]:
    one_f_one_b = (pp - 1) / (microbatches + pp - 1)
    baseline = simulate(generate("1f1b", pp, microbatches))
    baseline_idle = baseline.makespan - baseline.busy_per_rank[0]
    out = [
        f"\n### p={pp}, m={microbatches} (B = {one_f_one_b:.3f})\n",
        "| schedule | v | bubble | bubble / B | idle / 1F1B idle | bubble in span | reference bubble "
        "| peak rank 0 (M) | max peak (M) | max peak until B / default / until W (M) | reference peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SCHEDULES:
        try:
            schedule = generate(name, pp, microbatches)
        except RequestError as error:
            out.append(f"| {name} | - | n/a: {error} | | | | | | | | |")
            continue
        result = simulate(schedule)
        bubble_target, peak_target = TARGETS.get(name, ("-", "-"))
        out.append(
            f"| {name} | {result.schedule.vpp} | {result.bubble_rate:.3f} | "
            f"{result.bubble_rate / one_f_one_b:.2f} | "
            f"{(result.makespan - result.busy_per_rank[0]) / baseline_idle:.2f} | "
            f"{result.bubble_rate_in_span:.3f} | {bubble_target} | {result.peak_memory_m[0]:.3f} | "
            f"{max(result.peak_memory_m):.3f} | {peaks_by_accounting(schedule)} | {peak_target} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="4x8,4x16,8x16,8x32", help="PxM pairs")
    args = parser.parse_args()
    lines: list[str] = []
    for size in args.sizes.split(","):
        pp, microbatches = (int(x) for x in size.split("x"))
        lines += rows(pp, microbatches)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
