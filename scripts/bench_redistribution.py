#!/usr/bin/env python3
"""SlimPipe's attention redistribution on real processes: time per iteration with and without it.

Runs ``megatron-pp-ext train`` back to back, alternating ``--pp-attn-redistribution 0`` and CAP
(several rounds, so drift in the machine's speed hits both alike), on a sliced schedule with
uniform slices and a sequence long enough for attention to weigh (late slices attend to many
more keys than early ones: the imbalance redistribution evens out). Reads each run's
``--metrics``: the steady-state time per iteration is the loss rank's ``wall_time`` spread between
iteration ``--skip`` and the last; and each rank's attention handed away and served, from the
report ``train`` prints.

    python scripts/bench_redistribution.py                      # slimpipe p=2 k=8, seq 2048
    python scripts/bench_redistribution.py --schedule slimpipe-interleaved --slices 4 --rounds 5

The light op serves its partner on its own main thread (runtime/redistribution.py), so on a CPU
the partner's share is computed in the light rank's time, as on a GPU; each rank gets one core
(``--threads``). Prints one line per setting; ``--json`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="slimpipe")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--cap", type=float, default=0.5)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3, help="iterations left out at the start (warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternated")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args()


def config(directory: Path, args: argparse.Namespace) -> Path:
    """tiny-llama, narrow and long: attention (quadratic in the sequence) dominates the step."""
    data = yaml.safe_load((REPO / "configs/tiny-llama.yaml").read_text())
    data["training"].update(micro_batch_size=1, warmup=1)
    data["model"].update(
        hidden_size=args.hidden,
        ffn_hidden_size=args.hidden * 2,
        num_attention_heads=4,
        num_kv_heads=2,
        num_layers=args.layers,
        seq_length=args.seq_length,
    )
    path = directory / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(config_path: Path, metrics: Path, cap: float, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "megatron_pp_ext", "train", "--config", str(config_path),
        "--pipeline-model-parallel-size", str(args.pp), "--pp-schedule", args.schedule,
        "--pp-seq-slices", str(args.slices), "--pp-slice-partition", "uniform",
        "--microbatches", str(args.microbatches), "--train-iters", str(args.iterations),
        "--pp-attn-redistribution", str(cap), "--metrics", str(metrics),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    first, last = rows[args.skip - 1], rows[-1]
    number = r"([0-9.e+-]+)"
    pattern = rf"rank (\d+): .*?attention Mpairs computed {number} \(served {number}\), handed away {number}"
    attention = {int(rank): tuple(map(float, rest)) for rank, *rest in re.findall(pattern, done.stdout)}
    return {
        "period": (last["wall_time"] - first["wall_time"]) / (last["iteration"] - first["iteration"]),
        "losses": [row["loss"] for row in rows],
        "attention": attention,  # rank -> (computed, served, handed away) in Mpairs
    }


def main() -> None:
    args = parse_args()
    periods: dict[float, list[float]] = {0.0: [], args.cap: []}
    results: dict[float, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        config_path = config(directory, args)
        for round_index in range(args.rounds):
            caps = (0.0, args.cap) if round_index % 2 == 0 else (args.cap, 0.0)
            for cap in caps:
                results[cap] = run(config_path, directory / "m.jsonl", cap, args)
                periods[cap].append(results[cap]["period"])
    without, with_ = statistics.median(periods[0.0]), statistics.median(periods[args.cap])
    same_losses = max(abs(a - b) for a, b in zip(results[0.0]["losses"], results[args.cap]["losses"]))
    summary = {
        "schedule": args.schedule,
        "pp": args.pp,
        "slices": args.slices,
        "microbatches": args.microbatches,
        "seq_length": args.seq_length,
        "cap": args.cap,
        "without_s": without,
        "with_s": with_,
        "speedup": without / with_,
        "runs": {str(cap): values for cap, values in periods.items()},
        "attention_with": results[args.cap]["attention"],
        "max_loss_difference": same_losses,
    }
    print(
        f"{args.schedule} p={args.pp} k={args.slices} m={args.microbatches} seq {args.seq_length}: "
        f"without {without * 1e3:.1f} ms, with cap {args.cap:g} {with_ * 1e3:.1f} ms per iteration "
        f"(median of {args.rounds}; without/with {without / with_:.3f}); attention per rank with it "
        f"(computed, served, handed away, Mpairs): {results[args.cap]['attention']}; "
        f"largest loss difference {same_losses:.2e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
