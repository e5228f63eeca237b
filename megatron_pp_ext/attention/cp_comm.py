"""One slice's K/V all-gathered over the context-parallel group; their gradients reduce-scattered
back to the owners.

Forward: each CP rank gives its local K/V of the slice (its two pieces, ``cp_layout.py``) and
gets the whole slice's K/V in sequence order, from one ``all_gather_into_tensor`` of K and V
stacked. Backward: each rank holds the gradient of the whole slice's K/V from its own queries
(and, through the sliced attention's cache, from the queries of its later slices); one
``reduce_scatter_tensor`` sums them over the ranks and hands every owner the sum for its own
tokens, so each token's K/V gradient reaches its owner exactly once, whoever's queries used it.
Every CP rank of a pipeline stage runs the same ops in the same order, so these collectives
match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx

from .cp_layout import to_gathered_order, to_global_order


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, k: Tensor, v: Tensor, group: Any) -> tuple[Tensor, Tensor]:
        ctx.group = group
        cp = dist.get_world_size(group)
        local = torch.stack([k, v])  # [2, s, b, g, d]
        gathered = local.new_empty((cp * 2, *local.shape[1:]))  # ranks along dim 0, as gloo wants
        dist.all_gather_into_tensor(gathered, local, group=group)
        gathered = gathered.unflatten(0, (cp, 2))
        # [cp, s, ...] per tensor, rank-major along the sequence, then in sequence order
        k_full, v_full = (to_global_order(gathered[:, i].flatten(0, 1), 0, cp) for i in (0, 1))
        return k_full, v_full

    @staticmethod
    def backward(ctx: FunctionCtx, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, None]:
        cp = dist.get_world_size(ctx.group)
        full = torch.stack([to_gathered_order(dk, 0, cp), to_gathered_order(dv, 0, cp)])  # [2, L, ...]
        by_rank = full.unflatten(1, (cp, -1)).movedim(1, 0).flatten(0, 1).contiguous()  # [cp * 2, s, ...]
        mine = by_rank.new_empty((2, *by_rank.shape[1:]))
        dist.reduce_scatter_tensor(mine, by_rank, group=ctx.group)
        return mine[0], mine[1], None


def gather_kv(k: Tensor, v: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """The whole slice's K/V [L, b, g, d] in sequence order from each rank's local K/V
    [L / CP, b, g, d]; differentiable (the backward reduce-scatters to the owners)."""
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    return _GatherKV.apply(k, v, group)
