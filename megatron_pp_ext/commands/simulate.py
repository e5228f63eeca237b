"""``megatron-pp-ext simulate``: build a schedule, check it, replay it, print a table.

Pure Python (no torch): usable on a laptop to study a schedule before a GPU is booked. With
``--pp-offload`` the schedule gets activation copies to host memory (PipeOffload) and the table
shows each peak with and without them. With ``--pp-vocab-parallel`` the input embedding and the
output layer are spread over all pipeline ranks (S and T passes, ``schedule/vocab.py``) and the
table compares makespan, busy time and peak memory with and without. With ``--model`` and
Megatron's parallel flags (TP, SP, CP, DP, distributed optimizer, and EP and expert TP for a
mixture-of-experts config) each rank's memory is its activations plus weights, gradients and
optimizer state (``schedule/memory_model.py``); with EP > 1 each F and B of an MoE stage also
pays its expert all-to-all at ``--pp-ep-bandwidth`` (``FlopCosts.expert_comm_time``), which
``--overlap-moe-expert-parallel-comm``'s pairs hide behind compute. With
``--iterations N`` the schedule runs N times back to back with the optimizer step between
(``schedule/iterations.py``): the iteration-boundary bubble, and with ``--pp-post-validation``
how much Zero Bubble's optimizer post-validation takes back (``docs/post_validation.md``).
Every report also says whether the schedule completes under NCCL's rules (``schedule/nccl_check.py``:
in-order completion and rendezvous sends with the communicators warmed up, and lazy creation).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any

from ..schedule import pairs
from ..schedule.completion import FREE, add_completion_argument
from ..schedule.costs import CostModel, UniformCosts
from ..schedule.flops import EP_BANDWIDTH
from ..schedule.generators import SCHEDULES, Costs, RequestError, generate
from ..schedule.ir import Schedule, load
from ..schedule.iterations import IterationsResult, simulate_iterations
from ..schedule.layer_split import LayerSplitFlags, SplitError, add_layer_split_args, megatron_stage_layers
from ..schedule.lowering import lower
from ..schedule.memory_model import MemoryParts, ParallelError, Parallelism, check_parallel, stage_layers
from ..schedule.models import ModelShape
from ..schedule.nccl_check import nccl_summary
from ..schedule.offload import (
    OffloadError,
    add_offload_args,
    apply_offload,
    policy_from_args,
    ratio_from_costs,
)
from ..schedule.run_costs import RunShape, run_costs
from ..schedule.simulate import SimResult, simulate
from ..schedule.validate import ScheduleError, validate
from ..schedule.vocab import GEMMS, UNIFORM_GEMM, VARIANTS, VocabError, add_vocab_passes, unsplit_costs
from .errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="generate, validate and simulate a pipeline schedule (no torch needed)",
        description="Generate a schedule, validate it and replay it with a cost model.",
    )
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}, or 'all'")
    parser.add_argument("--schedule-file", help="load a hand-written schedule (text or JSON) instead")
    parser.add_argument(
        "--pp", "--pipeline-model-parallel-size", type=int, default=4, help="pipeline ranks p"
    )
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches m per iteration")
    parser.add_argument("--vpp", type=int, default=None, help="chunks (virtual stages) per rank")
    parser.add_argument("--slices", type=int, default=1, help="sequence slices k per microbatch")
    parser.add_argument(
        "--slice-partition",
        choices=("uniform", "balanced"),
        default=None,
        help="how to cut the sequence (default: the schedule's own)",
    )
    parser.add_argument("--costs", default="1,1,1", help="F,B,W durations per (stage, microbatch)")
    parser.add_argument("--comm", type=float, default=0.0, help="p2p latency (same unit as --costs)")
    parser.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        help="(Megatron's flag) run adjacent forwards and backwards of different microbatches as "
        "overlapped pairs, each op's expert all-to-all hidden behind the other's compute, where "
        "the pair neither deadlocks nor lengthens the step (schedule/pairing.py)",
    )
    parser.add_argument(
        "--pp-expert-comm",
        type=float,
        default=0.0,
        help="the expert all-to-all time of a whole microbatch's forward (and of its backward) on a "
        "rank, same unit as --costs: part of each F and B unless paired (uniform model)",
    )
    parser.add_argument(
        "--pp-ep-bandwidth",
        type=float,
        default=None,
        metavar="GBPS",
        help="with --model: GB/s per rank of the expert all-to-all of a mixture-of-experts model "
        f"under --expert-model-parallel-size > 1 (default {EP_BANDWIDTH / 1e9:g}: one 400 Gb/s "
        "InfiniBand NIC per GPU, as in DeepSeek-V3's H800 cluster, whose expert parallelism spans "
        "nodes); part of each F and B unless paired",
    )
    add_completion_argument(parser)
    parser.add_argument(
        "--weight-fraction",
        type=float,
        default=0.5,
        help="share of an F's activation kept after B until W (uniform costs)",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="activation limit in units of M for memory-aware schedules (zb-auto)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model shape for the FLOP cost model: a preset (llama-7b, ...), a name in configs/ "
        "(llama2-70b, llama3-8b, gpt3-175b, ...) or a config's YAML file",
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="sequence length for --model (default: the config's, or 4096 for a preset)",
    )
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    parser.add_argument(
        "--pp-attn-redistribution",
        type=float,
        default=0.0,
        metavar="CAP",
        help="SlimPipe attention redistribution: paired heavy ranks hand up to CAP (0..1) of their "
        "attention to light partners (needs --model; 0 = off)",
    )
    add_parallel_args(parser)
    add_layer_split_args(parser)
    add_offload_args(parser, simulator=True)
    group = parser.add_argument_group("vocabulary parallelism (Yeung et al., MLSys'25)")
    group.add_argument(
        "--pp-vocab-parallel",
        choices=VARIANTS,
        default="none",
        help="spread the input embedding and the output layer over all pipeline ranks as S and T "
        "passes: vocab-1 (two barriers, p+2 microbatches in flight) or vocab-2 (one, p+1)",
    )
    group.add_argument(
        "--vocab-costs",
        default=None,
        metavar="S,T",
        help="durations of one microbatch's S and T on a rank, for the uniform model; without the "
        "flag's passes the last stage carries p times their sum (default: "
        f"{UNIFORM_GEMM:g} per output-layer GEMM: vocab-1 "
        + ",".join(f"{g * UNIFORM_GEMM:g}" for g in GEMMS["vocab-1"])
        + ", vocab-2 "
        + ",".join(f"{g * UNIFORM_GEMM:g}" for g in GEMMS["vocab-2"])
        + ")",
    )
    add_iteration_args(parser)
    parser.add_argument("--plot", help="write a timeline picture (.png or .svg)")
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace (.json)")
    parser.add_argument("--save", help="write the generated schedule (.json or text)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def add_iteration_args(parser: argparse.ArgumentParser) -> None:
    """Several iterations with the optimizer step between them (``schedule/iterations.py``)."""
    group = parser.add_argument_group("iterations and the optimizer step (docs/post_validation.md)")
    group.add_argument(
        "--iterations",
        type=int,
        default=1,
        help="simulate N iterations back to back and print the per-iteration time and bubble",
    )
    group.add_argument(
        "--pp-post-validation",
        action="store_true",
        help="also with Zero Bubble's optimizer post-validation as train runs it (each rank steps on "
        "the partial gradient state; its next iteration waits for the global check only at its "
        "validation gate), next to the synchronous step and a step that waits for the global norm",
    )
    group.add_argument(
        "--pp-post-validation-chain",
        choices=("auto", "up", "down"),
        default="auto",
        help="order of the partial state: by iteration end (auto; train uses it until it has timed "
        "the ranks, and with --pp-post-validation-chain auto), rank 0 to p-1 (up, the paper's) or "
        "p-1 to 0 (down)",
    )
    group.add_argument(
        "--optimizer-time", type=float, default=0.0, help="one optimizer step (same unit as --costs)"
    )
    group.add_argument(
        "--norm-reduce-time",
        type=float,
        default=0.0,
        help="the global gradient-norm all-reduce after the last rank is done (same unit)",
    )


def iterations_of(
    args: argparse.Namespace, schedule: Schedule, model: CostModel
) -> dict[str, IterationsResult]:
    """The N-iteration runs the flags ask for: sync, and with --pp-post-validation post-validation
    (the runtime's, with its gate) and, for comparison, a step that waits for the global state
    (empty without either flag)."""
    count = getattr(args, "iterations", 1)
    post = getattr(args, "pp_post_validation", False)
    if count == 1 and not post:
        return {}
    if count < 1:
        raise UsageError("--iterations", f"needs at least 1 iteration, got {count}")
    for flag, value in (
        ("--optimizer-time", args.optimizer_time),
        ("--norm-reduce-time", args.norm_reduce_time),
    ):
        if value < 0:
            raise UsageError(flag, f"must be >= 0, got {value}")
    names = ("sync", "post-validation", "post-validation-wait") if post else ("sync",)
    return {
        name: simulate_iterations(
            schedule,
            model,
            count,
            name,
            optimizer_time=args.optimizer_time,
            reduce_time=args.norm_reduce_time,
            chain=args.pp_post_validation_chain,
            completion=args.comm_completion,
        )
        for name in names
    }


def with_iterations(
    args: argparse.Namespace, result: SimResult, schedule: Schedule, model: CostModel
) -> SimResult:
    """``result`` with its N-iteration runs attached (``result.iterations``, when asked for)."""
    runs = iterations_of(args, schedule, model)
    if runs:
        result.iterations = runs  # type: ignore[attr-defined]
    return result


def iterations_summary(runs: dict[str, IterationsResult]) -> str:
    """One line per optimizer: per-iteration time (steady state and mean) and bubble."""
    labels = {
        "sync": "synchronous optimizer",
        "post-validation": "post-validation",
        "post-validation-wait": "post-validation, waiting for the global norm in the step",
    }
    first = next(iter(runs.values()))
    lines = [f"{first.iterations} iterations back to back (optimizer step {first.optimizer_time:g}):"]
    for name, run in runs.items():
        chain = f", chain {'>'.join(map(str, run.chain))}" if name != "sync" else ""
        lines.append(
            f"  {labels[name]}: per iteration {run.period:.4g} (steady), {run.time_per_iteration:.4g} "
            f"(mean), bubble {run.bubble_rate:.3f}{chain}"
        )
    return "\n".join(lines)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's own flag names, so a launch script's sizes can be pasted in (need --model)."""
    group = parser.add_argument_group("Megatron parallelism (with --model: memory per rank in bytes)")
    group.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=1, help="TP size t")
    group.add_argument(
        "--sequence-parallel", dest="sp", action="store_true", help="shard norms/residual over TP ranks"
    )
    group.add_argument("--context-parallel-size", dest="cp", type=int, default=1, help="CP size c")
    group.add_argument(
        "--data-parallel-size", dest="dp", type=int, default=1, help="DP size d (distributed optimizer)"
    )
    group.add_argument(
        "--use-distributed-optimizer",
        dest="distributed_optimizer",
        action="store_true",
        help="shard Adam's state and master weights over DP x CP ranks",
    )
    group.add_argument(
        "--expert-model-parallel-size",
        dest="ep",
        type=int,
        default=1,
        help="EP size: a mixture-of-experts layer's routed experts split over EP ranks",
    )
    group.add_argument(
        "--expert-tensor-parallel-size",
        dest="etp",
        type=int,
        default=None,
        help="expert TP size: each routed expert split over ETP ranks (default: the TP size)",
    )


PARALLEL_FLAGS = {
    "tp": ("--tensor-model-parallel-size", 1),
    "sp": ("--sequence-parallel", False),
    "cp": ("--context-parallel-size", 1),
    "dp": ("--data-parallel-size", 1),
    "distributed_optimizer": ("--use-distributed-optimizer", False),
    "ep": ("--expert-model-parallel-size", 1),
    "etp": ("--expert-tensor-parallel-size", None),
}


def parallel_from_args(args: argparse.Namespace) -> Parallelism:
    """The parallel layout the flags ask for, checked against the model (one line naming the
    flag when Megatron would refuse it)."""
    parallel = Parallelism(**{name: getattr(args, name) for name in PARALLEL_FLAGS})
    if args.model is None:
        for name, (flag, default) in PARALLEL_FLAGS.items():
            if getattr(args, name) != default:
                raise UsageError(flag, "needs --model NAME (memory per rank in bytes)")
        return parallel
    try:
        check_parallel(model_shape(args), args.seq_length, parallel)
    except KeyError as error:
        raise UsageError("--model", str(error.args[0]), flag_in_message=True) from None
    except ParallelError as error:
        raise UsageError(error.flag, str(error), flag_in_message=True) from None
    return parallel


def check_ep_bandwidth(args: argparse.Namespace) -> None:
    """``--pp-ep-bandwidth``: a positive finite GB/s, and only for the FLOP model (the uniform
    model's all-to-all is a time, ``--pp-expert-comm``)."""
    value = args.pp_ep_bandwidth
    if value is None:
        return
    if not (math.isfinite(value) and value > 0):
        raise UsageError("--pp-ep-bandwidth", f"expected a positive number of GB/s, got {value:g}")
    if args.model is None:
        raise UsageError(
            "--pp-ep-bandwidth", "needs --model NAME (without it the all-to-all time is --pp-expert-comm)"
        )


def resolve_model(args: argparse.Namespace) -> None:
    """``--model`` as a preset or a config (configs/*.yaml, read here: the schedule core stays
    free of YAML), and ``--seq-length``'s default: the config's, else 4096. A config with learned
    positions refuses a sequence longer than its position table."""
    from ..schedule.models import PRESETS

    args.model_shape = None
    if args.model is None or args.model in PRESETS:
        args.seq_length = args.seq_length or 4096
        return
    from .. import configs

    if not configs.exists(args.model):
        raise UsageError(
            "--model",
            f"unknown model {args.model!r} (--model); choose a preset ({', '.join(PRESETS)}), a config "
            f"({', '.join(configs.names())}) or a config's YAML file",
            flag_in_message=True,
        )
    try:
        config = configs.load(args.model)
        model = configs.model_section(config)
        args.seq_length = args.seq_length or model["seq_length"]
        configs.max_positions(model, args.seq_length)  # learned positions: a limit
        args.model_shape = configs.shape(args.model, config)
    except configs.ConfigError as error:
        flag = "--model" if error.flag == "--config" else error.flag
        raise UsageError(flag, error.reason) from None
    except (TypeError, ValueError, KeyError) as error:
        raise UsageError("--model", f"config {args.model!r}: {error}") from None


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The shape of ``--model`` (after :func:`resolve_model`); unknown names raise KeyError."""
    if getattr(args, "model_shape", None) is not None:
        return args.model_shape
    from ..schedule.models import get_model

    return get_model(args.model)


def parse_costs(text: str) -> Costs:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError("--costs", f"expected three numbers F,B,W, got {text!r}") from None
    if len(values) != 3 or min(values) <= 0:
        raise UsageError("--costs", f"expected three positive numbers F,B,W, got {text!r}")
    return Costs(forward=values[0], backward=values[1], weight=values[2])


def build_schedule(args: argparse.Namespace, name: str, costs: Costs) -> Schedule:
    if args.schedule_file:
        try:
            schedule = load(args.schedule_file)
        except (OSError, ValueError, KeyError) as error:
            raise UsageError("--schedule-file", str(error)) from None
    else:
        try:
            schedule = generate(
                name,
                args.pp,
                args.microbatches,
                vpp=args.vpp,
                slices=args.slices,
                costs=costs,
                memory_limit=args.memory_limit,
            )
        except RequestError as error:
            raise UsageError(error.flag, str(error)) from None
    if args.slice_partition:
        schedule.meta["partition"] = args.slice_partition
    return schedule


def vocab_costs(args: argparse.Namespace, variant: str) -> tuple[float, float]:
    """S and T durations of the uniform model: ``--vocab-costs`` or the variant's GEMM counts."""
    if variant == "none":
        return 0.0, 0.0
    if args.vocab_costs is None:
        s_gemms, t_gemms = GEMMS[variant]
        return s_gemms * UNIFORM_GEMM, t_gemms * UNIFORM_GEMM
    try:
        values = [float(part) for part in args.vocab_costs.split(",")]
    except ValueError:
        values = []
    if len(values) != 2 or min(values) < 0:
        raise UsageError("--vocab-costs", f"expected two numbers S,T >= 0, got {args.vocab_costs!r}")
    return values[0], values[1]


def cost_model(
    args: argparse.Namespace, schedule: Schedule, costs: Costs, vocab: str | None = None
) -> CostModel:
    """The cost model of the flags; ``vocab`` (default: the schedule's own passes) prices the
    vocabulary passes and takes the output layer off the last stage."""
    vocab = schedule.vocab_parallel if vocab is None else vocab
    if args.model is None:
        s_cost, t_cost = vocab_costs(args, vocab)
        return UniformCosts(
            num_stages=schedule.num_stages,
            num_slices=schedule.slices,
            chunks_per_rank=schedule.vpp,
            forward=costs.forward,
            backward=costs.backward,
            weight=costs.weight,
            comm=args.comm,
            weight_fraction=args.weight_fraction,
            host_bandwidth=args.pp_host_bandwidth or math.inf,
            ranks_per_host=args.pp_ranks_per_host,
            vocab_forward=s_cost,
            vocab_backward=t_cost,
            expert_comm=args.pp_expert_comm,
        )
    if args.pp_expert_comm:
        raise UsageError(
            "--pp-expert-comm",
            "the uniform model's all-to-all time: with --model the FLOP model prices it from the "
            "model, the EP size and --pp-ep-bandwidth GBPS",
        )
    from ..schedule.flops import flop_costs_for
    from ..schedule.partition import DEFAULT_UNIT

    options: dict[str, float | str] = {"ranks_per_host": args.pp_ranks_per_host, "vocab_parallel": vocab}
    if args.pp_host_bandwidth:
        options["host_bandwidth"] = args.pp_host_bandwidth
    if args.pp_compute_throughput:
        options.update(peak_flops=args.pp_compute_throughput, utilisation=1.0)
    if args.pp_ep_bandwidth is not None:
        options["ep_bandwidth"] = args.pp_ep_bandwidth * 1e9
    parallel = parallel_from_args(args)
    return flop_costs_for(
        model_shape(args),
        schedule,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        partition=schedule.meta.get("partition", "uniform"),
        unit=math.lcm(DEFAULT_UNIT, parallel.sequence_multiple),  # every slice shards like a sequence
        parallel=parallel,
        layers_per_stage=layers_of(args, schedule),
        **options,
    )


def layers_of(args: argparse.Namespace, schedule: Schedule) -> list[int]:
    """Layers per virtual stage as the runtime splits them (megatron-core's split under
    Megatron's layer-split flags), so activations, weights and the message order agree."""
    layers = model_shape(args).layers
    flags = LayerSplitFlags.from_args(args)
    if not flags.even:
        try:
            return megatron_stage_layers(layers, schedule.pp, schedule.vpp, flags)
        except SplitError as error:
            raise UsageError(error.flag, str(error)) from None
    try:
        return stage_layers(layers, schedule.num_stages)
    except ValueError:
        flag = "--vpp" if schedule.vpp > 1 else "--pp"
        raise UsageError(
            flag,
            f"{args.model} has {layers} layers, too few for {schedule.num_stages} virtual stages "
            f"(pp {schedule.pp} x {schedule.vpp} chunks) of at least one layer each",
        ) from None


def rank_memory(args: argparse.Namespace, result: SimResult) -> list[MemoryParts] | None:
    """Each rank's peak activations plus its weights, gradients and optimizer state (bytes);
    None without --model. Static memory is held all step, so it adds to the activation peak;
    with vocabulary parallelism every rank holds 1/p of the embedding and the output layer."""
    if args.model is None:
        return None
    from ..schedule.memory_model import static_memory
    from ..schedule.vocab import vocab_static_memory

    schedule = result.schedule
    layout = vocab_static_memory if schedule.vocab_parallel != "none" else static_memory
    static = layout(
        model_shape(args), schedule.placement, parallel_from_args(args), layers_of(args, schedule)
    )
    return [parts.with_activations(peak) for parts, peak in zip(static, result.peak_memory_per_rank)]


def max_over_min(values: list[float]) -> float:
    low = min(values, default=0.0)
    return max(values) / low if low > 0 else math.inf


def memory_balance(args: argparse.Namespace, result: SimResult) -> float:
    """Highest over lowest peak memory across ranks: the whole rank's (activations + weights,
    gradients, optimizer) with --model, else activations."""
    memory = rank_memory(args, result)
    return result.peak_max_over_min if memory is None else max_over_min([p.total for p in memory])


def result_dict(args: argparse.Namespace, result: SimResult) -> dict[str, Any]:
    """``result.to_dict()`` plus, with --model, the parallel layout and each rank's memory parts."""
    data = result.to_dict()
    parts = rank_memory(args, result)
    if parts is not None:
        parallel = asdict(parallel_from_args(args))
        if not model_shape(args).experts:  # a dense model's layout, as before experts
            parallel = {key: value for key, value in parallel.items() if key not in ("ep", "etp")}
        data["parallel"] = parallel
        data["memory_parts_bytes"] = [p.to_dict() for p in parts]
    data["memory_max_over_min"] = memory_balance(args, result)
    if "makespan_unpaired" in result.schedule.meta:
        data["pairs"] = pairs.count(result.schedule)
        data["makespan_unpaired"] = result.schedule.meta["makespan_unpaired"]
    data["nccl"] = nccl_summary(result.schedule)
    data["comm_completion"] = getattr(args, "comm_completion", FREE)
    if result.without_vocab is not None:
        data["without_vocab_parallel"] = result_dict(args, result.without_vocab)
    runs = getattr(result, "iterations", None)
    if runs:
        data["iterations"] = {name: run.to_dict() for name, run in runs.items()}
    return data


def check_offload_args(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--pp-host-bandwidth", args.pp_host_bandwidth),
        ("--pp-compute-throughput", args.pp_compute_throughput),
    ):
        if value is not None and not value > 0:
            raise UsageError(flag, f"must be positive, got {value}")
    if args.pp_ranks_per_host < 1:
        raise UsageError(
            "--pp-ranks-per-host", f"needs at least 1 rank per host, got {args.pp_ranks_per_host}"
        )


def offloaded(args: argparse.Namespace, schedule: Schedule, model: CostModel) -> Schedule:
    """``schedule`` with the copies ``--pp-offload`` asks for; auto takes k from the model shape
    (PipeOffload's formula) or, for unit costs, from the cost model's copy and compute times."""
    try:
        ratio = None
        if args.pp_offload == "auto":
            ratio = (
                model.offload_ratio()
                if hasattr(model, "offload_ratio")
                else ratio_from_costs(schedule, model)
            )
        return apply_offload(schedule, policy_from_args(args, ratio))
    except OffloadError as error:
        raise UsageError(error.flag, str(error)) from None


def simulate_one(args: argparse.Namespace, name: str) -> SimResult:
    """The simulated schedule (with its copies when ``--pp-offload`` asks for them); the run
    without copies goes into ``result.baseline``, and with ``--pp-vocab-parallel`` the run without
    the vocabulary passes into ``result.without_vocab``."""
    if args.slices > args.seq_length:
        raise UsageError(
            "--slices",
            f"{args.slices} slices cannot cut a sequence of {args.seq_length} tokens "
            f"(--seq-length); use --slices <= {args.seq_length}",
        )
    costs = parse_costs(args.costs)
    schedule = build_schedule(args, name, costs)
    flag = "--schedule-file" if args.schedule_file else "--schedule"
    try:
        validate(schedule)
    except ScheduleError as error:
        raise UsageError(flag, str(error)) from None
    model = model_for(args, schedule, costs)
    run = run_of(args, schedule)
    if args.overlap_moe_expert_parallel_comm:
        schedule = paired(args, schedule, model)
    variant = args.pp_vocab_parallel
    if variant == "none":
        return finish(args, as_run(schedule, run), model)
    if schedule.vocab_parallel != "none":
        raise UsageError("--pp-vocab-parallel", "the schedule file already has vocabulary passes")
    vocab_model = model_for(args, schedule, costs, variant)
    try:
        placing = vocab_model if run is None else run_costs(run, schedule, variant)
        spread = add_vocab_passes(schedule, variant, placing)
        validate(spread)
    except (VocabError, ScheduleError) as error:
        raise UsageError("--pp-vocab-parallel", str(error)) from None
    result = finish(args, as_run(spread, run), vocab_model, plan=schedule)
    if isinstance(vocab_model, UniformCosts):
        model = unsplit_costs(vocab_model, schedule)  # the last stage carries the output layer
    result.without_vocab = finish(args, as_run(schedule, run), model)
    return result


def paired(args: argparse.Namespace, schedule: Schedule, model: CostModel) -> Schedule:
    """``schedule`` with its overlapped F&B pairs (``--overlap-moe-expert-parallel-comm``); the
    makespan without them goes into its meta for the report."""
    from ..schedule import pairing

    flag = "--overlap-moe-expert-parallel-comm"
    for other, value in (
        ("--pp-vocab-parallel", args.pp_vocab_parallel != "none"),
        ("--pp-offload", args.pp_offload != "none"),
        ("--pp-attn-redistribution", bool(args.pp_attn_redistribution)),
        ("--slices", schedule.slices > 1),
    ):
        if value:
            raise UsageError(flag, f"not with {other} yet: the pair's order does not place its ops")
    result = pairing.pair(schedule, model)
    result.meta["makespan_unpaired"] = simulate(schedule, model).makespan
    return result


def run_of(args: argparse.Namespace, schedule: Schedule) -> RunShape | None:
    """The run ``--model`` describes: its FLOP costs place the vocabulary passes and order the
    messages, as the runtime resolves the schedule (``schedule/run_costs.py``; its layers per
    stage under Megatron's split flags); None without a model (unit costs, as a schedule without a
    model runs)."""
    if args.model is None:
        return None
    split = None if LayerSplitFlags.from_args(args).even else tuple(layers_of(args, schedule))
    # The runtime's shape has no experts yet (models.megatron_shape, ModelConfig.shape): order
    # and place as it does, so the simulated order is the run's; the replay still times experts.
    return RunShape(model_shape(args).as_dense(), args.seq_length, split)


def as_run(schedule: Schedule, run: RunShape | None) -> Schedule:
    """``schedule`` lowered as the runtime lowers it for ``run`` (unchanged without one: the
    replay lowers it at unit costs)."""
    return schedule if run is None else lower(schedule, run_costs(run, schedule))


def model_for(
    args: argparse.Namespace, schedule: Schedule, costs: Costs, vocab: str | None = None
) -> CostModel:
    """:func:`cost_model` with its errors as one-line usage errors."""
    from ..schedule.partition import PartitionError

    try:
        return cost_model(args, schedule, costs, vocab)
    except PartitionError as error:
        raise UsageError(error.flag, str(error), flag_in_message=True) from None
    except KeyError as error:
        raise UsageError("--model", str(error.args[0]), flag_in_message=True) from None


def finish(
    args: argparse.Namespace, schedule: Schedule, model: CostModel, plan: Schedule | None = None
) -> SimResult:
    """Attention redistribution (paired on ``plan``'s slots) and offload as the flags ask, then
    the replay (under in-order completion, the makespan with sends that never wait beside it)."""
    if args.pp_attn_redistribution:
        model = redistributed(args, schedule, model, plan)
    if args.pp_offload != "none":
        check_offload_args(args)
    run = schedule if args.pp_offload == "none" else offloaded(args, schedule, model)
    result = with_iterations(args, replayed(args, run, model), run, model)
    if run is not schedule:
        result.baseline = replayed(args, schedule, model)
    if args.comm_completion != FREE:
        result.free_sends = simulate(run, model)
    return result


def replayed(args: argparse.Namespace, schedule: Schedule, model: CostModel) -> SimResult:
    """``simulate`` under ``--comm-completion``; an order that hangs under in-order completion
    (a hand-written schedule file) is one line naming the flag."""
    try:
        return simulate(schedule, model, completion=args.comm_completion)
    except ScheduleError as error:
        if args.comm_completion == FREE:
            raise
        raise UsageError(
            "--comm-completion",
            f"{args.comm_completion}: {error} (this order hangs on a GPU; without the flag the "
            "NCCL line says where and how to fix it)",
        ) from None


def redistributed(
    args: argparse.Namespace, schedule: Schedule, model: CostModel, plan: Schedule | None = None
) -> CostModel:
    """``model`` with SlimPipe's attention redistribution; the bubble without it goes into
    ``schedule.meta`` for the report. The heavy/light pairs come from ``plan``'s lock-step slots
    (default: ``schedule``): with vocabulary parallelism the generator's own order, since S and T
    run on every rank and carry no attention to pair."""
    from ..schedule.flops import FlopCosts
    from ..schedule.redistribute import planned_costs, redistribute

    cap = args.pp_attn_redistribution
    if not isinstance(model, FlopCosts):
        raise UsageError("--pp-attn-redistribution", "needs the FLOP cost model: add --model NAME")
    if not 0.0 <= cap <= 1.0:
        raise UsageError("--pp-attn-redistribution", f"CAP must be between 0 and 1, got {cap}")
    plan = plan or schedule
    schedule.meta["attn_redistribution"] = cap
    schedule.meta["bubble_without_redistribution"] = replayed(args, schedule, model).bubble_rate
    whole_slices = planned_costs(plan, model, cap)
    schedule.meta["bubble_whole_slices"] = replayed(args, schedule, whole_slices).bubble_rate
    return redistribute(plan, model, cap)


def _row(
    result: SimResult, memory: list[MemoryParts] | None = None, args: argparse.Namespace | None = None
) -> dict[str, Any]:
    data = result.to_dict()
    row = {
        "schedule": data["schedule"],
        "v": data["vpp"],
        "k": data["slices"],
        "makespan": f"{data['makespan']:.4g}",
        "bubble": f"{data['bubble_rate']:.3f}",
        "bubble in span": f"{data['bubble_rate_in_span']:.3f}",
        "peak M (rank 0)": f"{data['peak_memory_m'][0]:.3f}",
        "peak M (max)": f"{max(data['peak_memory_m']):.3f}",
    }
    if memory is not None:
        row["act GiB (max)"] = f"{max(data['peak_memory_bytes']) / 2**30:.2f}"
        row["total GiB (max)"] = f"{max(p.total for p in memory) / 2**30:.2f}"
    if "makespan_unpaired" in result.schedule.meta:
        row["pairs"] = pairs.count(result.schedule)
        row["unpaired: makespan"] = f"{result.schedule.meta['makespan_unpaired']:.4g}"
    if result.baseline is not None:
        row["no offload: peak M (max)"] = f"{max(result.baseline.peak_memory_m):.3f}"
        row["no offload: bubble"] = f"{result.baseline.bubble_rate:.3f}"
        row["offloaded"] = result.schedule.meta.get("offloaded_units", 0)
    if result.without_vocab is not None and args is not None:
        plain = result.without_vocab
        row["vocab"] = result.schedule.vocab_parallel
        row["busy max/min"] = f"{result.busy_max_over_min:.3f}"
        row["mem max/min"] = f"{memory_balance(args, result):.3f}"
        row["no vocab: makespan"] = f"{plain.makespan:.4g}"
        row["no vocab: busy max/min"] = f"{plain.busy_max_over_min:.3f}"
        row["no vocab: mem max/min"] = f"{memory_balance(args, plain):.3f}"
    if result.free_sends is not None:
        free = result.free_sends.makespan
        row["free sends: makespan"] = f"{free:.4g}"
        row["in order"] = f"{result.makespan / free - 1:+.1%}"
    for name, run in (getattr(result, "iterations", None) or {}).items():
        short = {"sync": "sync", "post-validation": "post-val", "post-validation-wait": "post-val wait"}[name]
        row[f"{short}: per iter"] = f"{run.period:.4g}"
        row[f"{short}: bubble"] = f"{run.bubble_rate:.3f}"
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    headers = list(rows[0])
    widths = {h: max(len(h), *(len(str(r.get(h, ""))) for r in rows)) for h in headers}
    lines = ["  ".join(h.ljust(widths[h]) for h in headers)]
    lines.append("  ".join("-" * widths[h] for h in headers))
    for row in rows:
        lines.append("  ".join(str(row.get(h, "")).ljust(widths[h]) for h in headers))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    resolve_model(args)
    parallel_from_args(args)  # bad sizes fail once, before any schedule (also for 'all')
    check_ep_bandwidth(args)
    if args.schedule == "all" and not args.schedule_file:
        return run_all(args)
    result = simulate_one(args, args.schedule)
    write_pictures(args, result)
    if args.json:
        print(json.dumps(result_dict(args, result)))
        return 0
    memory = rank_memory(args, result)
    print(format_table([_row(result, memory, args)]))
    per_rank = ", ".join(
        f"r{r}: bubble {b:.3f} peak {m:.3f}M"
        for r, (b, m) in enumerate(zip(result.bubble_rate_per_rank, result.peak_memory_m))
    )
    print(per_rank)
    if memory is not None:
        print(memory_summary(memory))
    if result.baseline is not None:
        print(offload_summary(result))
    if result.without_vocab is not None:
        print(vocab_summary(args, result))
    if getattr(result, "iterations", None):
        print(iterations_summary(result.iterations))  # type: ignore[attr-defined]
    print(nccl_line(nccl_summary(result.schedule)))
    meta = result.schedule.meta
    if "bubble_without_redistribution" in meta:
        print(
            f"attention redistribution (cap {meta['attn_redistribution']:g}): bubble "
            f"{meta['bubble_without_redistribution']:.3f} without -> {result.bubble_rate:.3f} with"
        )
        print(
            f"  as the runtime moves it (whole oldest K/V slices): bubble {meta['bubble_whole_slices']:.3f}"
        )
    return 0


def nccl_line(found: dict[str, str | None]) -> str:
    """Whether the schedule completes under NCCL's rules, and the first hang's message."""
    names = {"strict": "in-order", "relaxed": "relaxed", "lazy_creation": "lazy creation"}
    verdicts = ", ".join(f"{names[key]} {'hangs' if found[key] else 'completes'}" for key in names)
    first = next((found[key] for key in ("relaxed", "lazy_creation", "strict") if found[key]), None)
    return f"NCCL: {verdicts}" + (f": {first}" if first else "")


def memory_summary(memory: list[MemoryParts]) -> str:
    """One line per rank: total GiB and its four parts (and, with experts, their share)."""
    gib = 2**30
    experts = any(p.experts for p in memory)
    lines = ["memory per rank (GiB) = activations + weights + gradients + optimizer"]
    if experts:
        lines[0] += " (routed experts' weights, gradients and optimizer in brackets)"
    for rank, p in enumerate(memory):
        share = f" ({p.experts / gib:.2f} experts)" if experts else ""
        lines.append(
            f"  r{rank}: {p.total / gib:.2f} = {p.activations / gib:.2f} + {p.weights / gib:.2f} + "
            f"{p.gradients / gib:.2f} + {p.optimizer / gib:.2f}{share}"
        )
    return "\n".join(lines)


def vocab_summary(args: argparse.Namespace, result: SimResult) -> str:
    """Without -> with the vocabulary passes: makespan, busy time and peak memory balance."""
    plain = result.without_vocab
    assert plain is not None
    what = "total memory" if args.model else "activation peak"
    return (
        f"vocabulary parallelism {result.schedule.vocab_parallel}: makespan {plain.makespan:.4g} -> "
        f"{result.makespan:.4g}, busy max/min {plain.busy_max_over_min:.3f} -> "
        f"{result.busy_max_over_min:.3f}, {what} max/min {memory_balance(args, plain):.3f} -> "
        f"{memory_balance(args, result):.3f}"
    )


def offload_summary(result: SimResult) -> str:
    """One line per rank: peak without and with the copies, and what the copies carry."""
    meta = result.schedule.meta
    k = f" k={meta['offload_k']:.3g}" if "offload_k" in meta else ""
    lines = [f"offload {meta.get('offload')}{k}: {meta.get('offloaded_units', 0)} units copied to host"]
    for rank, (before, after) in enumerate(zip(result.baseline.peak_memory_m, result.peak_memory_m)):
        lines.append(
            f"  r{rank}: peak {before:.3f}M -> {after:.3f}M, "
            f"{result.offloaded_bytes_per_rank[rank] / result.microbatch_activation:.3f}M to host per step"
        )
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    """Every registered schedule on the same p and m; the ones that cannot run say why."""
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for name in SCHEDULES:
        try:
            result = simulate_one(args, name)
        except UsageError as error:
            rows.append({"schedule": name, "v": "-", "k": "-", "makespan": f"n/a: {error.flag}"})
            results.append({"schedule": name, "error": str(error)})
            continue
        rows.append(_row(result, rank_memory(args, result), args))
        results.append(result_dict(args, result))
    if args.json:
        print(json.dumps({"pp": args.pp, "microbatches": args.microbatches, "schedules": results}))
    else:
        print(format_table(rows))
    return 0


def write_pictures(args: argparse.Namespace, result: SimResult) -> None:
    if not (args.plot or args.trace or args.save):
        return
    from ..schedule import plot

    if args.plot:
        plot.plot_timeline(result, args.plot, time_unit="s" if args.model else "")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.trace:
        plot.write_trace(result, args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    if args.save:
        from ..schedule.ir import save

        save(result.schedule, args.save)
        print(f"wrote {args.save}", file=sys.stderr)
