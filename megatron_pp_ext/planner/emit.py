"""A plan as something to launch: Megatron-LM ``pretrain_gpt.py`` flags, or a SLURM script in the
style of ``scripts/slurm/*.sbatch`` (variables, then ``launch.sh``)."""

from __future__ import annotations

import shlex
from pathlib import Path

from ..schedule.layer_split import split_flags
from .model import ModelSpec
from .search import splits_backward
from .step import PlanResult

RECOMPUTE_FLAGS = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]


def parallel_flags(plan: PlanResult) -> list[str]:
    """Megatron's layout and batch flags and the plugin's ``--pp-*`` flags for ``plan``."""
    c, layout, problem = plan.candidate, plan.candidate.layout, plan.problem
    flags = [
        "--tensor-model-parallel-size", str(layout.tp),
        "--context-parallel-size", str(layout.cp),
        "--pipeline-model-parallel-size", str(layout.pp),
    ]  # fmt: skip
    if layout.tp > 1:
        flags.append("--sequence-parallel")
    if c.split is not None:
        flags += split_flags(c.split)  # the uneven split the plan was predicted with
    if c.vpp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(c.vpp)]
        if layout.pp > 2:
            flags.append("--no-overlap-p2p-communication")  # Megatron's own interleaved overlap
    flags += [
        "--micro-batch-size", str(c.micro_batch),
        "--global-batch-size", str(problem.global_batch),
    ]  # fmt: skip
    if problem.shape.experts:
        flags += [
            "--expert-model-parallel-size", str(layout.ep),
            "--expert-tensor-parallel-size", str(layout.expert_tp),
            "--moe-token-dispatcher-type", problem.dispatcher,
        ]  # fmt: skip
        if c.pairs:
            flags.append("--overlap-moe-expert-parallel-comm")
    if problem.fp8:
        flags += ["--fp8-format", problem.fp8]
    if layout.parallel.distributed_optimizer:
        flags += ["--use-distributed-optimizer", "--overlap-grad-reduce"]
        if c.overlap_param_gather:
            flags.append("--overlap-param-gather")
    flags += ["--pp-schedule", c.schedule]
    if c.vpp > 1:
        flags += ["--pp-chunks", str(c.vpp)]
    if c.slices > 1:
        flags += ["--pp-seq-slices", str(c.slices)]
    if c.offload != "none":
        flags += ["--pp-offload", c.offload]
    if c.vocab != "none":
        flags += ["--pp-vocab-parallel", c.vocab]
        if c.slices > 1:
            flags.append("--calculate-per-token-loss")  # the plugin's vocab passes need it with slices
    if c.recompute == "full":
        flags += RECOMPUTE_FLAGS
    if splits_backward(c.schedule):
        # the memory the plan was predicted with: the local spec's deferrable linears keep this
        # rank's sequence share until W (TE's own deferral keeps the SP-gathered input; it runs
        # too, from TE 2.3, but the planner does not model it)
        flags += ["--transformer-impl", "local"]
    return flags


def megatron_flags(spec: ModelSpec, plan: PlanResult) -> list[str]:
    """Everything ``pretrain_gpt.py`` needs for the model and the plan (data and tokenizer aside)."""
    return spec.megatron_args(plan.problem.seq_length) + parallel_flags(plan)


def _cluster(profile_name: str) -> str:
    return "a100" if profile_name.startswith("a100") else "hopper"


def sbatch(spec: ModelSpec, plan: PlanResult, command: str) -> str:
    """A SLURM script that sets ``scripts/slurm/launch.sh``'s variables to the plan and sources it
    (save it next to launch.sh, in scripts/slurm/). The model must be a config: launch.sh reads
    its shape from it; shape flags given on top are passed through to Megatron."""
    if spec.config is None:
        raise ValueError(
            f"{spec.name} is a preset, not a config: launch.sh needs a configs/ name or a YAML file"
        )
    if spec.shape.experts:
        raise ValueError(
            f"{spec.name} is a mixture-of-experts model: launch.sh writes no expert flags yet; "
            "use --emit flags (every Megatron flag of the plan, the experts' too)"
        )
    c, layout, problem = plan.candidate, plan.candidate.layout, plan.problem
    nodes = max(1, problem.gpus // problem.gpus_per_node)
    config = spec.config
    if spec.config and Path(spec.config).suffix in (".yaml", ".yml"):
        config = str(Path(spec.config).resolve())
    name = f"{spec.name}-{c.schedule}-{problem.seq_length // 1024}k"
    gather = int(layout.parallel.distributed_optimizer and c.overlap_param_gather)
    extra = spec.override_args() + (RECOMPUTE_FLAGS if c.recompute == "full" else [])
    extra += split_flags(c.split) if c.split is not None else []
    lines = [
        "#!/bin/bash",
        f"# {spec.name} at {problem.seq_length} tokens on {problem.gpus} {problem.profile.name} GPUs,",
        "# as planned by",
        f"#   {command}",
        f"# Layout: {layout.label()}, {c.schedule} with {c.vpp} chunk(s) per rank and {c.slices} slice(s), "
        f"micro-batch {c.micro_batch}, offload {c.offload}, recompute {c.recompute}.",
        f"# Predicted: {plan.step_time:.2f} s per step, {plan.tokens_per_s_per_gpu:.0f} tokens/s per GPU, "
        f"MFU {plan.mfu:.1%}, {plan.memory_gib:.1f} GiB per GPU (docs/planner.md).",
        "# Save it in scripts/slurm/ (it sources launch.sh from there). Preview: bash FILE --dry-run",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={problem.gpus_per_node}",
        f"#SBATCH --gpus-per-node={problem.gpus_per_node}",
        "#SBATCH --exclusive",
        "#SBATCH --time=04:00:00",
        "#SBATCH --output=slurm-%x-%j.out",
        "",
        f': "${{CONFIG:={config}}}" "${{CLUSTER:={_cluster(problem.profile.name)}}}" '
        f'"${{NNODES:=${{SLURM_JOB_NUM_NODES:-{nodes}}}}}" "${{GPUS_PER_NODE:={problem.gpus_per_node}}}"',
        f': "${{SEQ_LENGTH:={problem.seq_length}}}" "${{TP:={layout.tp}}}" "${{CP:={layout.cp}}}" '
        f'"${{PP:={layout.pp}}}" "${{SEQUENCE_PARALLEL:={int(layout.tp > 1)}}}"',
        f': "${{MICRO_BATCH_SIZE:={c.micro_batch}}}" "${{GLOBAL_BATCH_SIZE:={problem.global_batch}}}" '
        '"${TRAIN_ITERS:=1000}" "${WARMUP_ITERS:=50}"',
        f': "${{USE_DISTRIBUTED_OPTIMIZER:={int(layout.parallel.distributed_optimizer)}}}" '
        f'"${{OVERLAP_GRAD_REDUCE:={int(layout.parallel.distributed_optimizer)}}}" '
        f'"${{OVERLAP_PARAM_GATHER:={gather}}}"',
        f': "${{PP_SCHEDULE:={c.schedule}}}" "${{PP_CHUNKS:={c.vpp if c.vpp > 1 else ""}}}" '
        f'"${{PP_SEQ_SLICES:={c.slices}}}" "${{PP_OFFLOAD:={c.offload}}}"',
        "",
        "# sbatch runs a copy of this file from its spool directory: find launch.sh next to the original.",
        'self=$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null'
        " | sed -n 's/^ *Command=\\([^ ]*\\).*/\\1/p')",
        '[[ -n "$self" && "$self" != /* ]] && self=$SLURM_SUBMIT_DIR/$self',
        '[[ -f "$(dirname "${self:-/}")/launch.sh" ]] || self=${BASH_SOURCE[0]}',
    ]
    source = 'source "$(dirname "$self")/launch.sh" "$@"'
    if extra:
        source += " -- " + shlex.join(extra)
    lines.append(source)
    return "\n".join(lines) + "\n"
