"""The checks a training run passes before any process starts: each one names the flag to
change (a :class:`UsageError`, exit status 2), so bad input fails once, in the launching process,
rather than in every worker after start-up. torch and megatron-core are imported only by the
checks that need them (a GPU question, a checkpoint to read), so most bad input fails at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import logs
from ..errors import UsageError
from ..megatron import datasets
from ..megatron.hook import OptionError
from ..megatron.model_config import ModelConfig
from ..schedule.run_costs import RunShape
from .settings import MODEL_FLAGS, MOE_FLAGS, TRAIN_FLAGS, TrainSettings


def check(settings: TrainSettings) -> None:
    """Every check that can fail before processes start, each naming its flag."""
    try:
        model = ModelConfig(**settings.model)
    except (TypeError, ValueError) as error:
        # the model fields train has flags for are named by their flag
        flags = {key: "--" + name.replace("_", "-") for name, key in MODEL_FLAGS.items()}
        flag = flags.get(str(error).split()[0], "--config")
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
        if not logs.available():
            raise UsageError("--tensorboard-dir", "needs the tensorboard package: pip install tensorboard")
    _check_profiling(settings)
    if settings.post_validation_chain != "measured" and not settings.post_validation:
        raise UsageError("--pp-post-validation-chain", "needs --pp-post-validation")
    if settings.optimizer == "megatron":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--pp-optimizer", "megatron: megatron-core's optimizer needs CUDA; use torch or auto"
            )
        if settings.post_validation:
            raise UsageError(
                "--pp-optimizer",
                "megatron: post-validation rolls steps back with torch's optimizer; use torch",
            )
    if settings.log_interval < 1:
        raise UsageError("--log-interval", f"must be at least 1, got {settings.log_interval}")
    _check_eval(settings)
    if settings.clip_grad < 0:
        raise UsageError("--clip-grad", f"must be 0 (no clipping) or positive, got {settings.clip_grad}")
    _check_parallel(settings, model)
    _check_experts(settings, model)
    _check_backend(settings)
    _check_checkpoints(settings)
    flags = dict(TRAIN_FLAGS)
    if settings.global_batch_size is not None:
        flags["--microbatches"] = "--global-batch-size"
    if settings.chunks_flag is not None:
        flags["--vpp"] = settings.chunks_flag
    # the schedule checked is the one the run runs: its costs from the run's layers per stage
    run = RunShape(model.shape(), model.seq_length, settings.layers_per_stage)
    try:
        schedule = settings.pipeline.schedule_for(settings.pp, settings.microbatches, flags, run)
    except OptionError as error:
        raise UsageError(error.flag, error.reason) from None
    _check_transformer_impl(settings, schedule)
    if model.extra.get("moe_grouped_gemm") and schedule.splits_backward:
        raise UsageError(
            "--moe-grouped-gemm",
            f"{schedule.name} defers weight gradients to W ops, and Transformer Engine's grouped expert "
            "linears are not yet covered by them: drop --moe-grouped-gemm (SequentialMLP experts) or "
            "use a schedule without a B/W split (1f1b, interleaved-1f1b)",
        )
    if schedule.slices > 1:
        _check_sliced_experts(model)
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


def _check_profiling(settings: TrainSettings) -> None:
    """Megatron's profiling window and flags, and ``--pp-timeline``: each honoured or refused."""
    options = settings.pipeline
    if options.timeline or options.op_ranges:
        from ..runtime.timeline import window_refusal  # torch only when profiling is asked for

        refusal = window_refusal(
            options.timeline, options.profile_step_start, options.profile_step_end, settings.iterations
        )
        if refusal is not None:
            raise UsageError(*refusal)
    if settings.use_pytorch_profiler and settings.tensorboard_dir is None:
        raise UsageError(
            "--use-pytorch-profiler", "writes its trace to --tensorboard-dir (as Megatron-LM): add it"
        )
    if settings.profile:
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--profile",
                "NVTX ranges for nsys need a GPU; on this machine use --pp-timeline FILE.json or "
                "--use-pytorch-profiler",
            )


def _check_pairing(settings: TrainSettings, extra: dict[str, Any]) -> None:
    """``--overlap-moe-expert-parallel-comm``: what the pairs need of the model, before any
    process starts (the runtime checks the same again on the built chunks)."""
    from types import SimpleNamespace

    from ..runtime.expert_overlap import FLAG, config_refusal

    config = SimpleNamespace(
        **extra, tensor_model_parallel_size=settings.tp, context_parallel_size=settings.cp
    )
    why = config_refusal(config, on_host=settings.distributed_backend != "nccl")
    if why is not None:
        raise UsageError(FLAG, why)


def _check_experts(settings: TrainSettings, model: Any) -> None:
    """Mixture-of-experts settings megatron-core can build and this machine can run, each
    refused by its flag (its TransformerConfig field in a config's ``model: extra:``)."""
    extra = model.extra
    experts = extra.get("num_moe_experts")
    if settings.pipeline.overlap_moe_expert_parallel_comm:
        _check_pairing(settings, extra)
    if experts is None:
        flags = {key: "--" + name.replace("_", "-") for name, key in MOE_FLAGS.items()}
        given = [flags.get(key, key) for key in extra if key.startswith(("moe_", "expert_"))]
        if given:
            raise UsageError("--num-experts", f"{', '.join(given)} given without --num-experts: add it")
        return
    topk, ep = extra.get("moe_router_topk", 2), extra.get("expert_model_parallel_size", 1)
    etp = extra.get("expert_tensor_parallel_size", settings.tp)
    if experts < 1:
        raise UsageError("--num-experts", f"needs at least 1, got {experts}")
    if not 1 <= topk <= experts:
        raise UsageError("--moe-router-topk", f"{topk}: give 1 to --num-experts {experts}")
    if ep < 1 or experts % ep:
        raise UsageError("--expert-model-parallel-size", f"{ep} must divide --num-experts {experts}")
    if etp != settings.tp and ep == 1:
        raise UsageError(
            "--expert-tensor-parallel-size",
            f"{etp} differs from --tensor-model-parallel-size {settings.tp} with one expert-parallel rank: "
            "megatron-core then reduces the experts' gradients as dense ones, not over the tensor-parallel "
            "ranks that each saw part of the tokens; give --expert-model-parallel-size > 1 or drop it",
        )
    if settings.tp > 1 and not settings.sequence_parallel:
        raise UsageError(
            "--sequence-parallel",
            "--sequence-parallel: megatron-core's MoE layers with tensor parallelism need it: add it",
        )
    ranks = settings.tp * settings.cp * settings.dp  # the ranks of one pipeline stage
    if etp < 1 or ranks % (ep * etp):
        raise UsageError(
            "--expert-model-parallel-size",
            f"EP {ep} x expert TP {etp} must divide the {ranks} ranks of a pipeline stage "
            f"(TP x CP x DP = {settings.tp} x {settings.cp} x {settings.dp}): raise --data-parallel-size",
        )
    if settings.post_validation and (ep > 1 or etp != settings.tp):
        raise UsageError(
            "--pp-post-validation",
            "not with experts split over other ranks than the dense weights (EP > 1 or another expert "
            "TP): its partial gradient norm follows the pipeline ranks only; drop it",
        )
    from ..megatron.model import experts_refusal_here, moe_pattern

    try:
        moe_pattern(model)
    except ValueError as error:
        raise UsageError("--moe-layer-freq", str(error)) from None
    refusal = experts_refusal_here(
        extra.get("moe_token_dispatcher_type", "allgather"), bool(extra.get("moe_grouped_gemm"))
    )
    if refusal is not None:
        raise UsageError(*refusal)


def _check_sliced_experts(model: Any) -> None:
    """A sequence-sliced schedule refuses what the runtime would refuse at its first step
    (``runtime.slicing.check_sliced_moe``), named by the first flag that asks for it."""
    from types import SimpleNamespace

    from ..runtime.slicing import check_sliced_moe

    fields = {"moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "aux_loss", **model.extra}
    try:
        check_sliced_moe(SimpleNamespace(**fields))
    except ValueError as error:
        raise UsageError(str(error).split()[0], str(error)) from None


def _check_backend(settings: TrainSettings) -> None:
    """``--distributed-backend``: NCCL needs GPUs; gloo on GPUs (ranks sharing them) runs
    pipeline and data parallelism: the runtime stages its messages through host memory, and
    Megatron's DDP and post-validation theirs (``megatron/gloo_on_gpu.py``), but Megatron's
    tensor- and context-parallel collectives (sequence parallelism's reduce-scatter) and the
    vocabulary passes would hand gloo CUDA tensors it cannot move."""
    flag, backend = "--distributed-backend", settings.distributed_backend
    if backend is None:
        return
    import torch

    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError(flag, "nccl needs CUDA GPUs and this machine has none: drop it (CPU runs use gloo)")
    if backend != "gloo" or not torch.cuda.is_available():
        return
    for other, size in (
        ("--tensor-model-parallel-size", settings.tp),
        ("--context-parallel-size", settings.cp),
    ):
        if size > 1:
            raise UsageError(
                flag,
                f"gloo on GPUs (ranks sharing them) runs pipeline and data parallelism only: "
                f"drop {other} {size}, or use nccl with a GPU per rank",
            )
    if settings.pipeline.vocab_parallel != "none":
        raise UsageError(flag, "gloo on GPUs cannot run --pp-vocab-parallel's collectives: use nccl")


def _check_checkpoints(settings: TrainSettings) -> None:
    """Checkpoint flags that cannot work, and a --load whose checkpoint is missing, incomplete or
    of another model, fail here rather than in every worker."""
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
    load = Path(settings.load)
    if load.exists() and not load.is_dir():
        raise UsageError("--load", f"{load} is not a directory: give the directory --save wrote")
    from ..megatron.checkpoint import CheckpointError, find_checkpoint, read_common  # torch

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
    """``--transformer-impl transformer_engine`` needs TE importable on a GPU, and for a schedule
    with a B/W split a TE that defers weight gradients (as the pretrain_gpt.py hook checks)."""
    if settings.transformer_impl != "transformer_engine":
        return
    from ..megatron import layer_spec  # torch and megatron-core

    if not layer_spec.te_available():  # looked up at each call: tests stand it in
        raise UsageError(
            "--transformer-impl",
            "transformer_engine needs Transformer Engine importable and a GPU: install it "
            '(pip install -e ".[gpu]") or use --transformer-impl local',
        )
    refusal = layer_spec.te_wgrad_refusal(schedule.name) if schedule.splits_backward else None
    if refusal is not None:
        raise UsageError("--transformer-impl", refusal)


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
