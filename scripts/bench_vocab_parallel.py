#!/usr/bin/env python3
"""Vocabulary parallelism on CPU: per-rank busy time and peak memory, with and without it.

For a model whose vocabulary dominates (default: vocabulary 32K, hidden 64, 4 layers), p gloo
processes each build their pipeline stage (megatron-core GPTModel) and measure, per microbatch:

* without vocabulary parallelism: the stage's forward + backward as Megatron runs it (the first
  stage with its word embedding, the last with its output layer and cross-entropy);
* with it (``runtime/vocab_parallel.py``): the stage without the tables (``install_embedding_feed``
  / ``install_output_capture``) plus this rank's vocabulary work: its embedding rows (lookup and
  gradient) and its output-layer shard (S and T compute), run through the real collectives.

Busy time is compute only: the ranks take turns (a barrier between turns), so p processes on a
few cores do not slow one another; the collectives are timed apart (``comm``, also in turns).
Peak memory is the runtime's accounting (``ActivationMeter``: what autograd saves, what a
microbatch's vocabulary state keeps from S to T) plus the static bytes of weights, gradients and
two Adam moments (4 x parameter bytes, fp32). Activation peaks assume 1F1B: rank r holds p - r
microbatches of its stage; the vocabulary state of one microbatch is held at once (S then T).
This is only the numerics part: the pipeline schedule with S and T ops is measured elsewhere.

    python scripts/bench_vocab_parallel.py                 # p = 2, 3, 4
    python scripts/bench_vocab_parallel.py --pp 4 --variant vocab-2 --json vocab.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_pp_ext.megatron.model import ModelConfig, build_stage, init_parallel_state, split_layers
from megatron_pp_ext.runtime.memory import ActivationMeter
from megatron_pp_ext.runtime.vocab_parallel import (
    VocabGroups,
    VocabParallel,
    install_embedding_feed,
    install_output_capture,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 3, 4], help="pipeline sizes to run")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=6, help="timed microbatches (after one warm-up)")
    parser.add_argument("--variant", choices=("vocab-1", "vocab-2"), default="vocab-1")
    parser.add_argument("--json", help="write the numbers here")
    return parser.parse_args()


def model_of(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=4 * args.hidden,
        vocab_size=args.vocab,
        seq_length=args.seq_length,
    )


class Turns:
    """Runs a compute step rank by rank (barriers between turns) and adds up its time, per
    microbatch (``lap``); the figures are the fastest microbatch's, against the machine's noise."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.seconds: dict[str, float] = {}
        self.laps: list[dict[str, float]] = []

    def lap(self) -> None:
        self.laps.append(self.seconds)
        self.seconds = {}

    def fastest(self, name: str) -> float:
        """The least time of ``name`` over the microbatches after the first (the warm-up)."""
        return min(lap.get(name, 0.0) for lap in self.laps[1:])

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        result = None
        for turn in range(self.size):
            dist.barrier()
            if turn == self.rank:
                start = time.perf_counter()
                result = fn(*args)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        dist.barrier()
        return result

    def comm(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A collective, started together (after a barrier): its own time, no waiting for peers."""
        dist.barrier()
        start = time.perf_counter()
        result = fn(*args)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return result


def param_bytes(modules: list[torch.nn.Module]) -> int:
    seen = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def batch(model: ModelConfig, micro_batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (micro_batch, model.seq_length)
    return {
        "tokens": torch.randint(0, model.vocab_size, shape, generator=gen),
        "labels": torch.randint(0, model.vocab_size, shape, generator=gen),
        "position_ids": torch.arange(model.seq_length).unsqueeze(0).expand(micro_batch, -1),
    }


def stage_step(
    stage: torch.nn.Module, rank: int, size: int, data: dict, hidden_shape: tuple, meter: ActivationMeter
) -> Callable[[], int]:
    """One forward + backward of the stage on its own (random stage input / output gradient);
    returns the bytes autograd saved in the forward."""

    def step() -> int:
        stage_input = None if rank == 0 else torch.randn(hidden_shape, requires_grad=True)
        stage.set_input_tensor(stage_input)
        before = meter.live
        with meter.saving():
            output = stage(data["tokens"], data["position_ids"], None, labels=data["labels"])
        saved = meter.live - before
        if output.dim() == 2:  # per-token losses (the baseline's last stage)
            output.sum().backward()
        else:
            output.backward(torch.randn_like(output))
        return saved

    return step


def worker(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=600))
    try:
        results.put((rank, measure(rank, size, args)))
    finally:
        dist.destroy_process_group()


def measure(rank: int, size: int, args: argparse.Namespace) -> dict:
    init_parallel_state(size)
    model = model_of(args)
    layers = split_layers(model.num_layers, size)
    micro = args.micro_batch_size
    hidden_shape = (model.seq_length, micro, model.hidden_size)
    data = [batch(model, micro, seed) for seed in range(args.microbatches + 1)]
    first, last = rank == 0, rank == size - 1
    out: dict[str, Any] = {"rank": rank, "layers": layers[rank]}

    # ---- without vocabulary parallelism: Megatron's stages as they are ----
    torch.manual_seed(0)
    stage = build_stage(model, rank, layers)
    meter = ActivationMeter()
    meter.exclude(stage.parameters())
    turns = Turns(rank, size)
    saved = 0
    for item in data:
        saved = turns.run("stage", stage_step(stage, rank, size, item, hidden_shape, meter))
        turns.lap()
    out["base"] = {
        "param_bytes": param_bytes([stage]),
        "activation_per_mb": saved,
        "busy_s": turns.fastest("stage"),
    }
    del stage

    # ---- with vocabulary parallelism ----
    torch.manual_seed(0)
    stage = build_stage(model, rank, layers)
    feed = install_embedding_feed(stage) if first else None
    capture = install_output_capture(stage) if last else None
    vp = VocabParallel(
        model.vocab_size,
        model.hidden_size,
        variant=args.variant,
        device="cpu",
        groups=VocabGroups.create(),
    )
    vp.reset_parameters(torch.nn.init.normal_)
    meter = ActivationMeter()
    meter.exclude(list(stage.parameters()) + list(vp.parameters()))
    turns = Turns(rank, size)
    vocab_peak = 0
    for item in data:
        if first:
            feed.put(torch.randn(micro, model.seq_length, model.hidden_size, requires_grad=True))
        saved = turns.run("stage", stage_step(stage, rank, size, item, hidden_shape, meter))
        if last:
            capture.labels.clear()
        # the vocabulary work of this microbatch, collectives included
        comm, vocab = "comm", "vocab"
        ids = turns.comm(comm, vp.e_ids, item["tokens"] if first else None, item["tokens"].shape)
        partial = turns.run(vocab, vp.e_forward, ids)
        turns.comm(comm, vp.e_reduce, partial)
        hidden = torch.randn(hidden_shape) if last else None
        weights = torch.full(item["labels"].shape, 1.0 / item["labels"].numel()) if last else None
        labels = item["labels"] if last else None
        sent = turns.comm(comm, vp.s_broadcast, hidden, labels, hidden_shape, weights)
        state = turns.run(vocab, vp.s_forward, *sent)
        holds = meter.hold_all(state.tensors())
        vocab_peak = max(vocab_peak, meter.live)
        turns.comm(comm, vp.s_reduce, state)  # vocab-2: with its input-gradient rescale and reduce
        turns.run(vocab, vp.loss, state)
        partial = turns.run(vocab, vp.t_backward, state)
        for hold in holds:
            hold.release()
        if args.variant == "vocab-1":
            turns.comm(comm, vp.t_reduce, partial)
        grad = torch.randn(micro, model.seq_length, model.hidden_size) if first else None
        grad = turns.comm(comm, vp.e_grad, grad, ids.shape)
        turns.run(vocab, vp.e_backward, ids, grad)
        turns.lap()
    out["vocab_parallel"] = {
        "param_bytes": param_bytes([stage, vp]),
        "activation_per_mb": saved,
        "vocab_state_bytes": vocab_peak,
        "stage_busy_s": turns.fastest("stage"),
        "vocab_busy_s": turns.fastest("vocab"),
        "busy_s": turns.fastest("stage") + turns.fastest("vocab"),
        "comm_s": turns.fastest("comm"),
    }
    return out


def run_pp(size: int, args: argparse.Namespace) -> list[dict]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [context.Process(target=worker, args=(r, size, port, args, results)) for r in range(size)]
    for process in processes:
        process.start()
    collected = dict(results.get(timeout=1800) for _ in processes)
    for process in processes:
        process.join()
    return [collected[r] for r in range(size)]


def summarise(size: int, ranks: list[dict]) -> dict:
    """Per-rank busy time and peak memory (1F1B: rank r holds p - r microbatches), max over min."""
    rows = []
    for r, item in enumerate(ranks):
        base, vp = item["base"], item["vocab_parallel"]
        in_flight = size - r
        rows.append(
            {
                "rank": r,
                "base_busy_ms": 1e3 * base["busy_s"],
                "vp_busy_ms": 1e3 * vp["busy_s"],
                "vp_vocab_ms": 1e3 * vp["vocab_busy_s"],
                "vp_comm_ms": 1e3 * vp["comm_s"],
                "base_peak_mb": (4 * base["param_bytes"] + in_flight * base["activation_per_mb"]) / 2**20,
                "vp_peak_mb": (
                    4 * vp["param_bytes"] + in_flight * vp["activation_per_mb"] + vp["vocab_state_bytes"]
                )
                / 2**20,
                "base_param_mb": base["param_bytes"] / 2**20,
                "vp_param_mb": vp["param_bytes"] / 2**20,
                "base_activation_per_mb_mb": base["activation_per_mb"] / 2**20,
                "vp_activation_per_mb_mb": vp["activation_per_mb"] / 2**20,
                "vp_vocab_state_mb": vp["vocab_state_bytes"] / 2**20,
                "vp_stage_ms": 1e3 * vp["stage_busy_s"],
            }
        )

    def ratio(key: str) -> float:
        values = [row[key] for row in rows]
        return max(values) / min(values)

    return {
        "pp": size,
        "ranks": rows,
        "busy_max_over_min": {"base": ratio("base_busy_ms"), "vocab_parallel": ratio("vp_busy_ms")},
        "peak_max_over_min": {"base": ratio("base_peak_mb"), "vocab_parallel": ratio("vp_peak_mb")},
        "max_busy_ms": {
            "base": max(r["base_busy_ms"] for r in rows),
            "vocab_parallel": max(r["vp_busy_ms"] for r in rows),
        },
        "max_peak_mb": {
            "base": max(r["base_peak_mb"] for r in rows),
            "vocab_parallel": max(r["vp_peak_mb"] for r in rows),
        },
    }


def main() -> None:
    args = parse_args()
    report = {"args": vars(args), "runs": []}
    print(
        f"vocabulary {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.seq_length} x "
        f"{args.micro_batch_size} tokens per microbatch, {args.variant}, CPU, 1 thread per rank"
    )
    for size in args.pp:
        summary = summarise(size, run_pp(size, args))
        report["runs"].append(summary)
        print(f"\np={size}  rank  busy ms (base / VP: vocab part, comm)   peak MB (base / VP)   params MB")
        for row in summary["ranks"]:
            print(
                f"      {row['rank']:>4}  {row['base_busy_ms']:7.2f} / {row['vp_busy_ms']:7.2f}"
                f" ({row['vp_vocab_ms']:6.2f}, {row['vp_comm_ms']:5.2f})"
                f"   {row['base_peak_mb']:7.2f} / {row['vp_peak_mb']:7.2f}"
                f"   {row['base_param_mb']:5.2f} / {row['vp_param_mb']:5.2f}"
            )
        busy, peak = summary["busy_max_over_min"], summary["peak_max_over_min"]
        top_busy, top_peak = summary["max_busy_ms"], summary["max_peak_mb"]
        print(
            f"   max/min busy: {busy['base']:.2f} -> {busy['vocab_parallel']:.2f};"
            f" max/min peak: {peak['base']:.2f} -> {peak['vocab_parallel']:.2f};"
            f" max busy {top_busy['base']:.2f} -> {top_busy['vocab_parallel']:.2f} ms;"
            f" max peak {top_peak['base']:.2f} -> {top_peak['vocab_parallel']:.2f} MB"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
