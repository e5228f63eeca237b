"""Partial attention: queries against one chunk of keys, returning (out, lse) for merging.

Layout: q [b, h, sq, d], k and v [b, g, sk, d] with h a multiple of g (grouped-query
attention: query head n uses KV head n // (h/g)). out is [b, h, sq, d] in q's dtype and lse
[b, h, sq] in fp32 (fp64 for fp64 inputs). ``causal=True`` is bottom-right aligned: the last
query sees every key, so a chunk holding the newest keys is causal and older chunks are not.
Queries that see no key (sq > sk under causal) get out 0 and lse -inf. Both outputs are
differentiable, whatever the backend.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from .backends import choose_backend, is_kernel
from .blocks import Kernel, KeyBlock, blocks_backward, blocks_forward, blocks_lse_backward, causal_blocks
from .math_kernel import compute_dtype


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise a ValueError naming the mismatch between q [b, h, sq, d] and k, v [b, g, sk, d]."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-d [b, heads, s, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot be grouped over {k.shape[1]} KV heads")


def default_scale(q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def _blocks(k: Tensor, v: Tensor, seeing: int, causal: bool, kernel: Kernel) -> list[KeyBlock]:
    return causal_blocks(k, v, seeing, kernel.general_causal) if causal else [KeyBlock(k, v, False)]


class _KernelPartial(torch.autograd.Function):
    """(out, lse) through an explicit kernel; leading queries that see no key are cut off."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, kernel: Kernel
    ):
        ctx.set_materialize_grads(False)
        b, h, sq, _ = q.shape
        blind = max(0, sq - k.shape[2]) if causal else 0  # leading queries with no visible key
        if k.shape[2] == 0:
            blind = sq
        out = q.new_zeros(b, h, sq, v.shape[-1])
        lse = torch.full((b, h, sq), -torch.inf, dtype=compute_dtype(q.dtype), device=q.device)
        if blind < sq:
            seeing = q[:, :, blind:]
            part_out, part_lse = blocks_forward(
                kernel, seeing, _blocks(k, v, sq - blind, causal, kernel), scale
            )
            out[:, :, blind:] = part_out
            lse[:, :, blind:] = part_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (blind, causal, scale, kernel)
        return out, lse

    @staticmethod
    def backward(ctx: FunctionCtx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        blind, causal, scale, kernel = ctx.meta
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if blind == q.shape[2]:
            return dq, dk, dv, None, None, None
        seeing = q[:, :, blind:]
        blocks = _blocks(k, v, q.shape[2] - blind, causal, kernel)
        starts = [0]
        for block in blocks:
            starts.append(starts[-1] + block.k.shape[2])
        if dout is not None:
            dq_s, grads = blocks_backward(
                kernel, dout[:, :, blind:], seeing, blocks, out[:, :, blind:], lse[:, :, blind:], scale
            )
            dq[:, :, blind:] += dq_s
            for (dk_b, dv_b), lo, hi in zip(grads, starts, starts[1:]):
                dk[:, :, lo:hi] += dk_b
                dv[:, :, lo:hi] += dv_b
        if dlse is not None:
            dq_s, dks = blocks_lse_backward(
                kernel, dlse[:, :, blind:], seeing, blocks, lse[:, :, blind:], scale
            )
            dq[:, :, blind:] += dq_s
            for dk_b, lo, hi in zip(dks, starts, starts[1:]):
                dk[:, :, lo:hi] += dk_b
        return dq, dk, dv, None, None, None


def partial_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` to one chunk of keys: ``(out, lse)``, both differentiable.

    ``backend`` is "auto", "math", "torch_flash", "flash_attn" or "flex" ("sdpa" gives no lse).
    """
    check_shapes(q, k, v)
    scale = default_scale(q) if scale is None else scale
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    chosen = choose_backend(backend, q, k, need_lse=True, need_grad=need_grad)
    if is_kernel(chosen):
        return _KernelPartial.apply(q, k, v, causal, scale, chosen)
    return _flex_partial(chosen, q, k, v, causal, scale)


def _flex_partial(flex, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Flex over the queries that see a key; the others get out 0 and lse -inf."""
    sq = q.shape[2]
    blind = sq if k.shape[2] == 0 else (max(0, sq - k.shape[2]) if causal else 0)
    if blind == 0:
        return flex.partial(q, k, v, causal, scale)
    b, h = q.shape[:2]
    out = q.new_zeros(b, h, blind, v.shape[-1])
    lse = torch.full((b, h, blind), -torch.inf, dtype=compute_dtype(q.dtype), device=q.device)
    if blind == sq:
        return out, lse
    part_out, part_lse = flex.partial(q[:, :, blind:], k, v, causal, scale)
    return torch.cat([out, part_out], dim=2), torch.cat([lse, part_lse.to(lse.dtype)], dim=2)
