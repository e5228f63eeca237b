"""``--pp-vocab-parallel`` on built chunks, one way for ``train`` and for the pretrain_gpt.py hook:
both hold a rank's chunks and Megatron's tables for this tensor-parallel rank, and differ only in
where the tables come from (train's seeded reference model; pretrain's first and last stage,
broadcast along the pipeline), which the caller passes as ``tables``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..runtime.vocab_ops import setup_vocab_parallel
from ..runtime.vocab_parallel import VocabGroups
from ..schedule.ir import Placement


def shard_vocabulary(
    chunks: Sequence[Any],
    placement: Placement,
    rank: int,
    vocab_size: int,
    hidden_size: int,
    mode: str,
    *,
    sequence_parallel: bool,
    dtype: torch.dtype,
    device: torch.device,
    timeout_s: float | None,
    tables: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> Any:
    """Give chunk 0 this pipeline rank's shard of the vocabulary (before DDP wraps the chunks,
    so the shard's parameters are chunk 0's like any other) and the first and last stages an
    embedding feed and an output capture in place of their full tables; then load each shard's
    rows from ``tables()`` (the embedding and output tables of this TP rank, called once the
    feed and capture are in place). Returns the set-up, with ``vp`` to close; closed here if
    loading fails."""
    vocab = setup_vocab_parallel(
        chunks,
        placement,
        rank,
        vocab_size,
        hidden_size,
        mode,
        dtype=dtype,
        device=device,
        sequence_parallel=sequence_parallel,
        groups=VocabGroups.create(timeout_s=timeout_s),
    )
    try:
        embedding, output = tables()
        vocab.vp.load_tp_shards(embedding=embedding, output=output)
    except BaseException:
        vocab.vp.close()
        raise
    return vocab
