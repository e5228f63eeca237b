"""The bench on one rank: every row's jobs, iterations interleaved, results gathered on rank 0.

Within a row, our schedule and the baseline's (torch's or Megatron's) take turns iteration by
iteration, in paired rounds A B, B A, A B, ... (the order flips every round), so load from other
processes on a shared machine hits both alike; each round gives one ratio ours/baseline. An
iteration's time is the slowest rank's, from a barrier to the end of its step; zeroing gradients
and the bookkeeping collectives are outside it. On CPU each rank is pinned to a core of its own
where the machine has one per rank. Every step's outcome is gathered on all ranks, so a rank that fails
(or times out waiting for a failed peer) drops the job on every rank together.

Against Megatron, the rows after its two schedules' counterparts are timed against the faster of
Megatron's two (by median step time in this run), and every row's first-step loss and gradient
norm are checked against Megatron's: every schedule computes the same step.

With expert parallelism (``settings.ep`` E > 1, a mixture-of-experts model) the world is p x E
processes in Megatron's parallel state: E data-parallel pipelines (each its own PipeComm), each
replica on its own share of the batch, the experts of a stage split over its E ranks. All
replicas are timed together: an iteration is still the slowest rank's. The first-step loss is
the mean of the replicas' and the gradient norm is over every rank's gradients as they are
before any data-parallel reduction (the bench runs no optimizer), the same for every job.

With overlapped pairs (``settings.overlap``) a row also times our schedule paired
(``ours_paired``) in the same rounds, against Megatron's combined 1F1B where the row runs it
(``megatron_combined``, itself checked against Megatron's plain schedule of the row), else
against the row's Megatron schedule; ``paired_over_unpaired`` is the per-round ratio of ours
paired to ours unpaired, and each rank's ``pairs`` the overlapped pairs its last step ran.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..launch import gather_objects
from ..megatron.model import ModelConfig
from .job import MEGATRON_PAIRS, BenchSettings, MegatronPair, Row, fine_grained

MEGATRON_PAIRS_BY_FUNCTION = {pair.function: pair for pair in MEGATRON_PAIRS.values()}

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
    pairs: int | None = None  # overlapped pairs the step ran (our jobs only)


@dataclass
class Context:
    """What every row of one rank shares: the model, its reference weights, the data, channels."""

    settings: BenchSettings
    rank: int
    device: torch.device
    model: ModelConfig
    reference: torch.nn.Module
    batches: list[dict[str, torch.Tensor]]
    pipeline: list[int] | None = None  # this rank's pipeline, global ranks (None: the world)
    comm: Any = None  # our runtime's channels
    group: Any = None  # torch's schedules' process group
    megatron_medians: dict[str, float] | None = None  # Megatron's schedules' median step times

    def open_channels(self) -> None:
        """Fresh p2p channels for both runtimes (collective): a gloo pair that timed out stays
        closed, so after a failure neither the old PipeComm nor the old group can be reused."""
        from ..runtime import PipeComm

        if self.comm is not None:
            self.comm.close()
        timeout = datetime.timedelta(seconds=self.settings.timeout)
        # None: the environment variable decides (as in the tests), else the flag
        emulate = self.settings.emulate_nccl or None
        self.comm = PipeComm(self.pipeline, timeout_s=self.settings.timeout, emulate_nccl=emulate)
        self.group = dist.new_group(timeout=timeout)


def worker(rank: int, world_size: int, local_rank: int, settings: BenchSettings) -> None:
    from megatron.core import parallel_state
    from tqdm import tqdm

    from .. import launch
    from ..megatron import cpu_shim
    from ..megatron.model import build_reference, init_parallel_state, seed_like_megatron

    # The bookkeeping collectives wait longer than any transfer, so a rank whose peer failed
    # times out in the pipeline first and still meets the others at the next gather.
    device = launch.init_distributed(
        rank, world_size, local_rank, 2 * settings.timeout + 60, settings.distributed_backend
    )
    pinned = False
    if device.type == "cpu":  # ranks compute on the cores: one thread and one core each
        torch.set_num_threads(1)
        pinned = pin_to_core(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    init_parallel_state(settings.pp, ep_size=settings.ep)
    cpu_shim.install()  # no-op with CUDA; on CPU before any MoE layer is built (its dispatcher)
    model = ModelConfig(**settings.model)
    seed_like_megatron(settings.seed)  # as train: Megatron-LM's stage seeds, the CUDA RNG tracker
    torch.manual_seed(settings.seed)  # one model on every rank
    context = Context(
        settings,
        rank,
        device,
        model,
        build_reference(model),
        make_batches(model, settings, parallel_state.get_data_parallel_rank()),
        pipeline=dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
    )
    context.open_channels()
    rows = []
    progress = tqdm(settings.rows, desc="bench", unit="run", disable=rank != 0, file=sys.stderr)
    for row in progress:
        progress.set_postfix_str(row.name if row.offload == "none" else f"{row.name} offload={row.offload}")
        result = run_row(row, context)
        if result.pop("failed", False):
            context.open_channels()
        rows.append(result)
        if rank == 0:
            for line in check_lines(result):
                progress.write(line, file=sys.stderr if settings.quiet else sys.stdout)
    progress.close()
    pinned = all(gather_objects(pinned))
    if rank == 0:
        with open(settings.output, "w") as handle:
            json.dump(summary(settings, device, rows, pinned), handle)
    context.comm.close()
    dist.barrier()
    dist.destroy_process_group()


def pin_to_core(local_rank: int, local_ranks: int) -> bool:
    """Pin this process to a core of its own when every local rank can have one (Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_ranks:
        return False
    os.sched_setaffinity(0, {cores[local_rank]})
    return True


def make_batches(
    model: ModelConfig, settings: BenchSettings, data_rank: int = 0
) -> list[dict[str, torch.Tensor]]:
    """The iteration's microbatches of data-parallel replica ``data_rank`` (its share of one
    stream), the same on every rank of its pipeline and for every run."""
    from .. import data

    tokens = data.encode(data.stdlib_corpus())
    stream = data.batches(tokens, model.seq_length, settings.micro_batch_size, settings.seed)
    for _ in range(data_rank * settings.microbatches):
        next(stream)
    return [next(stream) for _ in range(settings.microbatches)]


def megatron_pair(row: Row, context: Context) -> tuple[MegatronPair | None, str | None]:
    """Megatron's schedule for ``row``: its counterpart, else the faster of the two that ran
    (without offload); with fine-grained activation offloading where ``row`` offloads and the
    bench was asked for Megatron's (``--offload-modules``)."""
    if row.megatron is not None or row.name in MEGATRON_PAIRS:
        pair, skip = row.megatron, row.megatron_skip
    elif not context.megatron_medians:
        return None, "none of Megatron's own schedules ran"
    else:
        best = min(context.megatron_medians, key=context.megatron_medians.__getitem__)
        pair, skip = MEGATRON_PAIRS[best], None
    s = context.settings
    if pair is not None and row.offload != "none" and s.offload_modules:
        pair = fine_grained(pair, s.offload_modules, s.min_offloaded_tensor_size)
    return pair, skip


def build_jobs(
    row: Row, context: Context, pair: MegatronPair | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """Our job and the baseline's for ``row`` (``pair``: Megatron's schedule, against Megatron); a
    job that fails to build on any rank is dropped on all."""
    from .megatron_job import MegatronJob
    from .our_job import OurJob
    from .torch_job import TorchJob

    s = context.settings
    builders = {}
    ours = (("ours", row.ours), ("ours_paired", row.paired), ("ours_plain", row.plain))
    for name, schedule in ours:
        if schedule is not None and (name == "ours" or row.ours is not None):
            builders[name] = functools.partial(
                OurJob,
                schedule,
                context.model,
                context.reference,
                context.batches,
                context.comm,
                s.micro_batch_size,
                auto_offload=name == "ours" and row.offload == "auto",
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
    plain_pair = MEGATRON_PAIRS_BY_FUNCTION.get(pair.function) if pair and pair.offload_modules else None
    combined = row.megatron_combined if pair is not None else None
    megatrons = (("megatron", pair), ("megatron_combined", combined), ("megatron_plain", plain_pair))
    for name, megatron in megatrons:
        if megatron is not None:
            builders[name] = functools.partial(
                MegatronJob,
                megatron,
                context.model,
                context.reference,
                context.batches,
                s.pp,
                s.micro_batch_size,
            )
    jobs, skipped = {}, {}
    for name, build in builders.items():
        job, error = None, None
        try:
            job = build()
        except Exception as caught:  # torch's own constraints, e.g. DualPipeV's microbatch count
            error = f"{type(caught).__name__}: {caught}"
        errors = [e for e in gather_objects(error) if e]
        if errors:
            skipped[name] = errors[0]
        else:
            jobs[name] = job
    return jobs, skipped


def run_row(row: Row, context: Context) -> dict[str, Any]:
    """Warm-up, timed and one final memory iteration of each job, the jobs taking turns."""
    s = context.settings
    pair, pair_skip = megatron_pair(row, context) if s.against == "megatron" else (None, None)
    jobs, skipped = build_jobs(row, context, pair)
    result: dict[str, Any] = {
        "schedule": row.name,
        "offload": row.offload,
        "ours_skip": skipped.get("ours", row.ours_skip),
        "notes": list(row.notes),
    }
    for name in ("ours_plain", "megatron_plain"):  # an offload row's references
        if name in skipped:
            result[f"{name}_skip"] = skipped[name]
    if s.overlap and row.offload == "none":
        result["ours_paired_skip"] = skipped.get("ours_paired", row.paired_skip or result["ours_skip"])
        if row.megatron_combined is not None:
            result["megatron_combined_schedule"] = row.megatron_combined.label
            result["megatron_combined_skip"] = skipped.get("megatron_combined")
    baseline = s.against
    if baseline == "megatron":
        result["megatron_schedule"] = pair.label if pair else None
        result["megatron_function"] = pair.function if pair else None
        result["megatron_skip"] = skipped.get("megatron", pair_skip)
        result["megatron_offload_modules"] = list(pair.offload_modules) if pair else []
        if pair is not None and row.name not in MEGATRON_PAIRS:
            result["notes"].insert(0, f"against Megatron's faster schedule here, {pair.label}")
    else:
        result["torch_class"] = row.torch.cls if row.torch else None
        result["torch_skip"] = skipped.get("torch", row.torch_skip)
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
            outcomes = gather_objects(step)
            errors = [o.error for o in outcomes if o.error]
            if errors:
                result[f"{name}_skip"] = f"failed: {errors[0]}"
                result["failed"] = True
                del jobs[name]
                continue
            if iteration == 0:
                losses = [o.loss for o in outcomes if o.loss is not None]  # one per pipeline
                first[name] = {
                    "loss": statistics.fmean(losses) if losses else None,
                    "grad_norm": math.sqrt(sum(o.grad_sq for o in outcomes)),
                }
            if iteration in timed:
                times[name].append(max(o.seconds for o in outcomes))
            last[name] = outcomes
    for name in jobs:
        result[name] = {
            "calls_per_step": count_calls(jobs[name], context) if s.count_calls else None,
            "median_s": statistics.median(times[name]),
            "times_s": times[name],
            "peak_activation_bytes": [o.peak for o in last[name]],
            "peak_allocated_bytes": [o.allocated for o in last[name]],
            "first_loss": first[name]["loss"],
            "first_grad_norm": first[name]["grad_norm"],
        }
        if name.startswith("ours"):
            result[name]["pairs"] = [o.pairs for o in last[name]]
    if "torch" in jobs:
        result["torch"]["recv_buffer_bytes"] = gather_objects(jobs["torch"].live.buffer_bytes)
    if baseline == "megatron" and row.name in MEGATRON_PAIRS and row.offload == "none" and "megatron" in jobs:
        context.megatron_medians = context.megatron_medians or {}
        context.megatron_medians[row.name] = result["megatron"]["median_s"]
    for name in ("ours", "megatron"):  # an offload row's cost, round by round
        if name in jobs and f"{name}_plain" in jobs:
            result[name]["offload_overhead"] = spread(ratios_of(times[name], times[f"{name}_plain"]))
            same = compare(first[name], first[f"{name}_plain"], "plain")
            result[name]["same_step_as_plain"] = same["match"]
    if "ours" in jobs and baseline in jobs:
        ratios = ratios_of(times["ours"], times[baseline])
        result["ratio"] = statistics.median(ratios)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else None
        result["ratio_iqr"] = [quartiles[0], quartiles[2]] if quartiles else None
        result[f"ours_over_{baseline}"] = spread(ratios)
        result["check"] = compare(first["ours"], first[baseline], baseline)
    add_paired(result, baseline, jobs, times, first)
    return result


def add_paired(
    result: dict[str, Any],
    baseline: str,
    jobs: dict[str, Any],
    times: dict[str, list[float]],
    first: dict[str, dict[str, float | None]],
) -> None:
    """Ours paired against Megatron's combined 1F1B where it ran, else the row's baseline, and
    against ours unpaired, round by round; Megatron's combined 1F1B against its plain schedule."""
    if "megatron_combined" in jobs and baseline in jobs:
        result["megatron_combined_over_megatron"] = spread(
            ratios_of(times["megatron_combined"], times[baseline])
        )
        result["megatron_combined_check"] = compare(first["megatron_combined"], first[baseline], baseline)
    if "ours_paired" not in jobs:
        return
    against = "megatron_combined" if "megatron_combined" in jobs else baseline
    if against in jobs:
        result["ours_paired_baseline"] = against
        result["ours_paired_over_baseline"] = spread(ratios_of(times["ours_paired"], times[against]))
        result["ours_paired_check"] = compare(first["ours_paired"], first[against], against)
    if "ours" in jobs:
        result["paired_over_unpaired"] = spread(ratios_of(times["ours_paired"], times["ours"]))


def ratios_of(times: list[float], reference: list[float]) -> list[float]:
    """One ratio per paired round."""
    return [a / b for a, b in zip(times, reference)]


def spread(ratios: list[float]) -> dict[str, float | int]:
    """min / median / max of per-round ratios (one per paired round)."""
    return {
        "min": min(ratios),
        "median": statistics.median(ratios),
        "max": max(ratios),
        "rounds": len(ratios),
    }


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
        return Outcome(seconds, loss, peak, grad_sq, allocated, pairs=getattr(job, "pairs", None))
    except Exception as error:
        return Outcome(error=f"{type(error).__name__}: {error}"[:500])


def count_calls(job: Any, context: Context) -> int | None:
    """Python function calls in one more step of ``job`` on rank 0 (cProfile; the other ranks
    run the step unprofiled): the per-step Python work, which does not depend on the machine."""
    import cProfile
    import pstats

    profile = cProfile.Profile() if context.rank == 0 else None
    if profile is not None:
        profile.enable()
    outcome = timed_step(job, context.device, first=False, measure=False)
    if profile is not None:
        profile.disable()
    failed = any(o.error for o in gather_objects(outcome))
    return None if failed or profile is None else pstats.Stats(profile).total_calls


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(
    ours: dict[str, float | None], theirs: dict[str, float | None], baseline: str = "torch"
) -> dict[str, Any]:
    """First-iteration loss and gradient norm, ours against the baseline's: same model, same data."""
    check: dict[str, Any] = {"ours": ours, baseline: theirs, "baseline": baseline, "match": True}
    for key, rtol in CHECK_RTOL.items():
        a, b = ours[key], theirs[key]
        diff = abs(a - b) / max(abs(b), 1e-30) if a is not None and b is not None else math.inf
        check[f"{key}_rel_diff"] = diff
        check["match"] = check["match"] and diff <= rtol
    return check


def check_lines(result: dict[str, Any]) -> list[str]:
    """One line per first-step check of the row: ours, ours paired, Megatron's combined 1F1B."""
    labels = {
        "megatron": f"Megatron's {result.get('megatron_schedule')}",
        "megatron_combined": f"Megatron's {result.get('megatron_combined_schedule')}",
        "torch": str(result.get("torch_class")),
    }
    checks = (
        ("check", result["schedule"]),
        ("ours_paired_check", f"{result['schedule']} paired"),
        ("megatron_combined_check", labels["megatron_combined"]),
    )
    return [
        check_line(result[key], name, labels[result[key]["baseline"]])
        for key, name in checks
        if result.get(key)
    ]


def check_line(c: dict[str, Any], name: str, against: str) -> str:
    baseline = c["baseline"]
    return (
        f"check {name} vs {against}: first-iteration loss "
        f"{c['ours']['loss']:.6f} / {c[baseline]['loss']:.6f} (rel diff {c['loss_rel_diff']:.1e}), "
        f"grad norm {c['ours']['grad_norm']:.6f} / {c[baseline]['grad_norm']:.6f} "
        f"(rel diff {c['grad_norm_rel_diff']:.1e}): {'match' if c['match'] else 'MISMATCH'}"
    )


def summary(
    settings: BenchSettings, device: torch.device, rows: list[dict[str, Any]], pinned: bool
) -> dict[str, Any]:
    return {
        "against": settings.against,
        "count_calls": settings.count_calls,
        "pp": settings.pp,
        "ep": settings.ep,
        "world": settings.world,
        "overlap_moe_expert_parallel_comm": settings.overlap,
        "microbatches": settings.microbatches,
        "iterations": settings.iterations,
        "warmup": settings.warmup,
        "model_size": settings.model_size,
        "model": settings.model,
        "micro_batch_size": settings.micro_batch_size,
        "device": device.type,
        "backend": dist.get_backend(),
        "shared_gpu": device.type == "cuda" and dist.get_backend() == "gloo",
        "emulate_nccl": settings.emulate_nccl,
        "threads_per_rank": torch.get_num_threads(),
        "pinned": pinned,
        "torch": torch.__version__,
        "rows": rows,
    }
