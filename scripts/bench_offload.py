#!/usr/bin/env python3
"""Activation offload on one device: step-time overhead, peak memory, copy bandwidth and k.

One pipeline rank is emulated in a single process: the op order of rank 0 of 1F1B with
``--depth`` stages (``depth`` microbatches in flight) runs on a model of ``--layers`` layers
(with its embedding and output layer), once without copies and once with the copies that
``--offload`` asks for. It reports the step times and the overhead, the activation peak (the
runtime's meter, and the allocator's on a GPU), what the copies moved, the measured copy
bandwidth in each direction, the GEMM throughput, PipeOffload's k from the model shape and
those throughputs, and k as measured here (a unit's copy time over its compute time).

    python scripts/bench_offload.py                        # Llama-7B layers at 16K tokens on a GPU
    python scripts/bench_offload.py --seq-length 32768 --layers 2
    python scripts/bench_offload.py --preset tiny          # a CPU smoke run (the default on CPU)

The GPU is used when there is one; pass --json PATH to keep the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_pp_ext.megatron.model import ModelConfig, build_stage, init_parallel_state
from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
from megatron_pp_ext.runtime.offload_probe import measure_compute_throughput, measure_copy_bandwidths
from megatron_pp_ext.schedule.costs import offload_ratio
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import Op, Placement, Schedule
from megatron_pp_ext.schedule.offload import OffloadPolicy, apply_offload

PRESETS = {
    "llama-7b": dict(
        hidden_size=4096, num_attention_heads=32, num_kv_heads=32, ffn_hidden_size=11008, vocab_size=32000
    ),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=176, vocab_size=256),
}


def parse_args() -> argparse.Namespace:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="llama-7b" if on_gpu else "tiny")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default 4; tiny 2)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens (default 16384; tiny 256)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--depth", type=int, default=4, help="pipeline stages: microbatches in flight")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--offload", choices=("full", "selective", "auto"), default="full")
    parser.add_argument("--lookahead", type=int, default=None, help="compute ops a RELOAD runs ahead")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    tiny = args.preset == "tiny"
    args.layers = args.layers or (2 if tiny else 4)
    args.seq_length = args.seq_length or (256 if tiny else 16384)
    return args


def rank0_of_1f1b(depth: int, microbatches: int) -> Schedule:
    """Rank 0's op order of 1F1B over ``depth`` stages, as a one-rank schedule."""
    ops = [
        Op(op.kind, 0, op.microbatch)
        for op in generate("1f1b", depth, microbatches).ranks[0]
        if op.is_compute
    ]
    return Schedule(f"1f1b-rank0-of-{depth}", 1, microbatches, 1, 1, Placement(1, 1), [ops])


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def loss_func(mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    loss = (output.float().reshape(-1) * mask.reshape(-1)).sum()
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def batches(model: ModelConfig, micro_batch: int, count: int, device: torch.device) -> list[dict]:
    shape = (micro_batch, model.seq_length)
    positions = torch.arange(model.seq_length, device=device).unsqueeze(0).expand(micro_batch, -1)
    return [
        {
            "tokens": torch.randint(0, model.vocab_size, shape, device=device),
            "labels": torch.randint(0, model.vocab_size, shape, device=device),
            "loss_mask": torch.ones(shape, device=device),
            "position_ids": positions,
        }
        for _ in range(count)
    ]


def run(
    runtime: PipelineRuntime, schedule: Schedule, data: list[dict], steps: int, device: torch.device
) -> dict:
    """Mean seconds per step over ``steps`` steps after a warm-up, and the last step's result."""
    times = []
    for step in range(steps + 1):
        for chunk in runtime.chunks:
            chunk.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = runtime.step(schedule, forward_step, iter(data))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - started)
    return {
        "step_seconds": sum(times) / len(times),
        "peak_activation_bytes": result.peak_activation_bytes,
        "peak_allocated_bytes": result.peak_memory_allocated,
        "offload": None if result.offload is None else dataclasses.asdict(result.offload),
    }


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_parallel_state(1)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = ModelConfig(
        num_layers=args.layers, seq_length=args.seq_length, dtype=dtype, **PRESETS[args.preset]
    )
    torch.manual_seed(0)
    chunk = build_stage(model, 0, [args.layers])
    data = batches(model, args.micro_batch_size, args.microbatches, device)
    shape = (model.seq_length, args.micro_batch_size, model.hidden_size)
    runtime = PipelineRuntime([chunk], PipeComm(timeout_s=600), shape, model.torch_dtype)

    d2h, h2d = measure_copy_bandwidths(device)
    throughput = measure_compute_throughput(device, model.torch_dtype)
    k_formula = offload_ratio(model.hidden_size, model.seq_length, throughput, min(d2h, h2d))
    base = rank0_of_1f1b(args.depth, args.microbatches)
    lookahead = args.lookahead if args.lookahead is not None else max(1, -(-3 * k_formula // 1))
    policy = OffloadPolicy(
        args.offload, ratio=k_formula if args.offload == "auto" else None, lookahead=int(lookahead)
    )
    offloaded = apply_offload(base, policy)

    without = run(runtime, base, data, args.steps, device)
    with_copies = run(runtime, offloaded, data, args.steps, device)
    moved = with_copies["offload"] or {}
    units = max(1, offloaded.meta.get("offloaded_units", 0))
    unit_bytes = moved.get("offloaded_bytes", 0) / units
    unit_compute = without["step_seconds"] / args.microbatches  # F + B + W of one unit
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": f"{args.preset} x{args.layers} layers, {args.seq_length} tokens, {dtype}",
        "schedule": f"{base.name}, {args.microbatches} microbatches, {args.offload} "
        f"({offloaded.meta.get('offloaded_units', 0)} units, reload {int(lookahead)} ops ahead)",
        "step_seconds": {"without": without["step_seconds"], "with": with_copies["step_seconds"]},
        "overhead": with_copies["step_seconds"] / without["step_seconds"] - 1,
        "peak_activation_bytes": {
            "without": without["peak_activation_bytes"],
            "with": with_copies["peak_activation_bytes"],
        },
        "peak_allocated_bytes": {
            "without": without["peak_allocated_bytes"],
            "with": with_copies["peak_allocated_bytes"],
        },
        "copies": moved,
        "bandwidth_bytes_per_s": {"device_to_host": d2h, "host_to_device": h2d},
        "gemm_flops_per_s": throughput,
        "k_formula": k_formula,
        "k_measured": unit_bytes / min(d2h, h2d) / unit_compute if unit_bytes else None,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
