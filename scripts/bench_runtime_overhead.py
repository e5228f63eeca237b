#!/usr/bin/env python3
"""The runtime's own per-step Python work, with and without the activation meter.

Two gloo ranks (CPU) run the bench's ``small`` megatron-core model through ``PipelineRuntime``
with 1F1B and interleaved 1F1B (2 chunks), m = 8, fp32, the same weights and data, alternating
``measure_memory=True`` and ``False`` round by round (A B A B, so drift in the machine's speed hits
both alike). Per round: warm-up steps, then timed steps (rank 0's wall time per step, after a
barrier); one more step runs under cProfile on rank 0 and gives the Python calls per step.

    python scripts/bench_runtime_overhead.py                  # 6 rounds of 6 timed steps
    python scripts/bench_runtime_overhead.py --rounds 10 --json

Prints, per schedule and mode, the median step time, the off/on ratio per round (min, median,
max) and the calls per step. Timings are this machine's; the call counts do not depend on it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2}  # name -> chunks per rank


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    sys.path.insert(0, str(REPO))
    from megatron_pp_ext import data
    from megatron_pp_ext.bench.job import MODEL_SIZES
    from megatron_pp_ext.megatron.model import (
        ModelConfig,
        build_chunks_from,
        build_reference,
        init_parallel_state,
    )
    from megatron_pp_ext.megatron.steps import forward_step
    from megatron_pp_ext.runtime import PipeComm, PipelineRuntime
    from megatron_pp_ext.schedule.generators import generate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    init_parallel_state(world)
    size = MODEL_SIZES["small"]
    model = ModelConfig(**size["model"])
    torch.manual_seed(1234)
    reference = build_reference(model)
    stream = data.batches(data.encode(data.stdlib_corpus()), model.seq_length, size["micro_batch_size"], 1)
    batches = [next(stream) for _ in range(args.microbatches)]
    comm = PipeComm(timeout_s=300)
    shape = (model.seq_length, size["micro_batch_size"], model.hidden_size)
    results: dict[str, dict[str, list]] = {}
    for name, chunks_per_rank in SCHEDULES.items():
        schedule = generate(name, world, args.microbatches, vpp=chunks_per_rank)
        chunks, _ = build_chunks_from(reference, model, schedule.placement, rank)
        runtimes = {
            measured: PipelineRuntime(chunks, comm, shape, model.torch_dtype, measure_memory=measured)
            for measured in (True, False)
        }

        def step(runtime: PipelineRuntime, chunks: list = chunks, schedule=schedule) -> None:
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            runtime.step(schedule, forward_step, [iter(batches) for _ in chunks])

        entry = results.setdefault(name, {"on": [], "off": [], "calls_on": [], "calls_off": []})
        for _ in range(args.rounds):
            for measured, label in ((True, "on"), (False, "off")):
                runtime = runtimes[measured]
                for _ in range(args.warmup):
                    step(runtime)
                times = []
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    step(runtime)
                    times.append(time.perf_counter() - start)
                entry[label].append(statistics.median(times))
                profile = cProfile.Profile()
                dist.barrier()
                profile.enable()
                step(runtime)
                profile.disable()
                entry[f"calls_{label}"].append(pstats.Stats(profile).total_calls)
    comm.close()
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        out = f"{scratch}/results.json"
        mp.start_processes(worker, args=(2, port, args, out), nprocs=2, start_method="spawn")
        results = json.loads(Path(out).read_text())
    rows = []
    for name, entry in results.items():
        ratios = [off / on for on, off in zip(entry["on"], entry["off"])]
        rows.append(
            {
                "schedule": name,
                "step_s_meter_on": statistics.median(entry["on"]),
                "step_s_meter_off": statistics.median(entry["off"]),
                "off_over_on": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
                "calls_per_step_meter_on": int(statistics.median(entry["calls_on"])),
                "calls_per_step_meter_off": int(statistics.median(entry["calls_off"])),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    header = f"{'schedule':18s} {'on (s)':>8s} {'off (s)':>8s} {'off/on min/med/max':>22s}"
    print(f"{header} {'calls on':>9s} {'calls off':>9s}")
    for row in rows:
        r = row["off_over_on"]
        print(
            f"{row['schedule']:18s} {row['step_s_meter_on']:8.4f} {row['step_s_meter_off']:8.4f} "
            f"{r['min']:6.3f} {r['median']:6.3f} {r['max']:6.3f} "
            f"{row['calls_per_step_meter_on']:9d} {row['calls_per_step_meter_off']:9d}"
        )


if __name__ == "__main__":
    main()
