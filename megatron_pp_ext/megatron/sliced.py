"""Sequence slicing on megatron-core GPT chunks: rotary positions and the chunk's SliceContext.

A sliced chunk (built with ``sliced=True`` in ``model.py``, or any GPTModel whose layer spec
uses :class:`~megatron_pp_ext.attention.SlicedCoreAttention`) gets one ``SliceContext`` from
:func:`enable_slicing`. Its attention layers read the running (microbatch, slice) from it, and so
does its rotary embedding: megatron-core's ``GPTModel`` asks ``rotary_pos_emb`` for as many
positions as the hidden states it sees (the slice's length) and always from position 0, so
:class:`SlicedRotaryEmbedding` shifts them by the slice's offset. Slice j then uses rotary
positions [start_j, end_j) of the whole sequence, as the unsliced model does.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ..attention import SliceContext, SlicedCoreAttention, attach_slice_context
from .rotary import DeviceRotaryEmbedding
from .sliced_router import slice_routers


class SlicedRotaryEmbedding(DeviceRotaryEmbedding):
    """Rotary embedding whose positions start at the running slice's offset.

    ``slice_context`` is set by :func:`enable_slicing`; with no slice running it is the plain
    embedding. Megatron's ``forward`` caches by (length, offset), so every slice hits the cache
    after the first step."""

    slice_context: SliceContext | None = None

    def forward(  # type: ignore[override]
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> torch.Tensor:
        ctx = self.slice_context
        if ctx is not None and ctx.current is not None:
            if packed_seq:
                raise NotImplementedError("sequence slicing does not support packed sequences")
            offset += ctx.position_offset()
        return super().forward(max_seq_len, offset, packed_seq, cp_group)


def enable_slicing(chunk: torch.nn.Module, context: SliceContext | None = None) -> SliceContext:
    """Give ``chunk`` (one model chunk) a SliceContext: its sliced attention layers and its rotary
    embedding read the running slice from it. Returns the context (an existing one is reused).

    Raises ValueError if the chunk has no SlicedCoreAttention (it was built with a plain spec)
    or uses a rotary variant other than megatron-core's plain RotaryEmbedding."""
    context = context or slice_context_of(chunk) or SliceContext()
    if not attach_slice_context(chunk, context):
        raise ValueError(
            "this model chunk has no SlicedCoreAttention: build it with the sliced layer spec "
            "(megatron_pp_ext.megatron.layer_spec.layer_spec(sliced=True), or "
            "build_chunks(..., sliced=True)) to run a schedule with sequence slices"
        )
    for module in chunk.modules():
        if not isinstance(module, RotaryEmbedding):
            continue
        if type(module) not in (RotaryEmbedding, DeviceRotaryEmbedding, SlicedRotaryEmbedding):
            raise ValueError(
                f"sequence slicing supports megatron-core's RotaryEmbedding, not {type(module).__name__}"
            )
        module.__class__ = SlicedRotaryEmbedding  # same state; positions follow the slice
        module.slice_context = context
        device = next(chunk.parameters()).device
        module.inv_freq = module.inv_freq.to(device)
    slice_routers(chunk, context)  # mixture-of-experts routers: the sequence's auxiliary losses
    return context


def slice_context_of(chunk: torch.nn.Module) -> SliceContext | None:
    """The SliceContext of ``chunk``'s sliced attention layers (None if it has none)."""
    for module in chunk.modules():
        if isinstance(module, SlicedCoreAttention) and module.slice_context is not None:
            return module.slice_context
    return None
