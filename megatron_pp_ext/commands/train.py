"""``megatron-pp-ext train``: the main job.

A Megatron-style training loop on megatron-core's GPTModel, cut into pipeline stages, with the
schedule chosen by ``--pp-schedule``. It calls megatron-core's ``get_forward_backward_func()``
exactly as Megatron-LM's training loop does; our hook (``megatron_pp_ext.megatron.install``)
makes that return the chosen schedule. Bad input fails in the launching process, before any
worker starts.

Checkpoints (Megatron's ``--save``, ``--save-interval``, ``--load``, ``--ckpt-step``) are
megatron-core ``dist_checkpointing`` checkpoints of global tensors (``megatron/checkpoint.py``):
any schedule, placement or parallel layout loads them, and the run goes on from the saved
iteration and data position, bitwise on the same layout. A step whose gradients hold a NaN or an
inf is skipped and reported; a peer that dies or hangs ends every rank within
``--pp-p2p-timeout`` with the rank, op and peer named, and the last checkpoint intact.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..logs import Logs
from ..megatron import datasets
from ..megatron.hook import MEGATRON_FLAGS, OptionError, PipelineOptions, add_args
from ..stop import StopRequest
from .errors import JobError, UsageError

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
    timeout: float = 300.0
    save: str | None = None  # checkpoint directory (Megatron's --save)
    save_interval: int | None = None  # iterations between saves (and one at the end)
    load: str | None = None  # resume from this directory's latest checkpoint
    ckpt_step: int | None = None  # load this iteration instead of the latest
    load_optimizer: bool = True
    load_rng: bool = True
    post_validation: bool = False  # Zero Bubble's optimizer post-validation
    post_validation_chain: str = "measured"  # the partial state's order: measured, auto, up, down
    transformer_impl: str | None = None  # Megatron's --transformer-impl; None: use_te() decides
    # Megatron's --distributed-backend; None: NCCL on GPUs, gloo on CPU; gloo on GPUs shares them
    distributed_backend: str | None = None
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)

    def use_te(self, splits_backward: bool) -> bool:
        """Transformer Engine's layers: when asked for, else on a GPU where TE imports, for a
        schedule without a B/W split (TE's deferred weight gradient is not wired to W yet, and
        the generic split would compute TE's full weight gradient in B)."""
        from ..megatron.layer_spec import te_available

        if self.transformer_impl is not None:
            return self.transformer_impl == "transformer_engine"
        return te_available() and not splits_backward


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a megatron-core GPT with a pipeline schedule (the main job)",
        description="Train a megatron-core GPT over pipeline ranks with the schedule of --pp-schedule.",
    )
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"YAML file or a name in configs/ (default {DEFAULT_CONFIG})"
    )
    # Megatron's names (a command line moves to pretrain_gpt.py unchanged); --pp, --iterations
    # and --microbatches are this command's older spellings, kept as aliases.
    parser.add_argument(
        "--pipeline-model-parallel-size", "--pp", dest="pp", type=int, help="pipeline ranks (alias --pp)"
    )
    parser.add_argument("--tensor-model-parallel-size", dest="tp", type=int, help="tensor-parallel ranks")
    parser.add_argument(
        "--sequence-parallel", action="store_true", default=None, help="sequence parallelism (needs TP > 1)"
    )
    parser.add_argument(
        "--context-parallel-size",
        dest="cp",
        type=int,
        help="context-parallel ranks: each holds 2 of 2 x CP pieces of every slice (any schedule)",
    )
    parser.add_argument(
        "--data-parallel-size",
        dest="dp",
        type=int,
        help="data-parallel replicas when train starts the processes itself (under torchrun/srun: "
        "world size / (TP x CP x PP))",
    )
    parser.add_argument(
        "--global-batch-size", type=int, help="sequences per iteration over all data-parallel ranks"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        help="microbatches per iteration per data-parallel rank (instead of --global-batch-size)",
    )
    parser.add_argument("--micro-batch-size", type=int, help="sequences per microbatch")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence")
    parser.add_argument("--num-layers", type=int, help="transformer layers")
    parser.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        help="Megatron's: nccl (a GPU per rank; the default on GPUs) or gloo (the default on CPU; on "
        "GPUs the ranks share them, messages staged through host memory: a whole pipeline on one GPU)",
    )
    parser.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        help="Megatron's: Transformer Engine's layers, or megatron-core's local ones with fused SDPA "
        "attention (default: TE on a GPU where it imports, for schedules without a B/W split)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 weights and activations (fp32 loss, gradients reduced in fp32), as Megatron-LM's",
    )
    parser.add_argument("--train-iters", "--iterations", dest="iterations", type=int, help="optimizer steps")
    parser.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        default=None,
        help="the distributed optimizer's gradient layout (reduce-scatter over DP)",
    )
    parser.add_argument(
        "--overlap-grad-reduce", action="store_true", default=None, help="overlap the DP gradient reduction"
    )
    parser.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="divide the loss by the global batch's token count, not per microbatch (Megatron's "
        "flag; vocabulary parallelism with sequence slices needs it)",
    )
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument(
        "--clip-grad", type=float, help="clip gradients to this global L2 norm (0: no clipping)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also show megatron-core's start-up warnings (quiet.py)"
    )
    parser.add_argument("--seed", type=int, help="random seed (weights and data)")
    parser.add_argument(
        "--data", help="a byte-level text file to train on (default: Python stdlib docstrings)"
    )
    data = parser.add_argument_group("megatron-core's datasets (Megatron's flags)")
    data.add_argument(
        "--data-path",
        nargs="+",
        help="indexed .bin/.idx dataset prefixes, as Megatron takes them: PREFIX ... or weighted "
        "W1 PREFIX1 W2 PREFIX2 ... (megatron-core's GPTDataset, blended)",
    )
    data.add_argument(
        "--split", help=f"train,valid,test weights over --data-path (default {datasets.DEFAULT_SPLIT})"
    )
    data.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset")
    data.add_argument(
        "--tokenizer-type",
        help="the tokenizer of --data-path/--mock-data: NullTokenizer (ids 0..--vocab-size - 1, "
        "end of document --vocab-size)",
    )
    data.add_argument("--tokenizer-model", help="a tokenizer model (not read by NullTokenizer)")
    data.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary before end-of-document")
    data.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the model's vocabulary to a multiple of this x TP, as Megatron-LM (default 128)",
    )
    parser.add_argument("--metrics", help="write per-iteration metrics here as JSON lines")
    parser.add_argument(
        "--log-interval",
        type=int,
        help="Megatron's: every N iterations one line as Megatron-LM prints it (iteration, consumed "
        "samples, time per iteration, learning rate, batch size, lm loss, grad norm), above the bar",
    )
    parser.add_argument(
        "--eval-interval",
        type=int,
        help="Megatron's: a validation loss (forward only) every N iterations, printed as Megatron-LM "
        "prints it above the bar and written to --metrics",
    )
    parser.add_argument(
        "--eval-iters", type=int, help="Megatron's: iterations (global batches) per validation (default 100)"
    )
    parser.add_argument(
        "--tensorboard-dir",
        help="Megatron's: TensorBoard logs here, with Megatron-LM's tags (lm loss, learning-rate, "
        "grad-norm, iteration-time, batch-size) and each rank's bubble and peak memory at the end",
    )
    ckpt = parser.add_argument_group("checkpoints (Megatron's flags)")
    ckpt.add_argument("--save", help="save checkpoints to this directory (iter_XXXXXXX, atomically)")
    ckpt.add_argument("--save-interval", type=int, help="iterations between checkpoints (and one at the end)")
    ckpt.add_argument(
        "--load",
        help="resume from this directory's latest checkpoint (any schedule, placement or parallel "
        "layout may have written it); without one, start from scratch",
    )
    ckpt.add_argument("--ckpt-step", type=int, help="with --load: load this iteration, not the latest")
    ckpt.add_argument("--no-load-optim", action="store_true", help="with --load: fresh optimizer state")
    ckpt.add_argument("--no-load-rng", action="store_true", help="with --load: keep this run's RNG states")
    parser.add_argument(
        "--pp-post-validation",
        action="store_true",
        help="Zero Bubble's optimizer post-validation: each stage steps on a partial reduction of "
        "the gradient norm and NaN/inf state and rolls the step back if the global check fails "
        "(same result as the synchronous step, no wait for the global norm at the iteration end)",
    )
    parser.add_argument(
        "--pp-post-validation-chain",
        choices=("measured", "auto", "up", "down"),
        help="with --pp-post-validation, the order the partial state visits the pipeline ranks: "
        "the order they finish an iteration, as timed over the first iterations (measured, the "
        "default), as the schedule has it at unit costs (auto, reproducible), rank 0 to p-1 (up) "
        "or p-1 to 0 (down)",
    )
    add_args(parser)
    parser.set_defaults(run=run, pp_schedule=None, pp_seq_slices=None)  # None: the config's


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
    if args.seq_length is not None:
        model["seq_length"] = args.seq_length
    if args.num_layers is not None:
        model["num_layers"] = args.num_layers
    if args.bf16:
        model["dtype"] = "bfloat16"
    options = PipelineOptions.from_args(args)
    options = dataclasses.replace(
        options,
        measure_memory=True,  # train reports each rank's activation peak
        schedule=args.pp_schedule or pipeline.get("schedule", "1f1b"),
        chunks=args.pp_chunks if args.pp_chunks is not None else pipeline.get("chunks"),
        slices=args.pp_seq_slices if args.pp_seq_slices is not None else pipeline.get("slices", 1),
        slice_partition=args.pp_slice_partition or pipeline.get("slice_partition"),
    )
    unknown = set(training) - {f.name for f in dataclasses.fields(TrainSettings)}
    if unknown:
        raise UsageError("--config", f"{path}: unknown training keys {sorted(unknown)}")
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
        transformer_impl=args.transformer_impl,
        distributed_backend=args.distributed_backend,
        **training,
    )


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


def check(settings: TrainSettings) -> None:
    """Every check that can fail before processes start, each naming its flag."""
    from ..megatron.model import ModelConfig, split_layers

    try:
        model = ModelConfig(**settings.model)
    except (TypeError, ValueError) as error:
        # the model fields train has flags for are named by their flag
        flag = {"seq_length": "--seq-length", "num_layers": "--num-layers"}.get(
            str(error).split()[0], "--config"
        )
        raise UsageError(flag, f"model section: {error}" if flag == "--config" else str(error)) from None
    if model.unsupported():
        raise UsageError(
            "--config",
            f"train builds Llama-style models only (normalization=RMSNorm, activation=swiglu, "
            f"position_embedding=rope, bias=false, tied_embeddings=false); this config has "
            f"{', '.join(model.unsupported())}: train it with Megatron-LM's pretrain_gpt.py "
            "(scripts/slurm/launch.sh), or study it with simulate --model",
        )
    if settings.iterations < 1:  # (--micro-batch-size and the parallel sizes: resolve_layout)
        raise UsageError("--train-iters", f"needs at least 1, got {settings.iterations}")
    if not settings.lr > 0:
        raise UsageError("--lr", f"must be positive, got {settings.lr}")
    if not settings.pipeline.p2p_timeout > 0:
        raise UsageError(
            "--pp-p2p-timeout", f"must be positive (seconds), got {settings.pipeline.p2p_timeout}"
        )
    if settings.data is not None and not Path(settings.data).is_file():
        what = "a directory" if Path(settings.data).is_dir() else "no such file"
        raise UsageError("--data", f"{settings.data}: {what}; give a text file to train on, or leave it out")
    if settings.tensorboard_dir is not None:
        from .. import logs

        if not logs.available():
            raise UsageError("--tensorboard-dir", "needs the tensorboard package: pip install tensorboard")
    if settings.post_validation_chain != "measured" and not settings.post_validation:
        raise UsageError("--pp-post-validation-chain", "needs --pp-post-validation")
    if settings.log_interval < 1:
        raise UsageError("--log-interval", f"must be at least 1, got {settings.log_interval}")
    _check_eval(settings)
    if settings.clip_grad < 0:
        raise UsageError("--clip-grad", f"must be 0 (no clipping) or positive, got {settings.clip_grad}")
    _check_parallel(settings, model)
    _check_backend(settings)
    _check_checkpoints(settings)
    flags = dict(TRAIN_FLAGS)
    if settings.global_batch_size is not None:
        flags["--microbatches"] = "--global-batch-size"
    try:
        schedule = settings.pipeline.schedule_for(settings.pp, settings.microbatches, flags)
    except OptionError as error:
        raise UsageError(error.flag, error.reason) from None
    _check_transformer_impl(settings, schedule)
    try:
        split_layers(model.num_layers, schedule.num_stages)
    except ValueError as error:
        raise UsageError(
            "--num-layers",
            f"{error} ({settings.pipeline.schedule} on {settings.pp} pipeline ranks has "
            f"{schedule.num_stages} virtual stages; use a --num-layers of at least {schedule.num_stages})",
        ) from None
    if schedule.slices > 1:
        try:
            lengths = settings.pipeline.slice_lengths(schedule, model.seq_length, model.shape(), TRAIN_FLAGS)
        except OptionError as error:
            raise UsageError(error.flag, error.reason) from None
        for index, length in enumerate(lengths):
            what = f"slice {index} of {list(lengths)} (--pp-seq-slices {schedule.slices})"
            _check_cp_length(length, settings, "--pp-seq-slices", what)
        if settings.sequence_parallel and any(length % settings.tp for length in lengths):
            raise UsageError(
                "--pp-seq-slices",
                f"slices of {list(lengths)} tokens cannot be split over {settings.tp} tensor-parallel "
                "ranks (sequence parallelism): use fewer slices or a longer --seq-length",
            )


def _check_eval(settings: TrainSettings) -> None:
    """--eval-interval and --eval-iters, and a validation share of --data-path to read."""
    if settings.eval_interval is None:
        if settings.eval_iters != TrainSettings.eval_iters:
            raise UsageError("--eval-iters", "needs --eval-interval N (a validation loss every N iterations)")
        return
    if settings.eval_interval < 1:
        raise UsageError("--eval-interval", f"must be at least 1, got {settings.eval_interval}")
    if settings.eval_iters < 1:
        raise UsageError("--eval-iters", f"must be at least 1, got {settings.eval_iters}")
    if settings.dataset.data_path is not None and not datasets.split_weights(settings.dataset)[1] > 0:
        raise UsageError(
            "--split",
            f"{settings.dataset.split}: no validation share for --eval-interval (give it one, e.g. 98,2,0)",
        )


def _check_parallel(settings: TrainSettings, model: Any) -> None:
    """Tensor, sequence and context parallelism the model and runtime can take."""
    tp_flag = "--tensor-model-parallel-size"
    _check_cp_length(model.seq_length, settings, "--seq-length", f"--seq-length {model.seq_length}")
    if settings.sequence_parallel and settings.tp == 1:
        raise UsageError("--sequence-parallel", f"needs {tp_flag} > 1, or drop --sequence-parallel")
    for what, count in (
        ("attention heads", model.num_attention_heads),
        ("KV heads (num_kv_heads)", model.num_kv_heads),
        ("vocabulary", model.vocab_size),
        ("FFN width", model.ffn_hidden_size),
    ):
        if count % settings.tp:
            raise UsageError(tp_flag, f"{settings.tp} does not divide the model's {count} {what}")
    if settings.sequence_parallel and model.seq_length % settings.tp:
        raise UsageError(
            "--seq-length",
            f"{model.seq_length} is not divisible by {tp_flag} {settings.tp} (sequence parallelism)",
        )


def _check_backend(settings: TrainSettings) -> None:
    """``--distributed-backend``: NCCL needs GPUs; gloo on GPUs (ranks sharing them) runs
    pipeline parallelism only: the runtime stages its messages through host memory, but
    Megatron's tensor-, context- and data-parallel collectives (and the vocabulary passes) would
    hand gloo CUDA tensors it cannot move."""
    import torch

    flag, backend = "--distributed-backend", settings.distributed_backend
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError(flag, "nccl needs CUDA GPUs and this machine has none: drop it (CPU runs use gloo)")
    if backend != "gloo" or not torch.cuda.is_available():
        return
    for other, size in (
        ("--tensor-model-parallel-size", settings.tp),
        ("--context-parallel-size", settings.cp),
        ("--data-parallel-size", settings.dp),
    ):
        if size > 1:
            raise UsageError(
                flag,
                f"gloo on GPUs (ranks sharing them) runs pipeline parallelism only: drop {other} {size}, "
                "or use nccl with a GPU per rank",
            )
    if settings.pipeline.vocab_parallel != "none":
        raise UsageError(flag, "gloo on GPUs cannot run --pp-vocab-parallel's collectives: use nccl")


def _check_checkpoints(settings: TrainSettings) -> None:
    """Checkpoint flags that cannot work, and a --load whose checkpoint is missing, incomplete or
    of another model, fail here rather than in every worker."""
    from ..megatron.checkpoint import CheckpointError, find_checkpoint, read_common
    from ..megatron.model import ModelConfig

    if settings.save_interval is not None:
        if settings.save is None:
            raise UsageError("--save-interval", "needs --save DIR")
        if settings.save_interval < 1:
            raise UsageError("--save-interval", f"needs at least 1, got {settings.save_interval}")
    if settings.ckpt_step is not None and settings.load is None:
        raise UsageError("--ckpt-step", "needs --load DIR")
    if settings.save is not None:
        _check_writable(Path(settings.save))
    if settings.load is None:
        return
    flag = "--load" if settings.ckpt_step is None else "--ckpt-step"
    try:
        path = find_checkpoint(settings.load, settings.ckpt_step)
    except CheckpointError as error:
        raise UsageError(flag, str(error)) from None
    if path is None:
        _check_fresh_start(Path(settings.load), settings.save)
        return
    common = read_common(path)
    saved, ours = (
        ModelConfig(**common.get("layout", {}).get("model", settings.model)),
        ModelConfig(**settings.model),
    )
    for key in SHAPE_KEYS:
        if getattr(saved, key) != getattr(ours, key):
            raise UsageError(
                "--load",
                f"{path} holds a model with {key}={getattr(saved, key)}, this run has {getattr(ours, key)}",
            )
    consumed = common.get("consumed_train_samples", 0)
    if consumed % settings.micro_batch_size:
        raise UsageError(
            "--micro-batch-size",
            f"{path} consumed {consumed} samples, not a multiple of --micro-batch-size "
            f"{settings.micro_batch_size}: the data position cannot be restored",
        )


def _check_writable(save: Path) -> None:
    """``--save``: a directory this process can create and write in, before any step is spent."""
    if save.exists() and not save.is_dir():
        raise UsageError("--save", f"{save} is a file, not a directory")
    try:
        save.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError("--save", f"cannot create {save}: {error.strerror}") from None
    if not os.access(save, os.W_OK | os.X_OK):
        raise UsageError("--save", f"{save} is not writable by this user")


def _check_fresh_start(load: Path, save: str | None) -> None:
    """``--load`` without a checkpoint starts from scratch, as Megatron-LM does, when it is the
    ``--save`` directory (the same command starts and resumes a job); another directory that
    is missing, or holds files but no checkpoint, is a mistake."""
    if save is not None and load.resolve() == Path(save).resolve():
        return
    if not load.exists():
        raise UsageError(
            "--load",
            f"{load}: no such directory (to start fresh and resume later, give --save the same directory)",
        )
    if any(load.iterdir()):
        raise UsageError(
            "--load",
            f"{load} is not a checkpoint directory (no latest_checkpointed_iteration.txt): give the "
            "directory --save wrote",
        )


# Model fields a checkpoint's tensors depend on (the rest, e.g. seq_length, may change on resume).
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "dtype",
)


def _check_transformer_impl(settings: TrainSettings, schedule: Any) -> None:
    """``--transformer-impl transformer_engine`` needs TE importable on a GPU, and a schedule
    without a B/W split (as the pretrain_gpt.py hook refuses it)."""
    from ..megatron.layer_spec import te_available

    if settings.transformer_impl != "transformer_engine":
        return
    if not te_available():
        raise UsageError(
            "--transformer-impl",
            "transformer_engine needs Transformer Engine importable and a GPU: install it "
            '(pip install -e ".[gpu]") or use --transformer-impl local',
        )
    if schedule.splits_backward:
        raise UsageError(
            "--transformer-impl",
            f"{schedule.name} defers weight gradients (B/W split), which Transformer Engine's layers "
            "do not give to W yet: use --transformer-impl local (fused SDPA attention, deferrable "
            "linears)",
        )


def _check_cp_length(length: int, settings: TrainSettings, flag: str, what: str) -> None:
    """Context parallelism cuts a sequence (each slice, with a sliced schedule) into 2 x CP
    pieces, and under sequence parallelism a rank's share into TP parts."""
    cp = settings.cp
    if cp == 1:
        return
    if length % (2 * cp):
        raise UsageError(
            flag,
            f"{what}: {length} tokens cannot be cut into 2 x --context-parallel-size {cp} equal pieces; "
            f"use a length that is a multiple of {2 * cp}",
        )
    if settings.sequence_parallel and (length // cp) % settings.tp:
        raise UsageError(
            flag,
            f"{what}: a context-parallel rank's {length // cp} tokens cannot be split over "
            f"--tensor-model-parallel-size {settings.tp} (sequence parallelism)",
        )


def run(args: argparse.Namespace) -> int:
    from .. import launch

    settings = load_settings(args)
    world = launch.launcher_world()
    if (
        world is not None
        and args.dp is not None
        and world[1] != settings.tp * settings.cp * settings.pp * args.dp
    ):
        raise UsageError(
            "--data-parallel-size",
            f"the launcher started {world[1]} processes; DP under a launcher is world / (TP x CP x PP), "
            "drop --data-parallel-size",
        )
    settings = resolve_layout(settings, None if world is None else world[1])
    check(settings)
    world_size = settings.tp * settings.cp * settings.pp * settings.dp
    try:  # launch refuses more ranks than GPUs before it starts any (check_gpus)
        launch.run(
            worker, world_size, settings, grace_s=settings.timeout + 10, backend=settings.distributed_backend
        )
    except launch.LaunchError as error:
        layout = f"TP x CP x PP x DP = {settings.tp} x {settings.cp} x {settings.pp} x {settings.dp}"
        raise UsageError("--pipeline-model-parallel-size", f"{error} ({layout})") from None
    except launch.WorkerDied as error:
        raise JobError(fatal_message(settings, error, others="the other ranks stopped")) from None
    return 0


# ---- the worker: one pipeline rank ------------------------------------------------------------


def worker(rank: int, world_size: int, local_rank: int, settings: TrainSettings) -> None:
    import torch.distributed as dist

    from .. import launch

    device = launch.init_distributed(
        rank, world_size, local_rank, settings.timeout, settings.distributed_backend
    )
    request = StopRequest().install()
    try:
        train_loop(rank, settings, device, stop=request)
    except fatal_errors() as error:
        _fatal(rank, settings, error)
    except RuntimeError as error:
        if not any(word in str(error) for word in COMMUNICATION_FAILURES):
            raise
        _fatal(rank, settings, error)  # a collective with a dead or hung peer (gloo: RuntimeError)
    dist.destroy_process_group()


# How torch.distributed's backends word a failed or timed-out collective.
COMMUNICATION_FAILURES = ("gloo", "NCCL", "Timed out", "Connection reset", "Connection closed")


def fatal_errors() -> tuple[type[BaseException], ...]:
    """What a dead or hung peer raises: our p2p layer's error, torch.distributed's (anything
    else keeps its traceback)."""
    import torch.distributed as dist

    from ..runtime import PeerError

    return (PeerError, dist.DistError)


def _fatal(rank: int, settings: TrainSettings, error: BaseException) -> None:
    """One line naming the rank and the failure (p2p errors name the op and the peer) and the
    checkpoint to resume from; then exit at once: with a peer gone, tearing down the process
    groups could hang."""
    print(f"megatron-pp-ext train: rank {rank}: error: {fatal_message(settings, error)}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def fatal_message(settings: TrainSettings, error: BaseException, others: str = "") -> str:
    """The error's first line and, with --save, the checkpoint ``--load`` resumes from."""
    from ..megatron.checkpoint import iteration_dir, read_tracker

    message = _first_line(error)
    notes = getattr(error, "__notes__", [])
    message += f" ({notes[-1]})" if notes else ""
    message += f"; {others}" if others else ""
    latest = read_tracker(settings.save) if settings.save else None
    if latest is None:
        return message + ("; no checkpoint to resume from (no --save)" if not settings.save else "")
    return (
        f"{message}; the last checkpoint is {iteration_dir(settings.save, latest)}: resume with the "
        f"same command and --load {settings.save}"
    )


def _first_line(error: BaseException) -> str:
    """The error's first line without a backend's source location and advice (gloo prefixes
    ``[.../pair.cc:553]`` and appends a paragraph)."""
    line = (str(error).splitlines() or [type(error).__name__])[0]
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", line)
    return line.split(". This is typically caused by")[0]


def settings_from_argv(argv: list[str], world_size: int | None = None) -> TrainSettings:
    """The checked settings of ``megatron-pp-ext train ARGV`` (``world_size``: as under a
    launcher of that many processes), for tests and scripts that call :func:`train_loop`."""
    parser = argparse.ArgumentParser(prog="megatron-pp-ext")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", *argv])
    settings = resolve_layout(load_settings(args), world_size)
    check(settings)
    return settings


def train_loop(
    rank: int,
    settings: TrainSettings,
    device: Any,
    forward_step_func: Callable[..., Any] | None = None,
    stop: StopRequest | None = None,
) -> list[dict[str, Any]]:
    """Train in this process of an initialised ``torch.distributed`` job; return the per-iteration
    rows (the loss where it is reported, None elsewhere). Megatron's parallel state is set up and
    torn down here, so one process can run several jobs in a row (the tests do).
    ``forward_step_func`` replaces Megatron's forward step (tests inject faults with it); ``stop``
    ends the run early, saved, when a signal asks (``megatron_pp_ext/stop.py``)."""
    job = TrainJob(rank, settings, device, forward_step_func)
    job.stop = stop
    try:
        job.resume()
        try:
            rows = job.run()
        except BaseException as error:
            error.add_note(f"while in {job.phase}")  # fatal_message says where a peer was lost
            raise
        job.report()
        return rows
    finally:
        job.close()


class TrainJob:
    """One process's part of a training run: its model chunks in DDP, the optimizer, the data
    iterators, the checkpoint, and the iteration it is at."""

    def __init__(
        self, rank: int, settings: TrainSettings, device: Any, forward_step_func: Callable[..., Any] | None
    ) -> None:
        from ..megatron import cpu_shim, install
        from ..megatron.steps import forward_step

        self.rank, self.settings, self.device = rank, settings, device
        self.forward_step_func = forward_step_func or forward_step
        self.stop: StopRequest | None = None
        self.phase = "start-up"  # what the run is doing, for the line a fault prints
        cpu_shim.install()  # no-op with CUDA
        _init_parallel(settings)
        self.hook = install(options=settings.pipeline)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        import torch
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig

        from ..megatron.checkpoint import TrainingCheckpoint
        from ..megatron.ddp import wrap_chunks
        from ..megatron.model import (
            ModelConfig,
            build_chunks_from,
            build_reference,
            seed_like_megatron,
            split_layers,
        )
        from ..megatron.optimizer import OptimizerSettings, build_optimizer
        from ..schedule.iterations import completion_order

        settings = self.settings
        self.schedule = self.hook.schedule(settings.pp, settings.microbatches)
        extra = {
            **settings.model.get("extra", {}),
            "sequence_parallel": settings.sequence_parallel,
            "calculate_per_token_loss": settings.pipeline.calculate_per_token_loss,
        }
        self.model_config = ModelConfig(**{**settings.model, "extra": extra})
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        # Losses are reported per CP rank (its own tokens): summed over DP x CP. Data goes by DP rank.
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.dp_rank = parallel_state.get_data_parallel_rank()

        # Megatron-LM's seeds per stage and, on CUDA, its RNG tracker (dropout, Transformer Engine)
        seed_like_megatron(settings.seed)
        # Same weights whatever the schedule and layout: every stage copies its layers (its TP
        # shard) from one seeded model, initialised on the host (model.transformer_config).
        torch.manual_seed(settings.seed)
        use_te = settings.use_te(self.schedule.splits_backward)
        reference = build_reference(self.model_config, use_te=use_te)
        chunks, _ = build_chunks_from(
            reference,
            self.model_config,
            self.schedule.placement,
            pipeline_rank,
            use_te=use_te,
            sliced=self.schedule.slices > 1,
        )
        self.vocab = None
        if settings.pipeline.vocab_parallel != "none":
            from ..runtime.vocab_ops import setup_vocab_parallel
            from ..runtime.vocab_parallel import VocabGroups

            # Before DDP: the shard joins chunk 0's parameters (DDP, optimizer, clipping see it).
            self.vocab = setup_vocab_parallel(
                chunks,
                self.schedule.placement,
                pipeline_rank,
                self.model_config.vocab_size,
                self.model_config.hidden_size,
                settings.pipeline.vocab_parallel,
                dtype=self.model_config.torch_dtype,
                device=next(chunks[0].parameters()).device,
                sequence_parallel=settings.sequence_parallel,
                groups=VocabGroups.create(timeout_s=settings.pipeline.p2p_timeout),
            )
            # The reference holds this TP rank's Megatron shard of the tables (all of them at TP=1).
            self.vocab.vp.load_tp_shards(
                embedding=reference.embedding.word_embeddings.weight.detach(),
                output=reference.output_layer.weight.detach(),
            )
            self.hook.vocab = self.vocab
        del reference
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=settings.overlap_grad_reduce,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            # Megatron-LM's --accumulate-allreduce-grads-in-fp32, which it turns on for bf16
            grad_reduce_in_fp32=self.model_config.dtype == "bfloat16",
        )
        self.model = wrap_chunks(chunks, ddp_config)
        # post-validation's chain until the first iterations measured the order (_set_chain)
        self.unit_chain = completion_order(self.schedule)
        self.optimizer = build_optimizer(
            self.model,
            OptimizerSettings(
                lr=settings.lr, weight_decay=settings.weight_decay, clip_grad=settings.clip_grad
            ),
            bf16=self.model_config.dtype == "bfloat16",
            post_validation=settings.post_validation,
            # the partial gradient state goes from rank to rank in the order they finish
            chain=_chain(settings.post_validation_chain, self.unit_chain)
            if settings.post_validation
            else None,
        )
        if settings.post_validation:
            self.hook.gate = self._gate
        self.checkpoint = TrainingCheckpoint(
            self.model,
            self.optimizer,
            self.schedule.placement.stages_of(pipeline_rank),
            split_layers(self.model_config.num_layers, self.schedule.num_stages),
            layout=_layout(settings, self.schedule),
        )
        self.is_loss_rank = self.schedule.loss_rank == pipeline_rank
        shows = (
            self.is_loss_rank and self.dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
        )
        self.shows = shows and parallel_state.get_context_parallel_rank() == 0
        self.logs = Logs(None)  # the loop opens --tensorboard-dir on the rank that shows the loss
        # where the run is: what a checkpoint records besides the tensors
        self.position = {"iteration": 0, "consumed_train_samples": 0, "skipped_iterations": 0}
        self.step_times: list[float] = []
        self.bubbles: list[float] = []
        self.peak_activation = 0
        self.offloaded: int | None = None
        self.attention: tuple[int, int, int] | None = None  # own, served, handed away: last step
        self.communicators: tuple[int, float, bool] | None = None  # warmed, seconds, emulated

    def say(self, message: str) -> None:
        if self.shows:
            print(message, flush=True)

    def resume(self) -> None:
        """``--load``: the checkpoint's tensors, RNG and position (iteration, data)."""
        from ..megatron.checkpoint import find_checkpoint

        settings = self.settings
        if settings.load is None:
            return
        path = find_checkpoint(settings.load, settings.ckpt_step)
        if path is None:
            self.say(f"no checkpoint in {settings.load}: starting from scratch")
            return
        loaded = self.checkpoint.load(path, settings.load_optimizer, settings.load_rng)
        self.position = {key: int(loaded.get(key, value)) for key, value in self.position.items()}
        rng = "" if loaded["rng_restored"] else " (RNG states not restored: another layout)"
        self.say(
            f"loaded {path} at iteration {self.position['iteration']}, written by "
            f"{_describe(loaded.get('layout', {}))}{rng}"
        )

    def iterators(self, split: str = "train", first_sample: int | None = None) -> list[Any]:
        """One iterator per chunk, same seed: the chunk holding the embedding reads tokens, the one
        holding the loss reads labels, of the same microbatches. Each data-parallel rank takes every
        DP-th microbatch of the one stream (Megatron's sampler order), so the global batch is the
        same at every DP size; a resumed run starts after the samples consumed (``first_sample``:
        the validation split's). The byte-level text (data.py) or megatron-core's datasets
        (megatron/datasets.py, with Megatron's flags), ``split`` "train" or "valid"."""
        from .. import data

        settings = self.settings
        if first_sample is None:
            first_sample = self.position["consumed_train_samples"]
        if settings.dataset.megatron:
            if not hasattr(self, "datasets"):  # built once, on every rank together
                global_batch = settings.micro_batch_size * settings.microbatches * settings.dp
                evaluations = (
                    settings.iterations // settings.eval_interval + 1 if settings.eval_interval else 0
                )
                self.datasets = datasets.build_datasets(
                    settings.dataset,
                    settings.seed,
                    self.model_config.seq_length,
                    [settings.iterations * global_batch, evaluations * settings.eval_iters * global_batch, 0],
                )
            dataset = self.datasets[("train", "valid").index(split)]
            return [
                datasets.microbatches(
                    dataset, settings.micro_batch_size, settings.dp, self.dp_rank, first_sample
                )
                for _ in self.model
            ]
        tokens = data.encode(data.load_text(settings.data))
        train_tokens, valid_tokens = data.split_train_valid(tokens)
        if split == "valid":
            train_tokens = valid_tokens
        start = first_sample // settings.micro_batch_size
        seq = self.model_config.seq_length
        return [
            data.data_parallel_share(
                itertools.islice(
                    data.batches(train_tokens, seq, settings.micro_batch_size, settings.seed), start, None
                ),
                settings.dp,
                self.dp_rank,
            )
            for _ in self.model
        ]

    def run(self) -> list[dict[str, Any]]:
        import torch.distributed as dist

        from ..megatron.ddp import zero_grad_buffers
        from ..megatron.optimizer import optimizer_step

        settings = self.settings
        iterators = self.iterators()
        first = self.position["iteration"] + 1
        global_batch = settings.micro_batch_size * settings.microbatches * settings.dp
        valid_iterators = None
        if settings.eval_interval is not None:  # as Megatron-LM: on from the validations done
            done = (first - 1) // settings.eval_interval * settings.eval_iters * global_batch
            valid_iterators = self.iterators("valid", done)
        progress = _progress(settings.iterations, show=self.shows, initial=first - 1)
        metrics_file = (
            open(settings.metrics, "a" if first > 1 else "w") if settings.metrics and self.shows else None
        )
        self.logs = Logs(settings.tensorboard_dir if self.shows else None)
        rows: list[dict[str, Any]] = []
        unsettled = None  # post-validation: the last row, until its step's global check is in
        chain_timings: list[float] = []  # post-validation: this rank's iteration times, for the chain
        began = time.perf_counter()
        for iteration in range(first, settings.iterations + 1):
            timing_chain = (
                settings.post_validation
                and settings.post_validation_chain == "measured"
                and iteration < first + CHAIN_ITERATIONS
            )
            if not settings.post_validation:
                zero_grad_buffers(self.model)
            # under post-validation the runtime settles the previous step at this step's gate and
            # zeroes the gradients there (_gate); no barrier once the chain is measured, or the
            # boundary bubble comes back
            if not settings.post_validation or timing_chain:
                self.phase = f"the barrier that starts iteration {iteration} (every rank)"
                dist.barrier()  # every rank starts together: comparable step times
            start = time.perf_counter()
            self.phase = f"the pipeline step of iteration {iteration}"
            losses = self._pipeline_step(iterators, forward_only=False)
            if unsettled is not None:
                self._emit(unsettled, self.optimizer.last, progress, metrics_file)
                unsettled = None
            if timing_chain:
                chain_timings.append(time.perf_counter() - start)
                if len(chain_timings) == CHAIN_ITERATIONS:
                    self._set_chain(chain_timings, progress)
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(settings, iteration)
            self.phase = (
                f"the optimizer step of iteration {iteration} (gradients over the data-parallel ranks)"
            )
            step = optimizer_step(self.optimizer, self.model)
            elapsed = time.perf_counter() - start
            self._measure(elapsed)
            self.position["iteration"] = iteration
            self.position["consumed_train_samples"] += global_batch
            loss = self._global_loss(losses) if self.is_loss_rank else None
            row = {
                "iteration": iteration,
                "samples": self.position["consumed_train_samples"],
                "learning_rate": learning_rate(settings, iteration),
                "batch_size": global_batch,
                "loss": loss if self.shows else None,
                "step_time": elapsed,
                "wall_time": time.perf_counter() - began,  # this rank's clock since the first iteration
                "offloaded_bytes": self.offloaded,
                "restarted": self.hook.last_result.restarted,
            }
            rows.append(row)
            # as Megatron-LM: every --save-interval iterations, and always the last one
            save = settings.save is not None and (
                iteration == settings.iterations
                or bool(settings.save_interval and iteration % settings.save_interval == 0)
            )
            evaluate = valid_iterators is not None and iteration % settings.eval_interval == 0
            if evaluate:
                if not step.settled:
                    self.optimizer.settle()  # the validation sees the checked step's weights
                self.phase = f"the validation after iteration {iteration}"
                row["validation_loss"] = self._evaluate(valid_iterators)
            if step.settled:
                self._emit(row, step, progress, metrics_file)
            elif save or evaluate or iteration == settings.iterations:
                self.optimizer.settle()  # a checkpoint (or the run's end) takes the checked step
                self._emit(row, self.optimizer.last, progress, metrics_file)
            else:
                unsettled = row
            if save:
                self.save(progress)
            if (
                self.stop is not None
                and iteration < settings.iterations
                and self._stopped(iteration, save, progress)
            ):
                break
        if self.stop is not None:
            self.stop.finish()
        progress.close()
        if metrics_file:
            metrics_file.close()
        self.logs.close()
        return rows

    def _set_chain(self, timings: list[float], progress: Any) -> None:
        """Post-validation: pass the partial gradient state in the order the ranks of this
        pipeline finish their part of an iteration, as measured (from a barrier) over the first
        iterations but the very first. The schedule's order at unit costs can be wrong on a real
        machine: under ZB-H2 rank 0 ends first only while B + p2p < 2 W."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
        timed = timings[1:] or timings  # the first iteration warms up (allocations, groups)
        from .. import launch

        device = launch.collective_device(self.device)
        mine = torch.tensor([sum(timed) / len(timed)], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        times = [float(item) for item in gathered]
        chain = sorted(reversed(range(len(times))), key=lambda rank: times[rank])  # ties: higher first
        self.optimizer.validation.set_chain(chain)
        if self.shows:  # above the progress bar
            progress.write(
                "post-validation: partial state along "
                + " > ".join(f"rank {rank} ({times[rank] * 1e3:.0f} ms)" for rank in chain)
                + f" (schedule's order at unit costs: {' > '.join(map(str, self.unit_chain))})"
            )

    def _pipeline_step(self, iterators: list[Any], forward_only: bool) -> list[Any]:
        """One global batch through the schedule, by Megatron's ``get_forward_backward_func()``
        (the installed hook): the loss dicts on the loss rank."""
        from megatron.core import pipeline_parallel

        return pipeline_parallel.get_forward_backward_func()(
            forward_step_func=self.forward_step_func,
            data_iterator=iterators,
            model=self.model,
            num_microbatches=self.settings.microbatches,
            seq_length=self.model_config.seq_length,
            micro_batch_size=self.settings.micro_batch_size,
            forward_only=forward_only,
        )

    def _evaluate(self, iterators: list[Any]) -> float | None:
        """Megatron-LM's ``evaluate``: --eval-iters forward-only steps through the schedule, the
        loss token-weighted over all of them and the data-parallel ranks (on the loss rank)."""
        import torch
        import torch.distributed as dist

        settings = self.settings
        sums = torch.zeros(2, dtype=torch.float64)
        for _ in range(settings.eval_iters):
            losses = self._pipeline_step(iterators, forward_only=True)
            if self.is_loss_rank:
                step = torch.stack([sum(item["lm loss"][i] for item in losses) for i in (0, 1)])
                sums += step.detach().double().cpu()
        if not self.is_loss_rank:
            return None
        from .. import launch

        sums = sums.to(launch.collective_device(self.device))
        dist.all_reduce(sums, group=self.dp_group)
        return float(sums[0] / sums[1])

    def _gate(self) -> bool:
        """Post-validation, at the validation gate of a step: settle the previous optimizer step
        (its global check; a failed one is rolled back and redone), then zero the gradients it
        used. False: the step restarts (its forwards ran with rolled-back weights)."""
        from ..megatron.ddp import zero_grad_buffers

        kept = self.optimizer.settle()
        zero_grad_buffers(self.model)
        return kept

    def _emit(self, row: dict[str, Any], step: Any, progress: Any, metrics_file: Any) -> None:
        """Complete an iteration's row with its (settled) optimizer step; show and record it."""
        row.update(
            grad_norm=step.grad_norm,
            skipped=step.skipped,
            optimistic=step.optimistic,
            rolled_back=step.rolled_back,
        )
        self.position["skipped_iterations"] += int(step.skipped)
        if not self.shows:
            return
        iteration, loss = row["iteration"], row["loss"]
        postfix = {
            "loss": f"{loss:.3f}",
            "step": f"{row['step_time']:.2f}s",
            "gnorm": f"{step.grad_norm:.2f}",
        }
        if self.position["skipped_iterations"]:
            postfix["skipped"] = str(self.position["skipped_iterations"])
        progress.set_postfix(postfix)
        if step.skipped:
            progress.write(
                f"iteration {iteration}: optimizer step skipped: gradient norm {step.grad_norm} "
                f"(NaN/inf), loss {loss}; {self.position['skipped_iterations']} skipped so far"
            )
        if iteration % self.settings.log_interval == 0:
            progress.write(log_line(row, self.settings.iterations))
        if "validation_loss" in row:
            line = validation_line(iteration, row["validation_loss"])
            progress.write("\n".join(("-" * len(line), line, "-" * len(line))))
        progress.update(1)
        if metrics_file:
            extra = ("validation_loss",) if "validation_loss" in row else ()
            metrics_file.write(json.dumps({key: row[key] for key in (*METRICS, *extra)}) + "\n")
            metrics_file.flush()
        self.logs.iteration(
            iteration,
            row["samples"],
            loss,
            row["learning_rate"],
            step.grad_norm,
            row["step_time"],
            row["batch_size"],
        )

    def _stopped(self, iteration: int, saved: bool, progress: Any) -> bool:
        """At an iteration's end: whether a signal asked any rank to stop (all ranks agree, one
        iteration later: ``stop.py``); if so, save (unless this iteration just did) and say how to
        resume."""
        from .. import launch

        assert self.stop is not None
        self.phase = f"the stop check at the end of iteration {iteration} (every rank)"
        comm = self.hook.comm
        name = self.stop.agreed(launch.collective_device(self.device), comm.launch if comm else None)
        if name is None:
            return False
        settings = self.settings
        if settings.save is not None and not saved:
            self.optimizer.settle()
            self.save(progress)
        if self.shows:
            from ..megatron.checkpoint import iteration_dir

            if settings.save is not None:
                where = (
                    f"saved {iteration_dir(settings.save, iteration)}; resume with the same command "
                    f"and --load {settings.save}"
                )
            else:
                where = "nothing saved (no --save)"
            progress.write(f"stopped by {name} after iteration {iteration}: {where}")
        return True

    def save(self, progress: Any) -> None:
        self.phase = f"saving the checkpoint of iteration {self.position['iteration']}"
        start = time.perf_counter()
        common = {**self.position, "opt_param_scheduler": _scheduler_state(self.settings)}
        path = self.checkpoint.save(self.settings.save, self.position["iteration"], common)
        if self.shows:
            progress.write(f"saved {path} in {time.perf_counter() - start:.2f}s")

    def _global_loss(self, losses: list[Any]) -> float:
        """The loss of the whole global batch: token-weighted over the data-parallel ranks."""
        import torch
        import torch.distributed as dist

        sums = torch.stack([sum(item["lm loss"][i] for item in losses) for i in (0, 1)]).double()
        dist.all_reduce(sums, group=self.dp_group)
        return float(sums[0] / sums[1])

    def _measure(self, elapsed: float) -> None:
        result = self.hook.last_result
        self.step_times.append(elapsed)
        self.bubbles.append(min(1.0, self.hook.last_wait_seconds / elapsed))
        self.peak_activation = max(self.peak_activation, result.peak_activation_bytes)
        self.offloaded = result.offload.offloaded_bytes if result.offload is not None else None
        if result.attention is not None:
            self.attention = result.attention.totals()
        creation = self.hook.last_creation
        self.communicators = (len(creation.created), creation.warm_up_seconds, creation.emulate)

    def report(self) -> None:
        if self.step_times:
            rows = _report(
                self.rank,
                self.settings,
                self.schedule,
                self.step_times,
                self.bubbles,
                self.peak_activation,
                self.offloaded,
                self.device,
                self.attention,
                self.communicators,
            )
            if self.rank == 0 and self.settings.tensorboard_dir is not None:
                logs = Logs(self.settings.tensorboard_dir)
                logs.ranks(self.position["iteration"], rows)
                logs.close()

    def close(self) -> None:
        from megatron.core import parallel_state

        vocab = getattr(self, "vocab", None)
        if vocab is not None:
            vocab.vp.close()
        self.hook.uninstall()
        parallel_state.destroy_model_parallel()


# Post-validation: iterations timed from a barrier to measure the ranks' completion order.
CHAIN_ITERATIONS = 3


def _chain(name: str, unit_chain: list[int]) -> list[int]:
    """The first chain of ``--pp-post-validation-chain`` (measured: the schedule's until timed)."""
    pp = len(unit_chain)
    return {"up": list(range(pp)), "down": list(reversed(range(pp)))}.get(name, unit_chain)


METRICS = (
    "iteration",
    "loss",
    "step_time",
    "wall_time",
    "grad_norm",
    "skipped",
    "rolled_back",
    "restarted",
    "offloaded_bytes",
)


def _init_parallel(settings: TrainSettings) -> None:
    """Megatron's parallel state with our timeout on its groups: a dead peer in a collective
    fails within ``--pp-p2p-timeout``, not Megatron's default 30 minutes."""
    from megatron.core import parallel_state

    from ..megatron.model import init_parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=settings.tp,
            pipeline_model_parallel_size=settings.pp,
            context_parallel_size=settings.cp,
            distributed_timeout_minutes=settings.timeout / 60,
            create_gloo_process_groups=False,
        )
    init_parallel_state(settings.pp, settings.tp, settings.cp)  # checks the sizes


def _layout(settings: TrainSettings, schedule: Any) -> dict[str, Any]:
    """What wrote a checkpoint: schedule, parallel sizes (RNG states are restored only under the
    same) and model (a load of another model's checkpoint is refused before start)."""
    return {
        "schedule": schedule.name,
        "vpp": schedule.vpp,
        "slices": schedule.slices,
        "parallel": {"pp": settings.pp, "tp": settings.tp, "cp": settings.cp, "dp": settings.dp},
        "model": dict(settings.model),
    }


def _describe(layout: dict[str, Any]) -> str:
    sizes = " ".join(f"{key}={value}" for key, value in layout.get("parallel", {}).items())
    return f"{layout.get('schedule', 'an unknown schedule')} {sizes}".strip()


def _scheduler_state(settings: TrainSettings) -> dict[str, Any]:
    """The learning-rate schedule (a function of the iteration), recorded as Megatron records its
    scheduler; the run's own flags decide it on resume."""
    return {
        "max_lr": settings.lr,
        "min_lr": settings.min_lr,
        "warmup_iters": settings.warmup,
        "decay_iters": settings.iterations,
    }


def log_line(row: dict[str, Any], iterations: int) -> str:
    """An iteration as Megatron-LM's training log prints it (the fields ``train`` has)."""
    return (
        f" iteration {row['iteration']:8d}/{iterations:8d} |"
        f" consumed samples: {row['samples']:12d} |"
        f" elapsed time per iteration (ms): {row['step_time'] * 1000:.1f} |"
        f" learning rate: {row['learning_rate']:.6E} |"
        f" global batch size: {row['batch_size']:5d} |"
        f" lm loss: {row['loss']:.6E} |"
        f" grad norm: {row['grad_norm']:.3f} |"
        f" number of skipped iterations: {int(row['skipped']):3d} |"
    )


def validation_line(iteration: int, loss: float) -> str:
    """A validation loss as Megatron-LM's ``evaluate_and_print_results`` prints it."""
    ppl = math.exp(min(20, loss))
    return (
        f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    )


def learning_rate(settings: TrainSettings, iteration: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``."""
    if iteration <= settings.warmup:
        return settings.lr * iteration / max(1, settings.warmup)
    progress = (iteration - settings.warmup) / max(1, settings.iterations - settings.warmup)
    return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1 + math.cos(math.pi * progress))


def _progress(total: int, show: bool, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="it",
        disable=not show,
        file=sys.stdout,
        dynamic_ncols=True,
    )


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
    communicators: tuple[int, float, bool] | None = None,
) -> list[dict[str, Any]]:
    """Print every rank's steady-state figures on rank 0; return them (every rank gets all)."""
    import torch

    from .. import launch

    steady = step_times[1:] or step_times
    row = {
        "rank": rank,
        "step_time": sum(steady) / len(steady),
        "bubble": (sum(bubbles[1:] or bubbles) / len(bubbles[1:] or bubbles)) if bubbles else None,
        "peak_activation_mib": peak_activation / 2**20,
        "offloaded_mib": None if offloaded is None else offloaded / 2**20,
        "attention": attention,
        "communicators": communicators,
        "max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    }
    rows = launch.gather_objects(row)
    if rank == 0:
        sp = " sp" if settings.sequence_parallel else ""
        cp = f" cp={settings.cp}" if settings.cp > 1 else ""
        print(
            f"\n{schedule.name}: pp={settings.pp} tp={settings.tp}{sp}{cp} "
            f"dp={settings.dp} m={settings.microbatches} v={schedule.vpp} "
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
            if item["communicators"] is not None:
                count, seconds, emulated = item["communicators"]
                rule = ", NCCL's rules emulated" if emulated else ""
                moved += f"  communicators {count} (warm-up {seconds * 1e3:.0f} ms{rule})"
            print(
                f"  rank {item['rank']}: step {item['step_time']:.3f} s  bubble {bubble}  "
                f"peak activation {item['peak_activation_mib']:.2f} MiB{moved}{gpu}"
            )
        sys.stdout.flush()
    return rows
