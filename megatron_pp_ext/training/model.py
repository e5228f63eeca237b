"""This rank's model for a training run: Megatron's parallel state, the chunks the schedule places
here (copied from one seeded model, so every schedule and layout starts from the same weights),
the vocabulary shard under ``--pp-vocab-parallel``, and Megatron's DDP around them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig

from ..megatron.ddp import wrap_chunks
from ..megatron.model import (
    ModelConfig,
    build_chunks_from,
    build_reference,
    init_parallel_state,
    seed_like_megatron,
)
from ..megatron.vocabulary import shard_vocabulary

if TYPE_CHECKING:  # for annotations only: no import edge, a shorter import chain
    from .settings import TrainSettings


def init_parallel(settings: TrainSettings) -> None:
    """Megatron's parallel state with our timeout on its groups: a dead peer in a collective
    fails within ``--pp-p2p-timeout``, not Megatron's default 30 minutes."""
    experts = settings.model.get("extra", {})
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=settings.tp,
            pipeline_model_parallel_size=settings.pp,
            context_parallel_size=settings.cp,
            expert_model_parallel_size=experts.get("expert_model_parallel_size", 1),
            expert_tensor_parallel_size=experts.get("expert_tensor_parallel_size"),
            distributed_timeout_minutes=settings.timeout / 60,
            create_gloo_process_groups=False,
        )
    init_parallel_state(settings.pp, settings.tp, settings.cp)  # checks the sizes


def model_config(settings: TrainSettings) -> ModelConfig:
    """The config's model with the run's sequence parallelism and per-token loss."""
    extra = {
        **settings.model.get("extra", {}),
        "sequence_parallel": settings.sequence_parallel,
        "calculate_per_token_loss": settings.pipeline.calculate_per_token_loss,
    }
    return ModelConfig(**{**settings.model, "extra": extra})


def layer_list(settings: TrainSettings) -> list[int] | None:
    """The run's layers per virtual stage as the builders take them (None: their even split)."""
    return None if settings.layers_per_stage is None else list(settings.layers_per_stage)


def build_model(
    settings: TrainSettings, config: ModelConfig, schedule: Any, pipeline_rank: int
) -> tuple[list[Any], Any]:
    """This rank's chunks in DDP, and the vocabulary-parallel set-up (None without
    ``--pp-vocab-parallel``; closed here if a later part of the build fails)."""
    # Megatron-LM's seeds per stage and, on CUDA, its RNG tracker (dropout, Transformer Engine)
    seed_like_megatron(settings.seed)
    # Same weights whatever the schedule and layout: every stage copies its layers (its TP
    # shard) from one seeded model, initialised on the host (model.transformer_config).
    torch.manual_seed(settings.seed)
    use_te = settings.use_te(schedule.splits_backward)
    reference = build_reference(config, use_te=use_te)
    chunks, _ = build_chunks_from(
        reference,
        config,
        schedule.placement,
        pipeline_rank,
        layer_list(settings),
        use_te=use_te,
        sliced=schedule.slices > 1,
        defer_te_wgrad=schedule.splits_backward,
    )
    # Before DDP: the shard joins chunk 0's parameters (DDP, optimizer, clipping see it).
    vocab = _shard_vocabulary(settings, config, schedule, pipeline_rank, chunks, reference)
    del reference
    try:
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=settings.overlap_grad_reduce,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            # Megatron-LM's --accumulate-allreduce-grads-in-fp32, which it turns on for bf16
            grad_reduce_in_fp32=config.dtype == "bfloat16",
        )
        return wrap_chunks(chunks, ddp_config), vocab
    except BaseException:
        if vocab is not None:
            vocab.vp.close()
        raise


def _shard_vocabulary(
    settings: TrainSettings,
    config: ModelConfig,
    schedule: Any,
    pipeline_rank: int,
    chunks: list[Any],
    reference: Any,
) -> Any:
    """``--pp-vocab-parallel``'s set-up on this rank's chunks (None without it). The reference
    holds this TP rank's Megatron shard of the tables (all of them at TP=1)."""
    if settings.pipeline.vocab_parallel == "none":
        return None
    return shard_vocabulary(
        chunks,
        schedule.placement,
        pipeline_rank,
        config.vocab_size,
        config.hidden_size,
        settings.pipeline.vocab_parallel,
        sequence_parallel=settings.sequence_parallel,
        dtype=config.torch_dtype,
        device=next(chunks[0].parameters()).device,
        timeout_s=settings.pipeline.p2p_timeout,
        tables=lambda: (
            reference.embedding.word_embeddings.weight.detach(),
            reference.output_layer.weight.detach(),
        ),
    )
