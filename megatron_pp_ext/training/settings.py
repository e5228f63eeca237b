"""What a training run is asked to do: the config file merged with the command line's flags
(:class:`TrainSettings`), the data-parallel layout Megatron derives, and the learning-rate
schedule. Plain data, no torch: the launching process reads and checks it before any worker
starts, and it pickles into the workers."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError
from ..megatron import datasets
from ..megatron.hook import MEGATRON_FLAGS, OptionError, PipelineOptions, chunks_per_rank
from ..megatron.model_config import ModelConfig
from ..schedule.generators import SCHEDULES, GeneratorSpec
from ..schedule.layer_split import (
    LAYOUT_FLAG,
    LayerSplitFlags,
    SplitError,
    layout_chunks,
    megatron_stage_layers,
)

# The generator's flag names as this command spells them: pretrain_gpt.py's, except that train
# also takes the number of microbatches itself (--global-batch-size when given: check()).
TRAIN_FLAGS = {**MEGATRON_FLAGS, "--microbatches": "--microbatches"}

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = "tiny-llama"


@dataclass
class TrainSettings:
    """Everything a worker needs; plain data so it pickles into spawned processes."""

    model: dict[str, Any]
    pp: int = 4
    tp: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    microbatches: int = 8  # per data-parallel rank: global batch / (micro batch size x DP)
    global_batch_size: int | None = None
    micro_batch_size: int = 4
    iterations: int = 40
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 4
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 5  # Megatron's --log-interval: a Megatron-style line every N iterations
    eval_interval: int | None = None  # Megatron's --eval-interval: a validation loss every N iterations
    eval_iters: int = 100  # Megatron's --eval-iters: forward-only iterations per validation
    data: str | None = None  # byte-level text (data.py); None: the stdlib docstrings
    # Megatron's data flags: megatron-core's datasets and tokenizer (megatron/datasets.py)
    dataset: datasets.DataOptions = field(default_factory=datasets.DataOptions)
    metrics: str | None = None
    tensorboard_dir: str | None = None  # Megatron's --tensorboard-dir (megatron_pp_ext/logs.py)
    log_validation_ppl: bool = False  # Megatron's --log-validation-ppl-to-tensorboard
    timeout: float = 300.0
    save: str | None = None  # checkpoint directory (Megatron's --save)
    save_interval: int | None = None  # iterations between saves (and one at the end)
    load: str | None = None  # resume from this directory's latest checkpoint
    ckpt_step: int | None = None  # load this iteration instead of the latest
    load_optimizer: bool = True
    load_rng: bool = True
    post_validation: bool = False  # Zero Bubble's optimizer post-validation
    post_validation_chain: str = "measured"  # the partial state's order: measured, auto, up, down
    optimizer: str = "auto"  # --pp-optimizer: auto, megatron, torch
    profile: bool = False  # Megatron's --profile: NVTX ranges (the ops' names: pipeline.op_ranges)
    use_pytorch_profiler: bool = False  # Megatron's: torch.profiler over the profiling window
    transformer_impl: str | None = None  # Megatron's --transformer-impl; None: use_te() decides
    # Megatron's --distributed-backend; None: NCCL on GPUs, gloo on CPU; gloo on GPUs shares them
    distributed_backend: str | None = None
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    chunks_flag: str | None = None  # the flag that gave the chunk count, for errors; None: --pp-chunks
    # decoder layers of each virtual stage (model order) under Megatron's layer-split flags, as
    # megatron-core builds them; None: no such flag, train's own even split (split_layers)
    layers_per_stage: tuple[int, ...] | None = None

    def iteration_samples(self) -> int:
        """Sequences per iteration over all data-parallel ranks: the global batch."""
        return self.micro_batch_size * self.microbatches * self.dp

    def use_te(self, splits_backward: bool) -> bool:
        """Transformer Engine's layers: when asked for, else on a GPU where TE imports, and for a
        schedule with a B/W split only where TE can defer weight gradients to W (>= 2.3)."""
        from ..megatron.layer_spec import te_available, te_wgrad_refusal  # settings import no torch

        if self.transformer_impl is not None:
            return self.transformer_impl == "transformer_engine"
        return te_available() and not (splits_backward and te_wgrad_refusal("") is not None)


def load_settings(args: argparse.Namespace) -> TrainSettings:
    path = Path(args.config)
    if path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:  # a name (may hold dots: gpt3-1.3b)
        path = CONFIG_DIR / f"{args.config}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise UsageError("--config", f"no config {args.config!r} (file or one of: {known})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise UsageError(
            "--config", f"{path} is not valid YAML{at}: {getattr(error, 'problem', error)}"
        ) from None
    if not isinstance(raw, dict):
        raise UsageError("--config", f"{path} is not a mapping of sections (model:, training:, pipeline:)")
    training = dict(raw.get("training", {}))
    model = dict(raw.get("model", {}))
    pipeline = dict(raw.get("pipeline", {}))
    overrides = {
        "pp": args.pp,
        "tp": args.tp,
        "dp": args.dp,
        "cp": args.cp,
        "sequence_parallel": args.sequence_parallel,
        "use_distributed_optimizer": args.use_distributed_optimizer,
        "overlap_grad_reduce": args.overlap_grad_reduce,
        "microbatches": args.microbatches,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "iterations": args.iterations,
        "lr": args.lr,
        "min_lr": args.min_lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "clip_grad": args.clip_grad,
        "seed": args.seed,
        "log_interval": args.log_interval,
        "eval_interval": args.eval_interval,
        "eval_iters": args.eval_iters,
    }
    if args.global_batch_size is not None and args.microbatches is None:
        training.pop("microbatches", None)  # the global batch size decides
    training.update({key: value for key, value in overrides.items() if value is not None})
    if args.sequence_parallel is None and training.get("tp", 1) == 1:
        training.pop("sequence_parallel", None)  # a config's sequence parallelism goes with its TP
    model.update(model_flags(args, model))
    if args.bf16:
        model["dtype"] = "bfloat16"
    try:
        options = PipelineOptions.from_args(args)
        chunks = chunks_per_rank(args.pp_chunks, args.virtual_stages)
    except OptionError as error:
        raise UsageError(error.flag, error.reason) from None
    options = dataclasses.replace(
        options,
        measure_memory=True,  # train reports each rank's activation peak
        schedule=args.pp_schedule or pipeline.get("schedule", "1f1b"),
        chunks=pipeline.get("chunks") if chunks is None else chunks,
        slices=args.pp_seq_slices if args.pp_seq_slices is not None else pipeline.get("slices", 1),
        slice_partition=args.pp_slice_partition or pipeline.get("slice_partition"),
    )
    unknown = set(training) - {f.name for f in dataclasses.fields(TrainSettings)}
    if unknown:
        raise UsageError("--config", f"{path}: unknown training keys {sorted(unknown)}")
    chunks_flag = (
        "--num-virtual-stages-per-pipeline-rank" if args.pp_chunks is None and args.virtual_stages else None
    )
    split_flags = LayerSplitFlags.from_args(args)
    pp = int(training.get("pp", TrainSettings.pp))
    if split_flags.layout is not None and pp >= 1:  # Megatron sets its virtual pipeline size from it
        layout_count = _layout_chunks(split_flags.layout, pp, chunks, chunks_flag)
        options, chunks_flag = dataclasses.replace(options, chunks=layout_count), LAYOUT_FLAG
    layers = stage_split(split_flags, int(model.get("num_layers", ModelConfig.num_layers)), pp, options)
    dataset = datasets.DataOptions(
        data_path=tuple(args.data_path) if args.data_path is not None else None,
        split=args.split,
        mock_data=args.mock_data,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    try:
        padded_vocab = datasets.check(dataset, args.data, int(training.get("tp", 1)))
    except OptionError as error:
        raise UsageError(error.flag, error.reason) from None
    if padded_vocab is not None:  # the tokenizer's vocabulary, padded as Megatron-LM pads it
        model["vocab_size"] = padded_vocab
    return TrainSettings(
        model=model,
        data=args.data,
        dataset=dataset,
        metrics=args.metrics,
        tensorboard_dir=args.tensorboard_dir,
        log_validation_ppl=args.log_validation_ppl_to_tensorboard,
        pipeline=options,
        timeout=options.p2p_timeout,
        save=args.save,
        save_interval=args.save_interval,
        load=args.load,
        ckpt_step=args.ckpt_step,
        load_optimizer=not args.no_load_optim,
        load_rng=not args.no_load_rng,
        post_validation=args.pp_post_validation,
        post_validation_chain=getattr(args, "pp_post_validation_chain", None) or "measured",
        optimizer=getattr(args, "pp_optimizer", None) or "auto",
        profile=bool(getattr(args, "profile", None)),
        use_pytorch_profiler=bool(getattr(args, "use_pytorch_profiler", None)),
        transformer_impl=args.transformer_impl,
        distributed_backend=args.distributed_backend,
        chunks_flag=chunks_flag,
        layers_per_stage=layers,
        **training,
    )


def _layout_chunks(layout: str, pp: int, chunks: int | None, chunks_flag: str | None) -> int:
    """Model chunks per rank under ``--pipeline-model-parallel-layout``: its stage count over
    ``pp``, as Megatron sets it; a chunk count on the command line (``chunks``) must agree."""
    try:
        count = layout_chunks(layout, pp)
    except SplitError as error:
        raise UsageError(error.flag, str(error)) from None
    if chunks_flag == "--num-virtual-stages-per-pipeline-rank":  # Megatron-LM takes one of the two
        raise UsageError(
            chunks_flag,
            f"cannot be combined with {LAYOUT_FLAG} (Megatron-LM refuses the pair): leave it out, the "
            f"layout's {count * pp} stages over {pp} pipeline ranks set {count} model chunks per rank",
        )
    if chunks is not None and chunks != count:
        raise UsageError(
            chunks_flag or "--pp-chunks",
            f"{chunks} disagrees with {LAYOUT_FLAG}, whose {count * pp} stages over {pp} pipeline ranks "
            f"are {count} model chunks per rank: leave it out (the layout sets it)",
        )
    return count


def stage_split(
    flags: LayerSplitFlags, num_layers: int, pp: int, options: PipelineOptions
) -> tuple[int, ...] | None:
    """Decoder layers of each virtual stage under Megatron's layer-split flags (``flags``), as
    megatron-core builds them for the schedule's chunks per rank; None without such a flag (train
    keeps its own even split, which also takes layer counts the stages do not divide). A split
    megatron-core refuses raises :class:`UsageError` naming the flag."""
    spec = SCHEDULES.get(options.schedule)
    if flags.even or spec is None:  # an unknown schedule: check() names --pp-schedule
        return None
    chunks = spec.default_vpp if options.chunks is None else options.chunks
    if flags.layout is not None and not spec.takes_vpp(chunks):
        raise UsageError(LAYOUT_FLAG, _layout_schedule_mismatch(spec, chunks, pp))
    try:
        split = tuple(megatron_stage_layers(num_layers, pp, chunks, flags))
    except SplitError as error:
        raise UsageError(error.flag, str(error)) from None
    empty = [stage for stage, count in enumerate(split[1:-1], start=1) if count == 0]
    if empty:  # only a layout leaves a middle stage empty
        raise UsageError(
            LAYOUT_FLAG,
            f"virtual stage {empty[0]} of {list(split)} has no decoder layer: train runs a stage without "
            "layers only where it holds the embedding (the first) or the loss (the last); a middle one "
            "would hold no parameter at all, which its pipeline rank cannot train: give it a layer (t)",
        )
    return split


def _layout_schedule_mismatch(spec: GeneratorSpec, chunks: int, pp: int) -> str:
    """Why a layout's chunks per rank do not fit the schedule, and what to change."""
    said = (
        f"gives {chunks} model chunk(s) per pipeline rank, but --pp-schedule {spec.name} runs "
        f"{spec.vpp_choices()}"
    )
    if chunks > 1:
        return f"{said}: add --pp-schedule interleaved-1f1b (or another schedule of {chunks} chunks per rank)"
    return f"{said}: spell out {spec.default_vpp * pp} stages, or use a schedule of one chunk per rank (1f1b)"


# Megatron-LM's model flags and the config's model keys they set.
MODEL_FLAGS = {
    "num_layers": "num_layers",
    "seq_length": "seq_length",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "ffn_hidden_size",
    "max_position_embeddings": "max_position_embeddings",
    "rotary_base": "rotary_base",
    "norm_epsilon": "norm_epsilon",
    "init_method_std": "init_std",
}
# Megatron-LM's mixture-of-experts flags (argparse names) and the TransformerConfig fields they
# set in the model's ``extra`` (a config's ``model: extra:`` takes the same fields).
MOE_FLAGS = {
    "num_experts": "num_moe_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_layer_freq": "moe_layer_freq",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_grouped_gemm": "moe_grouped_gemm",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size",
}
# The architecture train builds, as Megatron-LM's flags choose it.
LLAMA_CHOICES = {"--normalization": "RMSNorm", "--position-embedding-type": "rope"}


def model_flags(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """The model keys Megatron-LM's flags on the command line set over the ``config``'s model
    section: a pretrain_gpt.py line of a Llama-style model means the same model here."""
    model = {key: getattr(args, name) for name, key in MODEL_FLAGS.items() if getattr(args, name) is not None}
    seq_length = model.get("seq_length", config.get("seq_length"))
    if args.max_position_embeddings is not None and seq_length and args.max_position_embeddings < seq_length:
        raise UsageError(  # Megatron-LM's own rule, whatever the position embedding
            "--max-position-embeddings",
            f"{args.max_position_embeddings} is less than --seq-length {seq_length}: give at least that",
        )
    for flag, built in LLAMA_CHOICES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value != built:
            raise UsageError(
                flag,
                f"{flag} {value}: train builds Llama-style models ({flag} {built}); train this model "
                "with Megatron-LM's pretrain_gpt.py (scripts/slurm/launch.sh), or study it with simulate",
            )
    for flag in ("--hidden-dropout", "--attention-dropout"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:  # None (not given) or 0
            raise UsageError(
                flag,
                f"{flag} {value:g}: train runs without dropout (its losses are compared exactly across "
                "schedules); give 0, or train with Megatron-LM's pretrain_gpt.py",
            )
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UsageError(
            "--num-query-groups", "needs --group-query-attention (without it Megatron-LM ignores it)"
        )
    if args.group_query_attention:
        model["num_kv_heads"] = args.num_query_groups or 1  # Megatron-LM's default: one group
    elif args.num_attention_heads is not None:
        model["num_kv_heads"] = args.num_attention_heads  # Megatron-LM's default: no grouping
    experts = {key: getattr(args, name) for name, key in MOE_FLAGS.items() if getattr(args, name) is not None}
    if experts:
        model["extra"] = {**config.get("extra", {}), **experts}
    return model


def moe_layer_freq(text: str) -> int | list[int]:
    """Megatron-LM's ``--moe-layer-freq``: N (one MoE layer every N layers) or a Python list
    expression of 0s and 1s such as ``([0]*3+[1]*29)`` (three dense layers, then MoE)."""
    if text.strip().isdigit():
        return int(text)
    if not set(text) <= set("[]()0123456789*+, "):
        raise argparse.ArgumentTypeError(f"{text!r}: give N or a list expression like ([0]*3+[1]*29)")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # digits, brackets, * and + only (checked above)
    except Exception:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list expression like ([0]*3+[1]*29)") from None
    if not isinstance(value, list) or not set(value) <= {0, 1}:
        raise argparse.ArgumentTypeError(f"{text!r}: the list holds 0 (dense) and 1 (MoE) only")
    return value


def resolve_layout(settings: TrainSettings, launcher_world_size: int | None) -> TrainSettings:
    """Data-parallel size and microbatches per rank, as Megatron derives them: DP = world /
    (TP x CP x PP) under a launcher (``--data-parallel-size`` otherwise), microbatches = global
    batch / (micro batch size x DP)."""
    pp_flag, tp_flag, cp_flag = (
        "--pipeline-model-parallel-size",
        "--tensor-model-parallel-size",
        "--context-parallel-size",
    )
    sizes = (
        (pp_flag, settings.pp),
        (tp_flag, settings.tp),
        (cp_flag, settings.cp),
        ("--data-parallel-size", settings.dp),
    )
    for flag, size in (*sizes, ("--micro-batch-size", settings.micro_batch_size)):
        if size < 1:
            raise UsageError(flag, f"needs at least 1, got {size}")
    if launcher_world_size is not None:
        model_parallel = settings.tp * settings.cp * settings.pp
        if launcher_world_size % model_parallel:
            raise UsageError(
                pp_flag,
                f"the launcher started {launcher_world_size} processes, not a multiple of {tp_flag} x "
                f"{cp_flag} x {pp_flag} = {settings.tp} x {settings.cp} x {settings.pp}; start a multiple "
                f"of {model_parallel} processes",
            )
        settings = dataclasses.replace(settings, dp=launcher_world_size // model_parallel)
    if settings.global_batch_size is not None:
        per_step = settings.micro_batch_size * settings.dp
        if settings.global_batch_size % per_step or settings.global_batch_size < per_step:
            raise UsageError(
                "--global-batch-size",
                f"{settings.global_batch_size} is not a positive multiple of --micro-batch-size x DP "
                f"= {settings.micro_batch_size} x {settings.dp}",
            )
        settings = dataclasses.replace(settings, microbatches=settings.global_batch_size // per_step)
    return settings


def learning_rate(settings: TrainSettings, iteration: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``."""
    if iteration <= settings.warmup:
        return settings.lr * iteration / max(1, settings.warmup)
    progress = (iteration - settings.warmup) / max(1, settings.iterations - settings.warmup)
    return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * progress))


def scheduler_state(settings: TrainSettings) -> dict[str, Any]:
    """The learning-rate schedule (a function of the iteration), recorded as Megatron records its
    scheduler; the run's own flags decide it on resume."""
    return {
        "max_lr": settings.lr,
        "min_lr": settings.min_lr,
        "warmup_iters": settings.warmup,
        "decay_iters": settings.iterations,
    }
