#!/usr/bin/env python3
"""How long generating, validating and simulating a big schedule takes (a benchmark, not a test).

python scripts/bench_schedule_core.py --pp 8 --microbatches 64 --vpp 2 --slices 8
"""

from __future__ import annotations

import argparse
import time

from megatron_pp_ext.schedule.generators import SCHEDULES, RequestError, generate
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.simulate import simulate
from megatron_pp_ext.schedule.validate import validate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--slices", type=int, default=8)
    args = parser.parse_args()
    print(f"p={args.pp} m={args.microbatches} v={args.vpp} k={args.slices}")
    print(f"{'schedule':24} {'ops':>7} {'generate':>9} {'validate':>9} {'simulate':>9} {'total':>8}")
    for name, spec in SCHEDULES.items():
        vpp = args.vpp if spec.allowed_vpp is None or args.vpp in spec.allowed_vpp else spec.default_vpp
        t0 = time.perf_counter()
        try:
            schedule = generate(name, args.pp, args.microbatches, vpp=vpp, slices=args.slices)
        except RequestError as error:
            print(f"{name:24} skipped: {error}")
            continue
        t1 = time.perf_counter()
        validate(lower(schedule))
        t2 = time.perf_counter()
        simulate(schedule)
        t3 = time.perf_counter()
        ops = sum(len(ops) for ops in schedule.ranks)
        label = f"{name} (v={vpp})"
        print(f"{label:24} {ops:7d} {t1 - t0:8.3f}s {t2 - t1:8.3f}s {t3 - t2:8.3f}s {t3 - t0:7.3f}s")


if __name__ == "__main__":
    main()
