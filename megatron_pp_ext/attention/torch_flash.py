"""torch's own flash-attention kernels (the ones behind SDPA), called directly for their lse.

On CUDA this is ``aten::_scaled_dot_product_flash_attention`` (fp16/bf16, head dim a multiple
of 8 up to 256); on CPU ``aten::_scaled_dot_product_flash_attention_for_cpu`` (any float
dtype). Both backward ops take the ``out`` and ``lse`` to use, which is what merging partial
attentions needs. The kernels want as many KV heads as query heads, so grouped K/V are
repeated for the call and their gradients summed back. Causal masks are top-left aligned, so
the caller only asks for causal blocks that are square (``general_causal = False``).
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
        heads, sq = q.shape[1], q.shape[2]
        k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale
            )
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )[:2]
        return out, lse[..., :sq]

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
        kr, vr = _repeat_kv(k, heads), _repeat_kv(v, heads)
        out = out.to(q.dtype)
        dout = dout.to(q.dtype)
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, kr, vr, out, lse.to(compute_dtype(q.dtype)), 0.0, causal, scale=scale
            )
        else:
            unused = torch.empty(2, device=q.device, dtype=torch.int64)  # rng state: no dropout here
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout.contiguous(), q, kr, vr, out.contiguous(), lse.float().contiguous(),
                None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused, scale=scale,
            )  # fmt: skip
        return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)
