"""Attention over a key range cut into blocks a kernel can run, merged by lse.

A kernel with explicit forward/backward runs each block on its own; the forward merges the
blocks' ``(out, lse)``; the backward calls the kernel's backward on every block with the MERGED
``out`` and ``lse``, which gives each block's exact share of the gradient (the probabilities
exp(s - lse) are then the global ones, and D = rowsum(dout * out) is the global D). No per-block
output is kept for the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .merge import merge_partials


class Kernel(Protocol):
    """Attention with explicit forward and backward, layout [b, heads, s, d]."""

    name: str
    general_causal: bool  # False: causal blocks must be square (top-left == bottom-right)

    def supports(self, q: Tensor, k: Tensor) -> bool: ...

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]: ...

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
    ) -> tuple[Tensor, Tensor, Tensor]: ...


@dataclass(frozen=True)
class KeyBlock:
    """A run of keys/values [b, g, n, d] and whether the causal diagonal lies in it."""

    k: Tensor
    v: Tensor
    causal: bool


def causal_blocks(k: Tensor, v: Tensor, q_len: int, general: bool) -> list[KeyBlock]:
    """Bottom-right causal attention of ``q_len`` queries to ``k``/``v`` (q_len <= key count) as
    blocks: the keys before the diagonal are seen by every query, the last q_len form a square."""
    if general:
        return [KeyBlock(k, v, True)]
    past = k.shape[2] - q_len
    blocks = [KeyBlock(k[:, :, :past], v[:, :, :past], False)] if past > 0 else []
    return blocks + [KeyBlock(k[:, :, past:], v[:, :, past:], True)]


def blocks_forward(
    kernel: Kernel, q: Tensor, blocks: Sequence[KeyBlock], scale: float
) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse) of q attending to all blocks."""
    out, lse = merge_partials([kernel.forward(q, b.k, b.v, b.causal, scale) for b in blocks])
    return out.to(q.dtype), lse


def blocks_backward(
    kernel: Kernel,
    dout: Tensor,
    q: Tensor,
    blocks: Sequence[KeyBlock],
    out: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """dq and each block's (dk, dv) for the gradient ``dout`` of the merged output."""
    dq: Tensor | None = None
    grads = []
    for block in blocks:
        dq_b, dk, dv = kernel.backward(dout, q, block.k, block.v, out, lse, block.causal, scale)
        dq = dq_b if dq is None else dq + dq_b
        grads.append((dk, dv))
    assert dq is not None
    return dq, grads


def blocks_lse_backward(
    kernel: Kernel, dlse: Tensor, q: Tensor, blocks: Sequence[KeyBlock], lse: Tensor, scale: float
) -> tuple[Tensor, list[Tensor]]:
    """dq and each block's dk for a gradient ``dlse`` of the merged lse (it gives V nothing).

    d lse / d score = probability, so the score gradient is P * dlse. A flash-style backward
    computes P * (dout.v - rowsum(dout * out)); with V = 0 and a dout/out pair whose rows dot to
    -dlse it computes exactly P * dlse, so any kernel can do it with one more backward call.
    """
    unit = torch.zeros_like(q)
    unit[..., 0] = 1
    fake_out = torch.zeros_like(q)
    fake_out[..., 0] = -dlse.to(q.dtype)
    dq: Tensor | None = None
    dks = []
    for block in blocks:
        dq_b, dk, _ = kernel.backward(
            unit, q, block.k, torch.zeros_like(block.v), fake_out, lse, block.causal, scale
        )
        dq = dq_b if dq is None else dq + dq_b
        dks.append(dk)
    assert dq is not None
    return dq, dks
