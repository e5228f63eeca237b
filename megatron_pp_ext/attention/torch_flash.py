"""torch's own flash-attention kernels (the ones behind SDPA), called directly for their lse.

On CUDA this is ``aten::_scaled_dot_product_flash_attention`` (fp16/bf16, head dim a multiple
of 8 up to 256); on CPU ``aten::_scaled_dot_product_flash_attention_for_cpu`` (any float
dtype). Both backward ops take the ``out`` and ``lse`` to use, which is what merging partial
attentions needs. Causal masks are top-left aligned, so the caller only asks for causal blocks
that are square (``general_causal = False``).

The kernels want as many KV heads as query heads. For a non-causal block the query heads that
share a KV head are folded into the query sequence instead ([b, g, r*sq, d]), so the (long)
cached K/V is neither copied nor its gradient summed; a causal block's (short) K/V is repeated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .math_kernel import compute_dtype

_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(dx: Tensor, kv_heads: int) -> Tensor:
    b, h, s, d = dx.shape
    return dx if h == kv_heads else dx.reshape(b, kv_heads, h // kv_heads, s, d).sum(2)


def _fold(x: Tensor, kv_heads: int) -> Tensor:
    """[b, h, s, ...] -> [b, g, (h/g)*s, ...]: the query heads of a KV head as one sequence."""
    return x.reshape(x.shape[0], kv_heads, -1, *x.shape[3:])


def _unfold(x: Tensor, heads: int) -> Tensor:
    return x.reshape(x.shape[0], heads, -1, *x.shape[3:])


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[
        :2
    ]
    return out, lse[..., : q.shape[2]]


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    out, dout = out.to(q.dtype), dout.to(q.dtype)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(compute_dtype(q.dtype)), 0.0, causal, scale=scale
        )
    unused = torch.empty(2, device=q.device, dtype=torch.int64)  # rng state: there is no dropout
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.float().contiguous(),
        None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused, scale=scale,
    )  # fmt: skip


class TorchFlashKernel:
    """Explicit forward/backward through torch's flash-attention ops."""

    name = "torch_flash"
    general_causal = False

    def supports(self, q: Tensor, k: Tensor) -> bool:
        if q.device.type == "cpu":
            return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        if q.device.type != "cuda":
            return False
        d = q.shape[-1]
        return q.dtype in _CUDA_DTYPES and d % 8 == 0 and d <= 256

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        heads, kv_heads = q.shape[1], k.shape[1]
        if causal or heads == kv_heads:
            return _flash_forward(q, _repeat_kv(k, heads), _repeat_kv(v, heads), causal, scale)
        out, lse = _flash_forward(_fold(q, kv_heads), k, v, False, scale)
        return _unfold(out, heads), _unfold(lse, heads)

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        heads, kv_heads = q.shape[1], k.shape[1]
        if causal or heads == kv_heads:
            kr, vr = _repeat_kv(k, heads), _repeat_kv(v, heads)
            dq, dk, dv = _flash_backward(dout, q, kr, vr, out, lse, causal, scale)
            return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)
        fold = lambda x: _fold(x, kv_heads)
        dq, dk, dv = _flash_backward(fold(dout), fold(q), k, v, fold(out), fold(lse), False, scale)
        return _unfold(dq, heads), dk, dv
