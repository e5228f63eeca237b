"""The bench on one rank: every row's jobs, iterations interleaved, results gathered on rank 0.

Within a row, our schedule and torch's take turns iteration by iteration (the order flips every
iteration), so load from other processes on a shared machine hits both alike. An iteration's
time is the slowest rank's, from a barrier to the end of its step; zeroing gradients and the
bookkeeping collectives are outside it. Every step's outcome is gathered on all ranks, so a rank
that fails (or times out waiting for a failed peer) drops the job on every rank together.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..megatron.model import ModelConfig
from .job import BenchSettings, Row

CHECK_RTOL = {"loss": 1e-5, "grad_norm": 1e-4}


@dataclass
class Outcome:
    """One rank's view of one step."""

    seconds: float = 0.0
    loss: float | None = None
    peak: int = 0
    grad_sq: float = 0.0
    allocated: int | None = None  # allocator peak (GPU only)
    error: str | None = None


@dataclass
class Context:
    """What every row of one rank shares: the model, its reference weights, the data, channels."""

    settings: BenchSettings
    rank: int
    device: torch.device
    model: ModelConfig
    reference: torch.nn.Module
    batches: list[dict[str, torch.Tensor]]
    comm: Any = None  # our runtime's channels
    group: Any = None  # torch's schedules' process group

    def open_channels(self) -> None:
        """Fresh p2p channels for both runtimes (collective): a gloo pair that timed out stays
        closed, so after a failure neither the old PipeComm nor the old group can be reused."""
        from ..runtime import PipeComm

        if self.comm is not None:
            self.comm.close()
        timeout = datetime.timedelta(seconds=self.settings.timeout)
        # None: the environment variable decides (as in the tests), else the flag
        emulate = self.settings.emulate_nccl or None
        self.comm = PipeComm(timeout_s=self.settings.timeout, emulate_nccl=emulate)
        self.group = dist.new_group(timeout=timeout)


def worker(rank: int, world_size: int, local_rank: int, settings: BenchSettings) -> None:
    from tqdm import tqdm

    from .. import launch
    from ..megatron.model import build_reference, init_parallel_state, seed_like_megatron

    # The bookkeeping collectives wait longer than any transfer, so a rank whose peer failed
    # times out in the pipeline first and still meets the others at the next gather.
    device = launch.init_distributed(rank, world_size, local_rank, 2 * settings.timeout + 60)
    if device.type == "cpu":
        torch.set_num_threads(1)
    init_parallel_state(world_size)
    model = ModelConfig(**settings.model)
    seed_like_megatron(settings.seed)  # as train: Megatron-LM's stage seeds, the CUDA RNG tracker
    torch.manual_seed(settings.seed)  # one model on every rank
    context = Context(
        settings,
        rank,
        device,
        model,
        build_reference(model),
        make_batches(model, settings),
    )
    context.open_channels()
    rows = []
    progress = tqdm(settings.rows, desc="bench", unit="run", disable=rank != 0, file=sys.stderr)
    for row in progress:
        progress.set_postfix_str(row.name)
        result = run_row(row, context)
        if result.pop("failed", False):
            context.open_channels()
        rows.append(result)
        if rank == 0 and result.get("check"):
            progress.write(check_line(result), file=sys.stderr if settings.quiet else sys.stdout)
    progress.close()
    if rank == 0:
        with open(settings.output, "w") as handle:
            json.dump(summary(settings, device, rows), handle)
    context.comm.close()
    dist.barrier()
    dist.destroy_process_group()


def make_batches(model: ModelConfig, settings: BenchSettings) -> list[dict[str, torch.Tensor]]:
    """The iteration's microbatches, the same on every rank and for every run."""
    from .. import data

    tokens = data.encode(data.stdlib_corpus())
    stream = data.batches(tokens, model.seq_length, settings.micro_batch_size, settings.seed)
    return [next(stream) for _ in range(settings.microbatches)]


def build_jobs(row: Row, context: Context) -> tuple[dict[str, Any], dict[str, str]]:
    """Our job and torch's for ``row``; a job that fails to build on any rank is dropped on all."""
    from .our_job import OurJob
    from .torch_job import TorchJob

    s = context.settings
    builders = {}
    if row.ours is not None:
        builders["ours"] = lambda: OurJob(
            row.ours,
            context.model,
            context.reference,
            context.batches,
            context.comm,
            context.rank,
            s.micro_batch_size,
        )
    if row.torch is not None:
        builders["torch"] = lambda: TorchJob(
            row.torch,
            context.model,
            context.reference,
            context.batches,
            s.pp,
            context.rank,
            s.micro_batch_size,
            context.device,
            context.group,
        )
    jobs, skipped = {}, {}
    for name, build in builders.items():
        job, error = None, None
        try:
            job = build()
        except Exception as caught:  # torch's own constraints, e.g. DualPipeV's microbatch count
            error = f"{type(caught).__name__}: {caught}"
        errors = [e for e in gather(error) if e]
        if errors:
            skipped[name] = errors[0]
        else:
            jobs[name] = job
    return jobs, skipped


def run_row(row: Row, context: Context) -> dict[str, Any]:
    """Warm-up, timed and one final memory iteration of each job, the jobs taking turns."""
    s = context.settings
    jobs, skipped = build_jobs(row, context)
    result: dict[str, Any] = {
        "schedule": row.name,
        "ours_skip": skipped.get("ours", row.ours_skip),
        "torch_class": row.torch.cls if row.torch else None,
        "torch_skip": skipped.get("torch", row.torch_skip),
        "notes": list(row.notes),
    }
    times: dict[str, list[float]] = {name: [] for name in jobs}
    first: dict[str, dict[str, float | None]] = {}
    last: dict[str, list[Outcome]] = {}
    names = list(jobs)
    timed = range(s.warmup, s.warmup + s.iterations)
    final = s.warmup + s.iterations
    for iteration in range(final + 1):
        for name in names if iteration % 2 == 0 else names[::-1]:
            if name not in jobs:
                continue
            step = timed_step(jobs[name], context.device, first=iteration == 0, measure=iteration == final)
            outcomes = gather(step)
            errors = [o.error for o in outcomes if o.error]
            if errors:
                result[f"{name}_skip"] = f"failed: {errors[0]}"
                result["failed"] = True
                del jobs[name]
                continue
            if iteration == 0:
                losses = [o.loss for o in outcomes if o.loss is not None]
                first[name] = {
                    "loss": losses[0] if losses else None,
                    "grad_norm": math.sqrt(sum(o.grad_sq for o in outcomes)),
                }
            if iteration in timed:
                times[name].append(max(o.seconds for o in outcomes))
            last[name] = outcomes
    for name in jobs:
        result[name] = {
            "median_s": statistics.median(times[name]),
            "times_s": times[name],
            "peak_activation_bytes": [o.peak for o in last[name]],
            "peak_allocated_bytes": [o.allocated for o in last[name]],
            "first_loss": first[name]["loss"],
            "first_grad_norm": first[name]["grad_norm"],
        }
    if "torch" in jobs:
        result["torch"]["recv_buffer_bytes"] = gather(jobs["torch"].live.buffer_bytes)
    if "ours" in jobs and "torch" in jobs:
        ratios = [a / b for a, b in zip(times["ours"], times["torch"])]
        result["ratio"] = statistics.median(ratios)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else None
        result["ratio_iqr"] = [quartiles[0], quartiles[2]] if quartiles else None
        result["check"] = compare(first["ours"], first["torch"])
    return result


def timed_step(job: Any, device: torch.device, first: bool, measure: bool) -> Outcome:
    """One step of ``job`` from a barrier; errors are caught so every rank reaches the gather.
    ``measure`` turns on torch's activation meter (ours always counts)."""
    try:
        job.zero_grad()
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        start = time.perf_counter()
        loss, peak = job.step(measure=measure)
        synchronize(device)
        seconds = time.perf_counter() - start
        allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        grad_sq = job.grad_square_sum() if first else 0.0
        return Outcome(seconds, loss, peak, grad_sq, allocated)
    except Exception as error:
        return Outcome(error=f"{type(error).__name__}: {error}"[:500])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def compare(ours: dict[str, float | None], theirs: dict[str, float | None]) -> dict[str, Any]:
    """First-iteration loss and gradient norm, ours against torch's: same model, same data."""
    check: dict[str, Any] = {"ours": ours, "torch": theirs, "match": True}
    for key, rtol in CHECK_RTOL.items():
        a, b = ours[key], theirs[key]
        diff = abs(a - b) / max(abs(b), 1e-30) if a is not None and b is not None else math.inf
        check[f"{key}_rel_diff"] = diff
        check["match"] = check["match"] and diff <= rtol
    return check


def check_line(result: dict[str, Any]) -> str:
    c = result["check"]
    return (
        f"check {result['schedule']} vs {result['torch_class']}: first-iteration loss "
        f"{c['ours']['loss']:.6f} / {c['torch']['loss']:.6f} (rel diff {c['loss_rel_diff']:.1e}), "
        f"grad norm {c['ours']['grad_norm']:.6f} / {c['torch']['grad_norm']:.6f} "
        f"(rel diff {c['grad_norm_rel_diff']:.1e}): {'match' if c['match'] else 'MISMATCH'}"
    )


def summary(settings: BenchSettings, device: torch.device, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "pp": settings.pp,
        "microbatches": settings.microbatches,
        "iterations": settings.iterations,
        "warmup": settings.warmup,
        "model_size": settings.model_size,
        "model": settings.model,
        "micro_batch_size": settings.micro_batch_size,
        "device": device.type,
        "backend": dist.get_backend(),
        "emulate_nccl": settings.emulate_nccl,
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }
