#!/usr/bin/env python3
"""Optimizer post-validation on real processes: time per iteration with and without it.

Runs ``megatron-pp-ext train`` back to back, alternating the synchronous optimizer and
``--pp-post-validation`` (several rounds, so drift in the machine's speed hits both alike), and
reads each run's ``--metrics``: the steady-state time per iteration is the spread of the loss
rank's ``wall_time`` between iteration ``--skip`` and the last, over the iterations between. With a
large ``--clip-grad`` every global check passes (steady training); with a tiny one every check
fails, so every iteration restarts: the worst case, where post-validation costs the forwards run
before each gate twice.

    python scripts/bench_post_validation.py                          # zb-h2, v-zb, 1f1b at p=2
    python scripts/bench_post_validation.py --schedules zb-h2 --microbatches 4 --rounds 5

Each row also gives the simulator's ratio for the schedule at unit costs (``simulate
--iterations``), the ideal the measurement is compared with.

On a CPU machine keep p x OMP threads within the cores: a rank that idles in the bubble lends
its core to nobody, which is the bubble this measures. Prints a table; ``--json`` keeps it.

``--emulate F B W`` (milliseconds) measures the runtime's own waiting at larger p on few cores:
the real ``train`` (processes, p2p, optimizer, post-validation) on a tiny model, where each F,
B and W op also sleeps its given time (an autograd function around every stage output sleeps
F forward and B backward; W ops and the W half of a fused BW sleep W). Sleeping ranks leave the
cores to the others, so p may exceed the cores; what is measured is how the ranks wait for one
another, i.e. the schedule's bubbles, with the unit-cost shape the simulator assumes:

    python scripts/bench_post_validation.py --emulate 20 20 20 --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--schedules", nargs="+", default=["zb-h2", "v-zb", "1f1b"])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="iterations left out at the start (warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternated")
    parser.add_argument("--clip-grad", type=float, nargs="+", default=[100.0, 1e-6])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--json", help="write the table here")
    parser.add_argument(
        "--emulate", type=float, nargs=3, metavar=("F", "B", "W"), help="op times in ms (see above)"
    )
    return parser.parse_args()


def config(directory: Path, args: argparse.Namespace) -> Path:
    """tiny-llama made wider, so GEMMs dominate the step (B and W of similar cost, as on a GPU
    at long hidden sizes) and the per-op overheads matter less; emulated: tiny-llama itself."""
    data = yaml.safe_load((REPO / "configs/tiny-llama.yaml").read_text())
    data["training"].update(micro_batch_size=1, warmup=1)
    if args.emulate is not None:
        data["model"].update(num_layers=2 * args.pp, seq_length=32)
    else:
        data["model"].update(
            hidden_size=args.hidden,
            ffn_hidden_size=args.hidden * 11 // 4,
            num_attention_heads=8,
            num_kv_heads=4,
            num_layers=args.layers,
            seq_length=args.seq_length,
        )
    path = directory / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(config_path: Path, metrics: Path, schedule: str, m: int, clip: float, post: bool, args: Any) -> dict:
    entry = ["-m", "megatron_pp_ext"] if args.emulate is None else [__file__, "--emulated-worker"]
    command = [
        sys.executable, *entry, "train", "--config", str(config_path),
        "--pipeline-model-parallel-size", str(args.pp), "--pp-schedule", schedule,
        "--microbatches", str(m), "--train-iters", str(args.iterations), "--clip-grad", str(clip),
        "--metrics", str(metrics), *(["--pp-post-validation"] if post else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.emulate is not None:
        env[EMULATE] = ",".join(str(ms / 1e3) for ms in args.emulate)
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    first, last = rows[args.skip - 1], rows[-1]
    said = "partial state along "
    chain = [line[line.index(said) + len(said) :] for line in done.stdout.splitlines() if said in line]
    return {
        "period": (last["wall_time"] - first["wall_time"]) / (last["iteration"] - first["iteration"]),
        "restarted": sum(bool(row.get("restarted")) for row in rows),
        "losses": [row["loss"] for row in rows],
        "chain": chain[0].strip() if chain else None,
    }


def simulated_ratio(schedule: str, pp: int, m: int) -> float:
    """Synchronous over post-validation time per iteration, unit costs (``simulate --iterations``)."""
    from megatron_pp_ext.schedule.generators import generate
    from megatron_pp_ext.schedule.iterations import compare_optimizers

    runs = compare_optimizers(generate(schedule, pp, m), iterations=3)
    return runs["sync"].period / runs["post-validation"].period


def main() -> None:
    args = parse_args()
    table = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        config_path = config(directory, args)
        for schedule in args.schedules:
            for m in args.microbatches:
                for clip in args.clip_grad:
                    periods: dict[bool, list[float]] = {False: [], True: []}
                    restarted, chains = 0, []
                    for _ in range(args.rounds):
                        for post in (False, True):
                            result = run(config_path, directory / "m.jsonl", schedule, m, clip, post, args)
                            periods[post].append(result["period"])
                            if post:
                                restarted = max(restarted, result["restarted"])
                                chains.append(result["chain"])
                    sync, post_val = statistics.median(periods[False]), statistics.median(periods[True])
                    row = {
                        "schedule": schedule,
                        "pp": args.pp,
                        "microbatches": m,
                        "clip_grad": clip,
                        "sync_s": sync,
                        "post_s": post_val,
                        "speedup": sync / post_val,
                        "simulated_speedup": simulated_ratio(schedule, args.pp, m),
                        "restarted_iterations": restarted,
                        "chains": chains,
                        "rounds": args.rounds,
                        "sync_runs": periods[False],
                        "post_runs": periods[True],
                    }
                    table.append(row)
                    print(
                        f"{schedule:8s} p={args.pp} m={m:<3d} clip={clip:<8g} sync {sync * 1e3:7.1f} ms  "
                        f"post-validation {post_val * 1e3:7.1f} ms  sync/post {sync / post_val:5.3f} "
                        f"(unit costs {row['simulated_speedup']:5.3f})  "
                        f"restarted {restarted}/{args.iterations}  chain {chains[0]}",
                        flush=True,
                    )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


# ---- emulated op times ------------------------------------------------------------------------

EMULATE = "BENCH_POST_VALIDATION_EMULATE"  # "F,B,W" in seconds, for the emulated train's workers


def emulated_train(argv: list[str]) -> None:
    """``megatron-pp-ext train ARGV`` whose every F, B and W also sleeps (module docstring)."""
    from megatron_pp_ext import launch
    from megatron_pp_ext.commands import train

    settings = train.settings_from_argv(argv, None)
    launch.run(emulated_worker, settings.tp * settings.cp * settings.pp * settings.dp, settings)


def emulated_worker(rank: int, world_size: int, local_rank: int, settings: Any) -> None:
    import time

    import torch
    import torch.distributed as dist

    from megatron_pp_ext import launch
    from megatron_pp_ext.megatron.steps import forward_step
    from megatron_pp_ext.runtime import stage
    from megatron_pp_ext.training.worker import train_loop

    forward_s, backward_s, weight_s = (float(x) for x in os.environ[EMULATE].split(","))

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
            time.sleep(forward_s)
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(backward_s)
            return grad

    def sleeping_forward_step(data_iterator: Any, model: Any) -> Any:
        output, loss_func = forward_step(data_iterator, model)
        return Sleep.apply(output), loss_func

    backward, weight = stage.StageRunner.backward, stage.StageRunner.weight

    def sleeping_backward(self: Any, key: Any, output_grad: Any, split: bool) -> Any:
        if not split:
            time.sleep(weight_s)  # a fused BW: the W half
        return backward(self, key, output_grad, split)

    def sleeping_weight(self: Any, key: Any) -> None:
        time.sleep(weight_s)
        weight(self, key)

    stage.StageRunner.backward, stage.StageRunner.weight = sleeping_backward, sleeping_weight
    device = launch.init_distributed(rank, world_size, local_rank, settings.timeout)
    train_loop(rank, settings, device, sleeping_forward_step)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--emulated-worker"]:
        emulated_train(sys.argv[3:])  # after "--emulated-worker train"
    else:
        main()
