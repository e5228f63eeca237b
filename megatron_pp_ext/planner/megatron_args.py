"""A ``pretrain_gpt.py`` command line (ours, Megatron-LM's examples, or the one an sbatch file of
``scripts/slurm`` runs) read as a run to predict: the model, the batch, the GPU count and every
layout choice, each pinned to what the line says or to Megatron's default where it says nothing.

Only what the planner models is read; other flags are ignored. What changes the prediction but is
not modelled (MTP layers, multi-latent attention, node-limited routing, the allgather dispatcher)
is refused or noted, never silently dropped.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..schedule.generators import SCHEDULES
from ..schedule.ir import Placement
from ..schedule.layer_split import (
    LAYOUT_FLAG,
    LayerSplitFlags,
    SplitError,
    check_layout_placement,
    layout_chunks,
    megatron_stage_layers,
    split_flags,
    uneven_splits,
)
from ..schedule.models import ModelShape
from .devices import DeviceProfile
from .pins import PinError, Pins
from .step import Problem

GPT2_VOCAB = 50257  # GPT2BPETokenizer (Megatron-LM's examples use it with --vocab-file/--merge-file)


class ArgsError(ValueError):
    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass
class Run:
    """What a command line describes."""

    shape: ModelShape
    seq_length: int
    micro_batch: int
    global_batch: int | None  # None: Megatron's default, micro-batch x DP
    gpus: int | None  # from torchrun/srun, None when the line does not say
    gpus_per_node: int | None
    pins: Pins
    cluster: str | None = None  # "hopper" / "a100" when an sbatch dry run says
    notes: list[str] = field(default_factory=list)
    dispatcher: str = "alltoall"  # --moe-token-dispatcher-type (alltoall or flex)
    fp8: str | None = None  # --fp8-format: Transformer Engine's linears in FP8

    def problem(
        self,
        profile: DeviceProfile,
        gpus: int | None = None,
        gpus_per_node: int | None = None,
        **settings: Any,
    ) -> Problem:
        """The planner's problem this line describes on ``profile``: its GPUs (or ``gpus``), its
        global batch (Megatron's default, micro-batch x DP, where it gives none), its dispatcher and
        FP8 format; ``settings`` override Problem's other fields (or these)."""
        gpus = gpus or self.gpus
        if gpus is None:
            raise ArgsError("--gpus", "the line does not say how many GPUs (no torchrun --nproc-per-node)")
        pins = self.pins
        model_parallel = (pins.tp or 1) * (pins.cp or 1) * (pins.pp or 1)
        settings = {"dispatcher": self.dispatcher, "fp8": self.fp8, **settings}
        return Problem(
            self.shape,
            self.seq_length,
            gpus,
            profile,
            self.global_batch or self.micro_batch * gpus // model_parallel,
            gpus_per_node=min(gpus_per_node or self.gpus_per_node or 8, gpus),
            **settings,
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add = parser.add_argument
    for flag in (
        "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
        "--kv-channels", "--vocab-size", "--make-vocab-size-divisible-by", "--seq-length",
        "--micro-batch-size",
        "--global-batch-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
        "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank", "--recompute-num-layers", "--pp-chunks", "--pp-seq-slices",
        "--num-experts", "--expert-model-parallel-size", "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers", "--moe-router-topk", "--moe-ffn-hidden-size",
        "--moe-shared-expert-intermediate-size", "--expert-tensor-parallel-size", "--mtp-num-layers",
        "--moe-router-num-groups", "--moe-router-group-topk",
    ):  # fmt: skip
        add(flag, type=int)
    add("--moe-expert-capacity-factor", type=float)
    for flag in (
        "--tokenizer-type", "--merge-file", "--recompute-granularity", "--recompute-method", "--pp-schedule",
        "--pp-offload", "--pp-vocab-parallel", "--fp8-format", "--pipeline-model-parallel-layout",
        "--attention-backend", "--moe-layer-freq", "--moe-token-dispatcher-type",
    ):  # fmt: skip
        add(flag)
    for flag in (
        "--group-query-attention", "--swiglu", "--bf16", "--fp16", "--sequence-parallel",
        "--use-distributed-optimizer", "--tp-comm-overlap", "--overlap-grad-reduce",
        "--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32",
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
        "--moe-pad-expert-input-to-capacity", "--overlap-moe-expert-parallel-comm",
        "--multi-latent-attention", "--moe-grouped-gemm",
    ):  # fmt: skip
        add(flag, action="store_true")
    add("--rampup-batch-size", nargs=3)
    return parser


def _launcher_gpus(tokens: list[str]) -> tuple[int | None, int | None]:
    """GPUs per node and nodes from torchrun (``--nproc-per-node``, ``--nnodes``) or srun
    (``--ntasks-per-node``, ``--nodes``) before the script; None where not given."""
    per_node = nodes = None
    for i, token in enumerate(tokens):
        name, _, value = token.partition("=")
        if not value and i + 1 < len(tokens):
            value = tokens[i + 1]
        if name in ("--nproc-per-node", "--nproc_per_node", "--ntasks-per-node", "--gpus-per-node"):
            per_node = _int(value, name)
        elif name in ("--nnodes", "--nodes", "-N"):
            nodes = _int(value.split(":")[-1], name)  # torchrun's MIN:MAX: the most it runs on
    return per_node, nodes


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ArgsError(flag, f"{flag} {text!r} is not a number (expand shell variables first)") from None


def split_command(text: str) -> tuple[list[str], list[str]]:
    """(launcher tokens, script arguments): the arguments follow ``pretrain_gpt.py`` (or
    ``megatron-pp-ext train``) when the line has one; otherwise the whole line is arguments."""
    tokens = shlex.split(text, comments=True)
    for i, token in enumerate(tokens):
        if token.endswith("pretrain_gpt.py") or (
            token == "train" and i and tokens[i - 1].endswith("megatron-pp-ext")
        ):
            return tokens[:i], tokens[i + 1 :]
    return [], tokens


def read_args(text: str) -> Run:
    """The run ``text`` describes. Raises ArgsError (naming the flag) for what cannot be read."""
    launcher, argv = split_command(text)
    unresolved = [t for t in argv if "$" in t]
    if unresolved:
        raise ArgsError(
            "--from-args", f"unexpanded shell variables in the command line: {' '.join(unresolved[:3])}"
        )
    args, _ = _parser().parse_known_args(argv)
    per_node, nodes = _launcher_gpus(launcher)
    notes: list[str] = []
    if args.fp8_format and not (args.bf16 or args.fp16):
        notes.append(f"--fp8-format {args.fp8_format}: the rest of the model predicted in BF16")
    elif not (args.bf16 or args.fp16 or args.fp8_format):
        notes.append(
            "no --bf16 or --fp16: Megatron trains in FP32; predicted in BF16 (FP32 is several times slower)"
        )
    if args.fp8_format:
        notes.append(
            f"--fp8-format {args.fp8_format}: the linear layers' GEMMs (experts' too) at the GPU's FP8 "
            "throughput with their casts; attention, router and output layer in BF16"
        )
    if args.rampup_batch_size:
        notes.append("--rampup-batch-size: predicted at the full --global-batch-size")
    shape = _shape(args)
    dispatcher = _moe_notes(args, shape, notes)
    seq = _required(args.seq_length, "--seq-length")
    mtp = args.mtp_num_layers or 0
    if mtp:
        shape = with_mtp_layers(shape, mtp)
        notes.append(
            f"--mtp-num-layers {mtp}: predicted as {mtp} more layer(s) of the last layer's kind on the last "
            "stage (Megatron's FLOP count takes them so); their projection, norms and output layer are not"
        )
    pins = _pins(args, shape, mtp)
    return Run(
        shape=shape,
        seq_length=seq,
        micro_batch=args.micro_batch_size or 1,
        global_batch=args.global_batch_size,
        gpus=per_node * (nodes or 1) if per_node else None,
        gpus_per_node=per_node,
        pins=pins,
        notes=notes,
        dispatcher=dispatcher,
        fp8=args.fp8_format,
    )


MOE_ONLY = (
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--moe-router-topk",
    "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
    "--moe-expert-capacity-factor", "--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type",
)  # fmt: skip


def _moe_notes(args: argparse.Namespace, shape: ModelShape, notes: list[str]) -> str:
    """The dispatcher of a mixture-of-experts line, and notes on what of it is not modelled;
    MoE flags on a dense line are refused."""
    if not shape.experts:
        for flag in MOE_ONLY:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value not in (None, False) and not (flag == "--expert-model-parallel-size" and value == 1):
                raise ArgsError(flag, f"{flag} needs --num-experts (the line describes a dense model)")
        return "alltoall"
    dispatcher = args.moe_token_dispatcher_type
    ep = args.expert_model_parallel_size or 1
    if dispatcher in (None, "allgather"):
        if ep > 1 and dispatcher == "allgather":
            raise ArgsError(
                "--moe-token-dispatcher-type",
                "the allgather dispatcher is not modelled (every rank gathers every token): "
                "predict the line with alltoall or flex",
            )
        if ep > 1:
            notes.append(
                "no --moe-token-dispatcher-type: Megatron's default is allgather, which is not "
                "modelled; predicted with alltoall"
            )
        dispatcher = "alltoall"
    elif dispatcher not in ("alltoall", "flex"):
        raise ArgsError("--moe-token-dispatcher-type", f"unknown dispatcher {dispatcher!r}: alltoall or flex")
    if not args.moe_grouped_gemm:
        notes.append(
            "no --moe-grouped-gemm: Megatron runs the local experts one GEMM each; predicted as one "
            "grouped GEMM"
        )
    if args.multi_latent_attention:
        notes.append(
            "--multi-latent-attention is not modelled: attention predicted as the heads, --kv-channels "
            "and --num-query-groups of the line (MLA's low-rank projections and 192-wide QK are not)"
        )
    if args.moe_router_num_groups and args.moe_router_group_topk:
        notes.append(
            f"--moe-router-group-topk {args.moe_router_group_topk}: node-limited routing modelled only where "
            f"its {args.moe_router_num_groups} groups are the EP group's nodes (else routed as uniform top-k)"
        )
    return dispatcher


def with_mtp_layers(shape: ModelShape, mtp: int) -> ModelShape:
    """``shape`` with its ``--mtp-num-layers`` as ``mtp`` more layers of the last layer's kind
    (dense or MoE), as Megatron's FLOP count takes them; on the last pipeline stage (``_split``)."""
    freq = shape.moe_layer_freq
    if shape.experts and not isinstance(freq, int):
        freq = (*freq, *[freq[-1]] * mtp)
    elif shape.experts and freq != 1:
        pattern = shape.moe_layers()
        freq = (*[int(f) for f in pattern], *[int(pattern[-1])] * mtp)
    return replace(shape, layers=shape.layers + mtp, moe_layer_freq=freq)


def moe_layer_freq(text: str, layers: int) -> int | tuple[int, ...]:
    """Megatron's ``--moe-layer-freq``: an integer N (every N-th layer from layer 0), or a list
    expression of 0s and 1s such as ``([0]*3+[1]*58)``, evaluated without ``eval``: lists of
    integers, ``+`` and ``*`` only."""
    flag = "--moe-layer-freq"
    if "[" not in text:
        return _int(text, flag)

    def value(node: ast.AST) -> int | list[int]:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            if all(isinstance(item, int) for item in items):
                return items  # type: ignore[return-value]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right  # type: ignore[operator]
        raise ValueError(ast.dump(node))

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise ArgsError(
            flag, f"{flag} {text!r}: give an integer or a list expression like ([0]*3+[1]*58)"
        ) from None
    if not isinstance(pattern, list) or len(pattern) != layers or set(pattern) - {0, 1}:
        raise ArgsError(flag, f"{flag} {text!r} must give {layers} zeros (dense) and ones (MoE layers)")
    return tuple(pattern)


def _required(value: int | None, flag: str) -> int:
    if value is None:
        raise ArgsError(flag, f"the command line has no {flag}")
    if value < 1:
        raise ArgsError(flag, f"{flag} must be at least 1, got {value}")
    return value


def _shape(args: argparse.Namespace) -> ModelShape:
    layers = _required(args.num_layers, "--num-layers")
    hidden = _required(args.hidden_size, "--hidden-size")
    heads = _required(args.num_attention_heads, "--num-attention-heads")
    kv_heads = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
    if args.ffn_hidden_size:
        ffn = args.ffn_hidden_size
    else:  # Megatron's default (arguments.py)
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if args.swiglu else 4 * hidden
    if args.vocab_size:
        vocab = args.vocab_size
    elif args.tokenizer_type == "GPT2BPETokenizer" or (args.tokenizer_type is None and args.merge_file):
        vocab = GPT2_VOCAB
    else:
        raise ArgsError(
            "--vocab-size",
            f"the vocabulary of tokenizer {args.tokenizer_type or '(none given)'} is not in the command "
            "line: "
            "add --vocab-size N (e.g. 128256 for Llama 3, 32000 for Llama 2)",
        )
    if hidden % heads and not args.kv_channels:
        raise ArgsError("--num-attention-heads", f"{heads} heads do not divide --hidden-size {hidden}")
    experts = args.num_experts or 0
    moe: dict = {}
    if experts:
        moe = {
            "experts": experts,
            "topk": args.moe_router_topk or 2,  # Megatron's default
            "expert_ffn": args.moe_ffn_hidden_size or 0,  # 0: --ffn-hidden-size, Megatron's default
            "shared_expert_ffn": args.moe_shared_expert_intermediate_size or 0,
            "moe_layer_freq": moe_layer_freq(args.moe_layer_freq or "1", layers),
            "capacity_factor": args.moe_expert_capacity_factor,
            "pad_to_capacity": bool(args.moe_pad_expert_input_to_capacity),
            "router_groups": args.moe_router_num_groups or 0,
            "router_group_topk": args.moe_router_group_topk or 0,
        }
    try:
        return ModelShape(
            "the model of the command line", layers, hidden, heads, kv_heads,
            args.kv_channels or hidden // heads, ffn, vocab,
            gated=bool(args.swiglu), **moe,
        )  # fmt: skip
    except ValueError as error:
        flag = "--num-experts" if experts and "moe" in str(error) else "--num-query-groups"
        raise ArgsError(flag, str(error)) from None


def _pins(args: argparse.Namespace, shape: ModelShape, mtp: int = 0) -> Pins:
    """Every layout choice of the line, Megatron's defaults where it is silent."""
    pp = args.pipeline_model_parallel_size or 1
    vpp = _chunks(args, shape.layers, pp)
    vpp = vpp or 1
    schedule = args.pp_schedule or ("interleaved-1f1b" if vpp > 1 else "1f1b")
    recompute = args.recompute_granularity or "none"
    recompute_layers = None
    if recompute == "full" and args.recompute_method == "block":
        recompute_layers = args.recompute_num_layers or 1
    layers = _split(args, shape.layers, pp, vpp, mtp)
    _check_layout_placement(args, schedule, pp, vpp)
    try:
        return Pins(
            stage_layers=layers,
            even_layers=layers is None,
            tp=args.tensor_model_parallel_size or 1,
            cp=args.context_parallel_size or 1,
            pp=pp,
            ep=args.expert_model_parallel_size if shape.experts else None,
            etp=args.expert_tensor_parallel_size if shape.experts else None,
            pairs=True if args.overlap_moe_expert_parallel_comm else None,
            vpp=vpp,
            sequence_parallel=bool(args.sequence_parallel),
            distributed_optimizer=bool(args.use_distributed_optimizer),
            recompute=recompute,
            recompute_layers=recompute_layers,
            schedule=schedule,
            slices=args.pp_seq_slices or 1,
            offload=args.pp_offload or "none",
            vocab=args.pp_vocab_parallel or "none",
            micro_batch=args.micro_batch_size or 1,
            tp_comm_overlap=bool(args.tp_comm_overlap),
            overlap_grad_reduce=bool(args.overlap_grad_reduce),
            overlap_param_gather=bool(args.overlap_param_gather),
            grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
            # without --pp-schedule the line runs Megatron's own schedules
            grad_reduce_buckets=args.pp_schedule is None,
            # Megatron's own core attention materialises the scores; the plugin runs SDPA
            attention="unfused"
            if args.attention_backend in ("local", "unfused") and not args.pp_schedule
            else "flash",
        )
    except PinError as error:
        raise ArgsError(error.flag, str(error)) from None


def _chunks(args: argparse.Namespace, layers: int, pp: int) -> int | None:
    """Model chunks per rank, from whichever of Megatron's three ways the line uses (it takes one)."""
    given = [
        flag
        for flag, value in (
            ("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
            ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank),
            (LAYOUT_FLAG, args.pipeline_model_parallel_layout),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ArgsError(
            given[1], f"{given[1]} cannot be combined with {given[0]} (Megatron-LM takes one of them)"
        )
    if args.pipeline_model_parallel_layout is not None:
        try:
            return layout_chunks(args.pipeline_model_parallel_layout, pp)
        except SplitError as error:
            raise ArgsError(error.flag, str(error)) from None
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if not per_stage:
        return args.num_virtual_stages_per_pipeline_rank or args.pp_chunks
    flags = LayerSplitFlags.from_args(args)
    if flags.first is not None or flags.last is not None:
        raise ArgsError(
            "--num-layers-per-virtual-pipeline-stage",
            "with --decoder-first/last-pipeline-num-layers give the chunks as "
            "--num-virtual-stages-per-pipeline-rank (Megatron-LM refuses this one)",
        )
    per_rank = (layers + flags.embedding_in_split + flags.loss_in_split) // pp
    if per_rank % per_stage:
        raise ArgsError(
            "--num-layers-per-virtual-pipeline-stage",
            f"{per_stage} does not divide the {per_rank} layers of a pipeline rank",
        )
    return per_rank // per_stage


def _check_layout_placement(args: argparse.Namespace, schedule: str, pp: int, vpp: int) -> None:
    """pretrain_gpt.py's refusal (megatron/pretrain.py ``check_args``) of a layout under a V."""
    spec = SCHEDULES.get(schedule)
    if spec is None or pp < 2:
        return
    try:
        placement = Placement(pp, pp * vpp, spec.placement)
        check_layout_placement(args.pipeline_model_parallel_layout, schedule, placement)
    except SplitError as error:
        raise ArgsError(error.flag, str(error)) from None


def _split(args: argparse.Namespace, layers: int, pp: int, vpp: int, mtp: int = 0) -> tuple[int, ...] | None:
    """Layers of each virtual stage as megatron-core builds them under the line's split flags
    (``--decoder-first/last-pipeline-num-layers``, ``--account-for-embedding/loss-in-pipeline-split``,
    ``--pipeline-model-parallel-layout``); None when it has none (an even split)."""
    flags = LayerSplitFlags.from_args(args)
    if mtp and flags.layout:  # the MTP layers (m) as decoder layers where the layout puts them
        flags = replace(flags, layout=flags.layout.replace("m", "t"))
    decoder = layers if flags.layout else layers - mtp
    try:
        split = list(megatron_stage_layers(decoder, pp, vpp, flags))
    except SplitError as error:
        options = uneven_splits(decoder, pp, vpp) if flags.even else []
        hint = f"; Megatron splits them unevenly with {' '.join(split_flags(options[0]))}" if options else ""
        raise ArgsError(error.flag, f"{error}{hint}") from None
    if mtp and not flags.layout:
        split[-1] += mtp  # megatron-core builds the MTP block after the last stage's layers
        return tuple(split)
    return None if flags.even else tuple(split)


def read_sbatch(path: str) -> Run:
    """The run one of our sbatch scripts (``scripts/slurm/*.sbatch``: variables, then launch.sh)
    starts: its ``#SBATCH --nodes`` and ``--gpus-per-node``, and the command line launch.sh's dry
    run prints for that allocation."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as error:
        raise ArgsError("--from-sbatch", f"cannot read {path}: {error.strerror}") from None
    nodes = _sbatch_option(text, ("--nodes", "-N")) or 1
    per_node = _sbatch_option(text, ("--gpus-per-node", "--ntasks-per-node")) or 8
    if "launch.sh" not in text:
        raise ArgsError(
            "--from-sbatch",
            f"{path} does not source scripts/slurm/launch.sh; use --from-args with its command line",
        )
    # A clean environment: the file's own defaults, not this shell's TP=... overrides.
    env = {
        "NNODES": str(nodes),
        "GPUS_PER_NODE": str(per_node),
        "PYTHON": sys.executable,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    done = subprocess.run(
        ["bash", str(file), "--dry-run"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ArgsError("--from-sbatch", f"{path} --dry-run failed: {last}")
    lines = [line for line in done.stdout.splitlines() if "pretrain_gpt.py" in line]
    if not lines:
        raise ArgsError("--from-sbatch", f"{path} --dry-run printed no pretrain_gpt.py command line")
    run = read_args(lines[-1].split(" srun-task ", 1)[-1])
    run.gpus, run.gpus_per_node = nodes * per_node, per_node
    cluster = re.search(r"\((hopper|a100)\b", done.stdout)
    run.cluster = cluster.group(1) if cluster else None
    name = re.search(r"^# megatron-pp-ext: (\S+) \(", done.stdout, re.MULTILINE)
    run.shape = replace(run.shape, name=name.group(1) if name else file.stem)
    return run


def _sbatch_option(text: str, names: tuple[str, ...]) -> int | None:
    for line in text.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        for token in line.split()[1:]:
            name, _, value = token.partition("=")
            if name in names and value.isdigit():
                return int(value)
    return None
