"""``megatron-pp-ext train``: the main job.

A Megatron-style training loop on megatron-core's GPTModel, cut into pipeline stages, with the
schedule chosen by ``--pp-schedule``. It calls megatron-core's ``get_forward_backward_func()``
exactly as Megatron-LM's training loop does; our hook (``megatron_pp_ext.megatron.install``)
makes that return the chosen schedule. Bad input fails in the launching process, before any
worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..megatron.hook import OptionError, PipelineOptions, add_args
from .errors import UsageError

# The generator's flag names as this command spells them.
TRAIN_FLAGS = {
    "--schedule": "--pp-schedule",
    "--vpp": "--pp-chunks",
    "--slices": "--pp-seq-slices",
    "--microbatches": "--microbatches",
    "--pp": "--pp",
    "--memory-limit": "--pp-memory-limit",
}

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = "tiny-llama"


@dataclass
class TrainSettings:
    """Everything a worker needs; plain data so it pickles into spawned processes."""

    model: dict[str, Any]
    pp: int = 4
    microbatches: int = 8
    micro_batch_size: int = 4
    iterations: int = 40
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 4
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 5
    data: str | None = None
    metrics: str | None = None
    timeout: float = 300.0
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a megatron-core GPT with a pipeline schedule (the main job)",
        description="Train a megatron-core GPT over pipeline ranks with the schedule of --pp-schedule.",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"YAML file or a name in configs/ (default {DEFAULT_CONFIG})"
    )
    parser.add_argument("--pp", type=int, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, help="microbatches per iteration")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per microbatch")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence")
    parser.add_argument("--num-layers", type=int, help="transformer layers")
    parser.add_argument("--iterations", type=int, help="optimizer steps")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--seed", type=int, help="random seed (weights and data)")
    parser.add_argument("--data", help="a text file to train on (default: Python stdlib docstrings)")
    parser.add_argument("--metrics", help="write per-iteration metrics here as JSON lines")
    add_args(parser)
    parser.set_defaults(run=run, pp_schedule=None, pp_seq_slices=None)  # None: the config's


def load_settings(args: argparse.Namespace) -> TrainSettings:
    path = Path(args.config)
    if not path.suffix:
        path = CONFIG_DIR / f"{args.config}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise UsageError("--config", f"no config {args.config!r} (file or one of: {known})")
    raw = yaml.safe_load(path.read_text()) or {}
    training = dict(raw.get("training", {}))
    model = dict(raw.get("model", {}))
    pipeline = dict(raw.get("pipeline", {}))
    overrides = {
        "pp": args.pp,
        "microbatches": args.microbatches,
        "micro_batch_size": args.micro_batch_size,
        "iterations": args.iterations,
        "lr": args.lr,
        "seed": args.seed,
    }
    training.update({key: value for key, value in overrides.items() if value is not None})
    if args.seq_length is not None:
        model["seq_length"] = args.seq_length
    if args.num_layers is not None:
        model["num_layers"] = args.num_layers
    options = PipelineOptions.from_args(args)
    options = dataclasses.replace(
        options,
        schedule=args.pp_schedule or pipeline.get("schedule", "1f1b"),
        chunks=args.pp_chunks if args.pp_chunks is not None else pipeline.get("chunks"),
        slices=args.pp_seq_slices if args.pp_seq_slices is not None else pipeline.get("slices", 1),
        slice_partition=args.pp_slice_partition or pipeline.get("slice_partition"),
    )
    unknown = set(training) - {f.name for f in dataclasses.fields(TrainSettings)}
    if unknown:
        raise UsageError("--config", f"{path}: unknown training keys {sorted(unknown)}")
    return TrainSettings(
        model=model,
        data=args.data,
        metrics=args.metrics,
        pipeline=options,
        timeout=options.p2p_timeout,
        **training,
    )


def check(settings: TrainSettings) -> None:
    """Every check that can fail before processes start, each naming its flag."""
    from ..megatron.model import ModelConfig, split_layers

    if settings.pp < 1:
        raise UsageError("--pp", f"needs at least 1 pipeline rank, got {settings.pp}")
    try:
        model = ModelConfig(**settings.model)
    except (TypeError, ValueError) as error:
        raise UsageError("--config", f"model section: {error}") from None
    try:
        schedule = settings.pipeline.schedule_for(settings.pp, settings.microbatches, TRAIN_FLAGS)
    except OptionError as error:
        raise UsageError(error.flag, error.reason) from None
    try:
        split_layers(model.num_layers, schedule.num_stages)
    except ValueError as error:
        raise UsageError(
            "--num-layers",
            f"{error} ({settings.pipeline.schedule} on --pp {settings.pp} has {schedule.num_stages} "
            f"virtual stages; use a --num-layers of at least {schedule.num_stages})",
        ) from None
    if schedule.slices > 1:
        try:
            settings.pipeline.slice_lengths(schedule, model.seq_length, model.shape(), TRAIN_FLAGS)
        except OptionError as error:
            raise UsageError(error.flag, error.reason) from None


def run(args: argparse.Namespace) -> int:
    from .. import launch

    settings = load_settings(args)
    check(settings)
    world = launch.launcher_world()
    if world is not None and world[1] != settings.pp:
        raise UsageError("--pp", f"the launcher started {world[1]} processes for --pp {settings.pp}")
    launch.run(worker, settings.pp, settings)
    return 0


# ---- the worker: one pipeline rank ------------------------------------------------------------


def worker(rank: int, world_size: int, local_rank: int, settings: TrainSettings) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import pipeline_parallel

    from .. import data, launch
    from ..megatron import install
    from ..megatron.model import ModelConfig, build_chunks_from, build_reference, init_parallel_state

    device = launch.init_distributed(rank, world_size, local_rank, settings.timeout)
    init_parallel_state(settings.pp)
    hook = install(options=settings.pipeline)
    schedule = hook.schedule(settings.pp, settings.microbatches)
    model = ModelConfig(**settings.model)

    # Same weights whatever the schedule: every stage copies its layers from one seeded model.
    torch.manual_seed(settings.seed)
    reference = build_reference(model)
    chunks, _ = build_chunks_from(reference, model, schedule.placement, rank, sliced=schedule.slices > 1)
    del reference
    optimizer, schedule_lr = build_optimizer(chunks, settings)

    tokens = data.encode(data.load_text(settings.data))
    train_tokens, _ = data.split_train_valid(tokens)
    # One iterator per chunk, same seed: the chunk holding the embedding reads tokens, the one
    # holding the loss reads labels, of the same microbatches.
    iterators = [
        data.batches(train_tokens, model.seq_length, settings.micro_batch_size, settings.seed) for _ in chunks
    ]

    is_loss_rank = schedule.loss_rank == rank
    progress = _progress(settings.iterations, show=is_loss_rank)
    metrics_file = open(settings.metrics, "w") if settings.metrics and is_loss_rank else None
    step_times: list[float] = []
    bubbles: list[float] = []
    peak_activation = 0
    offloaded: int | None = None
    attention: tuple[int, int, int] | None = None  # own, served, handed away: last step
    for iteration in range(1, settings.iterations + 1):
        for group in optimizer.param_groups:
            group["lr"] = schedule_lr(iteration)
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        forward_backward_func = pipeline_parallel.get_forward_backward_func()
        losses = forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks,
            num_microbatches=settings.microbatches,
            seq_length=model.seq_length,
            micro_batch_size=settings.micro_batch_size,
            forward_only=False,
        )
        grad_norm = clip_grad_norm(chunks, settings.clip_grad)
        optimizer.step()
        elapsed = time.perf_counter() - start
        result = hook.last_result
        step_times.append(elapsed)
        bubbles.append(min(1.0, hook.last_wait_seconds / elapsed))
        peak_activation = max(peak_activation, result.peak_activation_bytes)
        offloaded = result.offload.offloaded_bytes if result.offload is not None else None
        if result.attention is not None:
            attention = result.attention.totals()
        if is_loss_rank:
            total, tokens = (sum(item["lm loss"][i] for item in losses) for i in (0, 1))
            loss = float(total / tokens)
            progress.set_postfix(loss=f"{loss:.3f}", step=f"{elapsed:.2f}s", gnorm=f"{grad_norm:.2f}")
            progress.update(1)
            if metrics_file:
                metrics_file.write(
                    json.dumps(
                        {"iteration": iteration, "loss": loss, "step_time": elapsed, "grad_norm": grad_norm}
                    )
                    + "\n"
                )
                metrics_file.flush()
    progress.close()
    if metrics_file:
        metrics_file.close()
    _report(rank, settings, schedule, step_times, bubbles, peak_activation, offloaded, device, attention)
    hook.uninstall()
    dist.destroy_process_group()


def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """Megatron's forward_step_func contract, as in Megatron-LM's pretrain_gpt.py."""
    import functools

    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def loss_func(loss_mask: Any, output: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Next-token cross-entropy summed over the unmasked tokens, their count, and a report of
    both, as Megatron-LM's pretrain_gpt: the schedule divides by the count, over the whole
    microbatch even when a sliced schedule runs it slice by slice."""
    import torch

    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.to(loss.dtype)])}


def build_optimizer(chunks: list[Any], settings: TrainSettings) -> tuple[Any, Any]:
    """AdamW over this rank's chunks with linear warm-up and cosine decay.

    megatron-core's DistributedDataParallel and optimizer allocate on ``torch.cuda`` in their
    constructors (``_ParamAndGradBuffer``, ``FP32Optimizer``), so they cannot run on CPU; the
    gradients our runtime produces are the same either way (``.grad``)."""
    import torch

    params = [param for chunk in chunks for param in chunk.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95)
    )

    def learning_rate(iteration: int) -> float:
        if iteration <= settings.warmup:
            return settings.lr * iteration / max(1, settings.warmup)
        progress = (iteration - settings.warmup) / max(1, settings.iterations - settings.warmup)
        return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * progress))

    return optimizer, learning_rate


def clip_grad_norm(chunks: list[Any], max_norm: float) -> float:
    """Clip by the gradient norm of the whole model: squares are summed over the pipeline."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    grads = [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        total += grad.double().pow(2).sum()
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        for grad in grads:
            grad.mul_(max_norm / (norm + 1e-6))
    return norm


def _progress(total: int, show: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="it", disable=not show, file=sys.stdout, dynamic_ncols=True)


def _report(
    rank: int,
    settings: TrainSettings,
    schedule: Any,
    step_times: list[float],
    bubbles: list[float],
    peak_activation: int,
    offloaded: int | None,
    device: Any,
    attention: tuple[int, int, int] | None = None,
) -> None:
    import torch
    import torch.distributed as dist

    steady = step_times[1:] or step_times
    row = {
        "rank": rank,
        "step_time": sum(steady) / len(steady),
        "bubble": (sum(bubbles[1:] or bubbles) / len(bubbles[1:] or bubbles)) if bubbles else None,
        "peak_activation_mib": peak_activation / 2**20,
        "offloaded_mib": None if offloaded is None else offloaded / 2**20,
        "attention": attention,
        "max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    }
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(
            f"\n{schedule.name}: pp={settings.pp} m={settings.microbatches} v={schedule.vpp} "
            f"k={schedule.slices}, steady-state per rank:"
        )
        for item in rows:
            bubble = "n/a" if item["bubble"] is None else f"{item['bubble']:.3f}"
            gpu = (
                ""
                if item["max_allocated_mib"] is None
                else f"  cuda max allocated {item['max_allocated_mib']:.1f} MiB"
            )
            moved = ""
            if item["offloaded_mib"] is not None:
                moved = f"  offloaded {item['offloaded_mib']:.2f} MiB/step"
            if item["attention"] is not None and settings.pipeline.attn_redistribution:
                own, served, away = (n / 1e6 for n in item["attention"])
                moved += f"  attention Mpairs computed {own + served:.1f} (served {served:.1f})"
                moved += f", handed away {away:.1f}"
            print(
                f"  rank {item['rank']}: step {item['step_time']:.3f} s  bubble {bubble}  "
                f"peak activation {item['peak_activation_mib']:.2f} MiB{moved}{gpu}"
            )
        sys.stdout.flush()
