"""Backends that are differentiable through autograd instead of explicit kernels.

``sdpa``: torch's ``scaled_dot_product_attention``, which picks its own fused kernel but gives
no lse; it can only run the whole bottom-right causal attention in one call. ``flex``:
FlexAttention, which gives the lse (differentiable) and takes any mask; compiled on CUDA,
eager (forward only, slow) on CPU. The sliced attention runs these over the concatenated
cached K/V and recomputes that call in its backward, so nothing beyond q/k/v is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

_FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class SdpaAttend:
    """Bottom-right causal attention through torch SDPA (no lse)."""

    name = "sdpa"
    gives_lse = False

    def supports(self, q: Tensor, k: Tensor, need_grad: bool) -> bool:
        return True

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        q_len, k_len = q.shape[2], k.shape[2]
        gqa = k.shape[1] != q.shape[1]
        if q_len == k_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        mask = causal_lower_right(q_len, k_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@functools.cache
def flex_available() -> bool:
    """FlexAttention with ``return_aux`` (its lse as a differentiable output), which the partial
    attention of sliced attention needs: torch 2.9 and later (older images, e.g. NGC 25.03's
    torch 2.7, lack ``AuxRequest``; the automatic choice then skips flex)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _flex_fn(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


@functools.lru_cache(maxsize=64)
def _causal_block_mask(q_len: int, k_len: int, device: str):  # -> BlockMask
    from torch.nn.attention.flex_attention import create_block_mask

    past = k_len - q_len

    def bottom_right(b, h, q_idx, k_idx):
        return k_idx <= q_idx + past

    return create_block_mask(bottom_right, None, None, q_len, k_len, device=device)


class FlexAttend:
    """FlexAttention: partial attention with a differentiable lse, and the whole causal call."""

    name = "flex"
    gives_lse = True

    def supports(self, q: Tensor, k: Tensor, need_grad: bool) -> bool:
        if q.dtype not in _FLEX_DTYPES or not flex_available():
            return False
        return q.is_cuda or (q.device.type == "cpu" and not need_grad)

    def partial(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """(out, lse) with autograd through both; lse in fp32."""
        from torch.nn.attention.flex_attention import AuxRequest

        mask = _causal_block_mask(q.shape[2], k.shape[2], str(q.device)) if causal else None
        out, aux = _flex_fn(q.device.type)(
            q,
            k,
            v,
            block_mask=mask,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
            return_aux=AuxRequest(lse=True),
        )
        return out, aux.lse

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return self.partial(q, k, v, True, scale)[0]
