#!/usr/bin/env python3
"""Forward + backward time of sliced vs unsliced causal attention (a benchmark, not a test).

Unsliced: one attention call over the whole sequence. Sliced: k slices run forward in order and
backward in reverse, each attending to the cached K/V of the earlier ones, as a sequence-sliced
pipeline runs them. Runs on the GPU when there is one, with every backend that can run there.

    python scripts/bench_sliced_attention.py --seq-length 4096 --slices 4 --heads 8 --kv-heads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from megatron_pp_ext.attention import (
    AUTO_ORDER,
    LayerCache,
    available_backends,
    choose_backend,
    sliced_attention,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def uniform_lengths(seq_length: int, slices: int) -> list[int]:
    """Equal slices; the first takes the remainder."""
    base = seq_length // slices
    return [seq_length - base * (slices - 1)] + [base] * (slices - 1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(backend, q, k, v, lengths: list[int], scale: float) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one pass over the slices ``lengths``."""
    for t in (q, k, v):
        t.grad = None
    cache = LayerCache("bench")
    bounds = [sum(lengths[:j]) for j in range(len(lengths) + 1)]
    sync(q.device)
    start = time.perf_counter()
    outs = [
        sliced_attention(q[a:b], k[a:b], v[a:b], cache, j, scale, backend)
        for j, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]
    sync(q.device)
    middle = time.perf_counter()
    for out in reversed(outs):
        out.backward(torch.ones_like(out))
    sync(q.device)
    return middle - start, time.perf_counter() - middle


def best_of(repeats: int, run: Callable[..., tuple[float, float]], *args) -> tuple[float, float]:
    runs = [run(*args) for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--backends", default=None, help="comma-separated; default: all that can run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shape_q = (args.seq_length, args.batch, args.heads, args.head_dim)
    shape_kv = (args.seq_length, args.batch, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True)
    probe_q, probe_k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
    names = args.backends.split(",") if args.backends else available_backends(probe_q, probe_k)
    auto = choose_backend("auto", probe_q, probe_k).name
    lengths = uniform_lengths(args.seq_length, args.slices)
    scale = args.head_dim**-0.5

    print(
        f"S={args.seq_length} k={args.slices} heads={args.heads} kv_heads={args.kv_heads} "
        f"d={args.head_dim} b={args.batch} {dtype} on {device}; "
        f"auto picks {auto} (order {', '.join(AUTO_ORDER)})"
    )
    print(f"{'backend':12} {'mode':9} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'vs unsliced':>11}")
    for name in names:
        backend = choose_backend(name, probe_q, probe_k)
        run_once(backend, q, k, v, lengths, scale)  # warm-up (and compile, for flex)
        whole = best_of(args.repeats, run_once, backend, q, k, v, [args.seq_length], scale)
        sliced = best_of(args.repeats, run_once, backend, q, k, v, lengths, scale)
        for mode, (fwd, bwd) in (("unsliced", whole), (f"{args.slices} slices", sliced)):
            ratio = (fwd + bwd) / sum(whole)
            times = f"{fwd * 1e3:9.2f} {bwd * 1e3:9.2f} {(fwd + bwd) * 1e3:9.2f}"
            print(f"{name:12} {mode:9} {times} {ratio:10.2f}x")


if __name__ == "__main__":
    main()
