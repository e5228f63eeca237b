#!/usr/bin/env python3
"""Forward + backward time of sliced vs unsliced causal attention (a benchmark, not a test).

Unsliced: one attention call over the whole sequence. Sliced: k slices run forward in order and
backward in reverse, each attending to the cached K/V of the earlier ones, as a sequence-sliced
pipeline runs them. Runs on the GPU when there is one, with every backend that can run there.

    python scripts/bench_sliced_attention.py --seq-length 4096 --slices 4 --heads 8 --kv-heads 2

On a shared CPU pass --threads 1: with more threads than free cores, small ops wait on
descheduled threads and the sliced run (more, smaller ops) looks far slower than it is.
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


def slice_leaves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> list[tuple]:
    """Each slice's q, k, v as its own leaf tensors, as a pipeline stage receives them."""
    pieces = zip(q.split(lengths), k.split(lengths), v.split(lengths))
    return [tuple(t.detach().clone().requires_grad_() for t in piece) for piece in pieces]


def run_once(backend, slices: list[tuple], scale: float) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one pass over ``slices``."""
    cache = LayerCache("bench")
    device = slices[0][0].device
    sync(device)
    start = time.perf_counter()
    outs = [sliced_attention(q, k, v, cache, j, scale, backend) for j, (q, k, v) in enumerate(slices)]
    sync(device)
    middle = time.perf_counter()
    for out in reversed(outs):
        out.backward(torch.ones_like(out))
    sync(device)
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
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shape_q = (args.seq_length, args.batch, args.heads, args.head_dim)
    shape_kv = (args.seq_length, args.batch, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype)
    k = torch.randn(shape_kv, device=device, dtype=dtype)
    v = torch.randn(shape_kv, device=device, dtype=dtype)
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
        whole_inputs = slice_leaves(q, k, v, [args.seq_length])
        sliced_inputs = slice_leaves(q, k, v, lengths)
        run_once(backend, sliced_inputs, scale)  # warm-up (and compile, for flex)
        whole = best_of(args.repeats, run_once, backend, whole_inputs, scale)
        sliced = best_of(args.repeats, run_once, backend, sliced_inputs, scale)
        for mode, (fwd, bwd) in (("unsliced", whole), (f"{args.slices} slices", sliced)):
            ratio = (fwd + bwd) / sum(whole)
            times = f"{fwd * 1e3:9.2f} {bwd * 1e3:9.2f} {(fwd + bwd) * 1e3:9.2f}"
            print(f"{name:12} {mode:9} {times} {ratio:10.2f}x")


if __name__ == "__main__":
    main()
