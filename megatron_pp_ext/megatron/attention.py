"""Core attention on PyTorch's scaled_dot_product_attention.

Megatron's local ``DotProductAttention`` allocates CUDA tensors (its global memory buffer and the
CUDA RNG tracker), so it cannot run on a CPU. This module is a drop-in ``core_attention`` with the
same constructor and forward signature, built on ``torch.nn.functional.scaled_dot_product_attention``
(which has fused kernels on GPU and a plain path on CPU): on a GPU it replaces Megatron's local
attention too, which materialises the [b, heads, s, s] scores. Sequence slicing (Seq1F1B, SlimPipe)
will extend this module, so it stays a small, self-contained class.

Layout follows Megatron: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``; output
``[sq, b, np * hn]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


class SDPAttention(MegatronModule):
    """Causal (or masked) attention with grouped-query support, device-agnostic."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SDPAttention does not support context parallelism: build the chunks with "
                "sliced=True (SlicedCoreAttention attends across context-parallel ranks)"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_heads = config.num_attention_heads
        self.num_query_groups = config.num_query_groups or config.num_attention_heads
        self.head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        # apply_query_key_layer_scaling only moves a factor between the scores and the fp32
        # softmax in Megatron's kernel; the product is the plain scale, so it is ignored here.
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, batch = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sdpa_mask, is_causal = _sdpa_mask(attention_mask, mask_type, sq, k.shape[2])
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=sdpa_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],  # grouped K/V without copies (flash/cuDNN on GPU)
        )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)


def _sdpa_mask(
    attention_mask: Tensor | None, mask_type: AttnMaskType, sq: int, sk: int
) -> tuple[Tensor | None, bool]:
    """Megatron masks mark positions to DROP (True = masked); SDPA boolean masks mark positions
    to KEEP. A causal mask type over a square score matrix becomes SDPA's ``is_causal`` and the
    given mask (Megatron's dataloader builds the same lower triangle) is not used, as Transformer
    Engine's and flash attention's causal paths do: an explicit mask would keep SDPA off its fused
    flash kernels and cost an s x s tensor."""
    if mask_type == AttnMaskType.causal and sq == sk:
        return None, True
    if attention_mask is None:
        if mask_type == AttnMaskType.causal:
            raise ValueError(f"causal attention without a mask needs sq == sk, got {sq} and {sk}")
        return None, False
    if attention_mask.dtype == torch.bool:
        return ~attention_mask, False
    return attention_mask, False
