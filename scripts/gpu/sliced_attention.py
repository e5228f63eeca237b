"""Sliced causal attention against one unsliced call at one sequence length, on the GPU in bf16.

    python3 scripts/gpu/sliced_attention.py SEQ_LENGTH [--slices K] [--backends LIST] [--repeats N]

Runs scripts/bench_sliced_attention.py (forward + backward of k slices, each attending to the
cached K/V of the earlier ones, as a sequence-sliced pipeline runs them, against one attention
call over the whole sequence) with GQA 8:1 (32 query heads, 4 KV heads, head dim 128), batch 1,
bf16, on the backends that scale to 128K tokens: torch_flash (torch's flash-attention kernels),
sdpa (torch SDPA) and flash_attn when the package imports. The math and flex backends are left
out (math materialises s x s; flex compiles for minutes). Prints the bench's table and sums it up
as sliced time / unsliced time per backend. ``--backends`` narrows the list (comma-separated, in
the bench's names): ``torch_flash,flash_attn`` compares the slices with one unsliced flash call
only (``flash_attn`` is left out, saying so, where the package does not import).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys

import common

ROW = re.compile(r"^(\S+)\s+(unsliced|\d+ slices)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s*$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seq_length", type=int)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="torch_flash,sdpa,flash_attn", help="comma-separated")
    args = parser.parse_args()
    common.need_cuda()
    backends = [name for name in args.backends.split(",") if name]
    if "flash_attn" in backends and importlib.util.find_spec("flash_attn") is None:
        print("flash_attn does not import here: its rows are left out", flush=True)
        backends.remove("flash_attn")
    if not backends:
        common.fail(f"--backends {args.backends!r} leaves no backend to run")
    command = [
        sys.executable, str(common.REPO / "scripts" / "bench_sliced_attention.py"),
        "--seq-length", str(args.seq_length), "--slices", str(args.slices),
        "--heads", "32", "--kv-heads", "4", "--head-dim", "128", "--batch", "1", "--dtype", "bf16",
        "--backends", ",".join(backends), "--repeats", str(args.repeats),
    ]  # fmt: skip
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=common.REPO, check=False)
    print(done.stdout + done.stderr, end="", flush=True)
    if done.returncode != 0:
        common.fail(f"bench_sliced_attention.py exited with {done.returncode}")
    totals: dict[str, dict[str, float]] = {}
    for line in done.stdout.splitlines():
        match = ROW.match(line)
        if match:
            mode = "unsliced" if match[2] == "unsliced" else "sliced"
            totals.setdefault(match[1], {})[mode] = float(match[5])  # total ms
    parts = [
        f"{name} {t['sliced']:.1f} / {t['unsliced']:.1f} ms = {t['sliced'] / t['unsliced']:.2f}x"
        for name, t in totals.items()
        if {"sliced", "unsliced"} <= set(t)
    ]
    if len(parts) != len(backends):
        common.fail(f"expected a sliced and an unsliced row for each of {backends} in the bench's table")
    common.passed(f"S={args.seq_length}, k={args.slices} sliced / unsliced: " + "; ".join(parts))


if __name__ == "__main__":
    main()
