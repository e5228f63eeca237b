"""Sliced causal attention under context parallelism: local queries, the slice's K/V gathered.

Each CP rank holds two pieces of every slice (``cp_layout.py``). Per (slice, layer) the ranks
all-gather the slice's K/V (``cp_comm.py``); the K/V cache then keeps the GATHERED K/V of earlier
slices, so every rank's queries see every earlier token. A local query piece p (of 2*CP, length
c) sees the earlier slices' keys and the slice's keys [0, (p + 1) c): bottom-right causal over
that run, i.e. the keys before the piece (all visible) and the piece's own square causal block,
attended as blocks and merged by lse (``blocks.py``). The two pieces are not contiguous in the
slice, which is why each is attended on its own.

Backward (reverse slice order, as ``sliced.py``): each piece's dq, the gradient of the gathered
slice K/V from both pieces plus what this rank's later slices sent through the cache, and the
gradient of the earlier slices' K/V handed to the cache. The gathered gradient then goes through
the gather's backward, a reduce-scatter to the owners; a slice's cached K/V gradient is thus
summed on each rank until that slice's own backward and reduce-scattered once, with it.

With SlimPipe's redistribution (``remote.py``) the oldest earlier slices are attended by a
partner rank of the same pipeline: the request carries all local queries (the oldest keys are
visible to both pieces) and the partner's (out, lse) is split by piece and merged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx

from .backends import Backend, is_kernel
from .blocks import KeyBlock, blocks_backward
from .cache import LayerCache
from .cp_comm import gather_kv
from .cp_layout import pieces_of
from .merge import merge_partials
from .sliced import PairCounter, _bhsd, _delegation, _sbhd, serve_partner

Target = tuple[int, int] | None  # where a block's K/V gradient goes: slice keys [lo, hi), or the prefix


def _piece_blocks(
    prefix: tuple[Tensor, Tensor] | None, k: Tensor, v: Tensor, piece: int, c: int
) -> tuple[list[KeyBlock], list[Target]]:
    """Blocks of keys that query piece ``piece`` sees, and where each block's gradient goes."""
    blocks: list[KeyBlock] = []
    targets: list[Target] = []
    if prefix is not None:
        blocks.append(KeyBlock(prefix[0], prefix[1], False))
        targets.append(None)
    start = piece * c
    if start:
        blocks.append(KeyBlock(k[:, :, :start], v[:, :, :start], False))
        targets.append((0, start))
    blocks.append(KeyBlock(k[:, :, start : start + c], v[:, :, start : start + c], True))
    targets.append((start, start + c))
    return blocks, targets


def _keys_upto(prefix: tuple[Tensor, Tensor] | None, k: Tensor, v: Tensor, end: int) -> tuple[Tensor, Tensor]:
    """Earlier slices' keys and the slice's keys [0, end), concatenated (autograd backends)."""
    if prefix is None:
        return k[:, :, :end], v[:, :, :end]
    return torch.cat([prefix[0], k[:, :, :end]], 2), torch.cat([prefix[1], v[:, :, :end]], 2)


def _count(
    context: PairCounter | None,
    pieces: tuple[int, int],
    c: int,
    batch: int,
    prefix: int,
    remote: int,
    passes: int,
) -> None:
    """Query-key pairs of this rank's pieces: earlier keys all visible, each piece causal to itself;
    ``remote`` earlier keys attended by a partner."""
    if context is None:
        return
    local = sum(c * (prefix + piece * c) + c * (c + 1) // 2 for piece in pieces)
    context.count_pairs(passes * batch * local, passes * batch * len(pieces) * c * remote)


class _ContextParallelSliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: LayerCache,
        index: int,
        scale: float,
        backend: Backend,
        context: PairCounter | None,
        pieces: tuple[int, int],
    ) -> Tensor:
        cache.check_forward(index)
        serve_partner(context)
        qb, kb, vb = _bhsd(q), _bhsd(k), _bhsd(v)
        c = qb.shape[2] // len(pieces)
        delegation = _delegation(context, index, backend, cache.name)
        start = 0 if delegation is None else delegation.oldest_slices
        remote_parts = None
        remote = 0
        if delegation is not None:
            oldest = cache.prefix(start)
            pending = delegation.forward(qb, *oldest, scale, backend.name)
            remote = oldest[0].shape[2]
            del oldest
        prefix = cache.prefix(index, start=start)
        outs, lses = [], []
        for t, piece in enumerate(pieces):
            q_t = qb[:, :, t * c : (t + 1) * c]
            if is_kernel(backend):
                blocks, _ = _piece_blocks(prefix, kb, vb, piece, c)
                outs_lses = [backend.forward(q_t, b.k, b.v, b.causal, scale) for b in blocks]
                if delegation is not None:
                    if remote_parts is None:
                        remote_parts = pending.wait()
                    r_out, r_lse = remote_parts
                    outs_lses.append((r_out[:, :, t * c : (t + 1) * c], r_lse[:, :, t * c : (t + 1) * c]))
                out_t, lse_t = merge_partials(outs_lses)
                outs.append(out_t.to(q.dtype))
                lses.append(lse_t)
            else:
                outs.append(backend.attend(q_t, *_keys_upto(prefix, kb, vb, (piece + 1) * c), scale))
        local = 0 if prefix is None else prefix[0].shape[2]
        _count(context, pieces, c, qb.shape[0], local, remote, passes=1)
        del prefix
        cache.append(kb, vb)
        out = _sbhd(torch.cat(outs, dim=2)).contiguous()
        lse = torch.cat(lses, dim=2) if lses else None
        ctx.save_for_backward(q, k, v, out if lse is not None else None, lse)
        ctx.meta = (cache, index, scale, backend, context, pieces)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cache, index, scale, backend, context, pieces = ctx.meta
        cache.check_backward(index)
        serve_partner(context)
        qb, kb, vb, doutb = _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(dout)
        c = qb.shape[2] // len(pieces)
        delegation = _delegation(context, index, backend, cache.name)
        start = 0 if delegation is None else delegation.oldest_slices
        pending = None
        remote = 0
        if delegation is not None:
            oldest = cache.prefix(start)
            pending = delegation.backward(qb, *oldest, doutb, _bhsd(out), lse, scale, backend.name)
            remote = oldest[0].shape[2]
            del oldest
        prefix = cache.prefix(index, start=start)
        acc = torch.promote_types(k.dtype, torch.float32)  # the two pieces' sums
        dk, dv = torch.zeros_like(kb, dtype=acc), torch.zeros_like(vb, dtype=acc)
        dprefix: list[Tensor] | None = None
        dqs = []
        for t, piece in enumerate(pieces):
            rows = slice(t * c, (t + 1) * c)
            q_t, dout_t = qb[:, :, rows], doutb[:, :, rows]
            if is_kernel(backend):
                blocks, targets = _piece_blocks(prefix, kb, vb, piece, c)
                out_t, lse_t = _bhsd(out)[:, :, rows], lse[:, :, rows]
                dq_t, grads = blocks_backward(backend, dout_t, q_t, blocks, out_t, lse_t, scale)
            else:
                keys = _keys_upto(prefix, kb, vb, (piece + 1) * c)
                with torch.enable_grad():
                    leaves = [t_.detach().requires_grad_() for t_ in (q_t, *keys)]
                    dq_t, dkk, dvv = torch.autograd.grad(backend.attend(*leaves, scale), leaves, dout_t)
                cut = 0 if prefix is None else prefix[0].shape[2]
                grads = [(dkk[:, :, :cut], dvv[:, :, :cut])] if cut else []
                grads.append((dkk[:, :, cut:], dvv[:, :, cut:]))
                targets = ([None] if cut else []) + [(0, (piece + 1) * c)]
            dqs.append(dq_t)
            for (dk_b, dv_b), target in zip(grads, targets):
                if target is None and dprefix is None:
                    dprefix = [dk_b.to(acc), dv_b.to(acc)]
                elif target is None:
                    dprefix = [dprefix[0] + dk_b, dprefix[1] + dv_b]
                else:
                    dk[:, :, target[0] : target[1]] += dk_b
                    dv[:, :, target[0] : target[1]] += dv_b
        dq = torch.cat(dqs, dim=2)
        local = 0 if prefix is None else prefix[0].shape[2]
        _count(context, pieces, c, qb.shape[0], local, remote, passes=2)
        del prefix
        if pending is not None:
            dq_remote, dk_remote, dv_remote = pending.wait()
            dq = dq + dq_remote.to(dq.dtype)
            cache.add_grads(start, dk_remote, dv_remote)
        if dprefix is not None:
            held = cache.grad_dtype or k.dtype  # what the cache keeps, converted once
            cache.add_grads(index, dprefix[0].to(held), dprefix[1].to(held), start=start)
        later = cache.finish(index)
        if later is not None:
            dk += later[0]
            dv += later[1]
        return (
            _sbhd(dq.to(q.dtype)),
            _sbhd(dk.to(k.dtype)),
            _sbhd(dv.to(v.dtype)),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: LayerCache,
    index: int,
    scale: float,
    backend: Backend,
    group: Any,
    context: PairCounter | None = None,
) -> Tensor:
    """Output [L / CP, b, h, d] of this CP rank's queries of slice ``index`` (or of the whole
    sequence, as slice 0 of a fresh cache). q [L / CP, b, h, d] and k, v [L / CP, b, g, d] are
    this rank's two pieces of the slice (rotary applied at their global positions); ``group``
    is the context-parallel process group; the rest as :func:`~.sliced.sliced_attention`."""
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"slice {index}: {q.shape[0]} queries but {k.shape[0]} keys; a slice brings both")
    pieces = pieces_of(dist.get_world_size(group), dist.get_rank(group))
    if q.shape[0] % len(pieces):
        raise ValueError(f"slice {index}: {q.shape[0]} local tokens cannot be two equal pieces")
    k_full, v_full = gather_kv(k, v, group)
    return _ContextParallelSliceAttention.apply(
        q, k_full, v_full, cache, index, scale, backend, context, pieces
    )
