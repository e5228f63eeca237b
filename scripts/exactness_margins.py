"""Print the tightest exactness margins (tolerance / error) a test run recorded.

    PP_EXT_ERROR_LOG=/tmp/errors.jsonl python -m pytest -q
    python scripts/exactness_margins.py /tmp/errors.jsonl [--top 10] [--then 1e-5]

Each row is one test: its tightest comparison through ``tests/exactness.py``'s ``check``.
``--then TOL`` adds the margin a fixed tolerance would have left (a before/after table).
"""

from __future__ import annotations

import argparse
import json
import math


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", help="the JSON-lines file PP_EXT_ERROR_LOG named")
    parser.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    parser.add_argument(
        "--then", type=float, default=None, help="also show the margin under this fixed tolerance"
    )
    args = parser.parse_args()
    worst: dict[str, dict] = {}
    with open(args.log) as handle:
        for line in handle:
            row = json.loads(line)
            key = row["test"]
            margin = row["tolerance"] / row["error"] if row["error"] > 0 else math.inf
            if key not in worst or margin < worst[key]["margin"]:
                worst[key] = {**row, "margin": margin}
    rows = sorted(worst.values(), key=lambda row: row["margin"])[: args.top]
    header = f"{'margin':>8}  {'error':>9}  {'tolerance':>9}"
    header += f"  {'then':>8}" if args.then else ""
    print(f"{header}  test / what")
    for row in rows:
        line = f"{row['margin']:8.1f}  {row['error']:9.2e}  {row['tolerance']:9.2e}"
        if args.then:
            line += f"  {args.then / row['error'] if row['error'] else math.inf:8.2f}"
        print(f"{line}  {row['test']} / {row['what']}")
    print(f"{len(worst)} tests")


if __name__ == "__main__":
    main()
