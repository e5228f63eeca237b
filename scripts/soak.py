"""A soak run of ``megatron-pp-ext train`` (issue 27): thousands of iterations with a checkpoint every
``--save-interval``, the same command preempted twice (SIGTERM) and resumed with ``--load``, and
the host resources of every rank sampled all along the uninterrupted run.

It shows what a weeks-long job needs: resident memory flat after warm-up (growth under 2%), no
file-descriptor or thread growth, and losses of the resumed run identical to the uninterrupted
one, iteration by iteration. Writes ``OUT/soak.json`` (the samples and the verdicts) and
``OUT/soak.svg`` (resident memory per rank against time).

    python scripts/soak.py --iterations 2000 --out runs/soak   # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

JOB = [  # small enough for 2 CPU cores, every part of a real step: PP2 x DP2, 1F1B with B/W split
    "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", "--pp-schedule", "zb-h1",
    "--num-layers", "4", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
]  # fmt: skip
SAMPLE_EVERY_S = 1.0
WARMUP_SHARE = 0.2  # growth is measured from the end of the first fifth of the run


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the ranks the train command spawned)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(k) for k in kids]
        frontier += [int(k) for k in kids]
    return found


def resources(pid: int) -> dict[str, int] | None:
    """RSS in KiB, open file descriptors and threads of one process (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "fds": fds,
        "threads": int(fields["Threads"].strip()),
    }


def last_iteration(metrics: Path) -> int:
    try:
        rows = metrics.read_text().splitlines()
    except OSError:
        return 0
    return json.loads(rows[-1])["iteration"] if rows else 0


def train(
    args: list[str], sample: bool, metrics: Path, stop_at: int | None = None
) -> tuple[list[dict], float]:
    """Run ``megatron-pp-ext train ARGS --metrics METRICS``; with ``sample``, the ranks'
    resources every second; with ``stop_at``, a SIGTERM (a preemption) once that iteration is in."""
    command = [sys.executable, "-m", "megatron_pp_ext", "train", *JOB, *args, "--metrics", str(metrics)]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict] = []
    signalled = False
    while process.poll() is None:
        time.sleep(SAMPLE_EVERY_S if sample else 0.2)
        if stop_at is not None and not signalled and last_iteration(metrics) >= stop_at:
            process.send_signal(signal.SIGTERM)
            signalled = True
        if sample:
            ranks = {}
            for child in children(process.pid):
                found = resources(child)
                if found is not None and found["threads"] > 1:  # the ranks, not a resource tracker
                    ranks[child] = found
            if ranks:
                samples.append({"t": round(time.perf_counter() - start, 2), "ranks": ranks})
    if process.returncode != 0:
        raise SystemExit(
            f"soak: train {' '.join(args)} failed ({process.returncode}): {process.stderr.read()[-2000:]}"
        )
    return samples, time.perf_counter() - start


def losses(path: Path) -> dict[int, float]:
    return {row["iteration"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def growth(samples: list[dict], key: str) -> dict[str, float]:
    """Per rank (in the order the ranks appear): the largest value just after warm-up (the
    samples from 20% to 30% of the run), the largest near the end (80% to 95%: before the
    teardown), and the relative growth between them."""
    by_rank: dict[str, list[int]] = {}
    for sample in samples:
        for pid, values in sample["ranks"].items():
            by_rank.setdefault(str(pid), []).append(values[key])
    result = {}
    for index, series in enumerate(by_rank.values()):
        n = len(series)
        start = max(series[int(n * WARMUP_SHARE) : max(int(n * 0.3), int(n * WARMUP_SHARE) + 1)])
        end = max(series[int(n * 0.8) : max(int(n * 0.95), int(n * 0.8) + 1)])
        result[f"rank{index}"] = {"after_warmup": start, "end": end, "growth": (end - start) / max(1, start)}
    return result


def svg(samples: list[dict], path: Path) -> None:
    """Resident memory (MiB) of each rank against time: one polyline per rank."""
    width, height, margin = 720, 300, 50
    series: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        for pid, values in sample["ranks"].items():
            series.setdefault(str(pid), []).append((sample["t"], values["rss_kib"] / 1024))
    t_max = max(t for s in series.values() for t, _ in s) or 1.0
    m_max = max(m for s in series.values() for _, m in s) * 1.1
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{margin}" y="20">resident memory per rank (MiB) over the uninterrupted soak run</text>',
        f'<line x1="{margin}" y1="{height - margin}" x2="{width - 10}" y2="{height - margin}" '
        'stroke="black"/>',
        f'<line x1="{margin}" y1="30" x2="{margin}" y2="{height - margin}" stroke="black"/>',
        f'<text x="{width // 2}" y="{height - 15}">seconds (0 to {t_max:.0f})</text>',
        f'<text x="5" y="40">{m_max:.0f}</text><text x="5" y="{height - margin}">0</text>',
    ]
    for index, points in enumerate(series.values()):
        x = [margin + t / t_max * (width - margin - 10) for t, _ in points]
        y = [height - margin - m / m_max * (height - margin - 30) for _, m in points]
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(x, y))
        color = colors[index % len(colors)]
        lines.append(f'<polyline fill="none" stroke="{color}" points="{coords}"/>')
        lines.append(f'<text x="{width - 90}" y="{40 + 14 * index}" fill="{color}">rank {index}</text>')
    lines.append("</svg>")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--save-interval", type=int, default=100)
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n, every = args.iterations, args.save_interval

    whole = out / "uninterrupted"
    flags = ["--train-iters", str(n), "--save-interval", str(every)]
    samples, seconds = train([*flags, "--save", str(whole)], True, out / "uninterrupted.jsonl")
    # the same command preempted twice (SIGTERM at about a third and two thirds: it saves where it
    # stops) and started again with --load each time, as a SLURM requeue would
    resumed = out / "resumed"
    pieces = []
    for stop_at in (n // 3, 2 * n // 3, None):
        load = ["--load", str(resumed)] if pieces else []
        metrics = out / "resumed.jsonl"
        _, piece_seconds = train([*flags, "--save", str(resumed), *load], False, metrics, stop_at)
        pieces.append({"stopped_at": last_iteration(metrics), "seconds": round(piece_seconds, 1)})

    reference = losses(out / "uninterrupted.jsonl")
    again = losses(out / "resumed.jsonl")
    differing = sorted(i for i in reference if again.get(i) != reference[i])
    rss, fds, threads = (growth(samples, key) for key in ("rss_kib", "fds", "threads"))
    verdict = {
        "iterations": n,
        "save_interval": every,
        "uninterrupted_seconds": round(seconds, 1),
        "resumed_pieces": pieces,
        "losses_compared": len(reference),
        "losses_differing": differing[:20],
        "rss": rss,
        "fds": fds,
        "threads": threads,
        "rss_flat": all(r["growth"] < 0.02 for r in rss.values()),
        "fds_flat": all(f["end"] <= f["after_warmup"] for f in fds.values()),
        "threads_flat": all(t["end"] <= t["after_warmup"] for t in threads.values()),
        "losses_identical": not differing and len(again) == len(reference) == n,
    }
    (out / "soak.json").write_text(json.dumps({**verdict, "samples": samples}, indent=1))
    svg(samples, out / "soak.svg")
    print(json.dumps(verdict, indent=1))
    ok = all(verdict[k] for k in ("rss_flat", "fds_flat", "threads_flat", "losses_identical"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
