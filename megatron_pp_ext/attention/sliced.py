"""Causal attention of one sequence slice to itself and to the cached K/V of earlier slices.

``sliced_attention`` is one autograd node per (slice, layer). Its forward attends slice j's
queries to the cached K/V of slices < j (all visible) and to its own K/V (causal), then caches
its own K/V. Its backward, run in reverse slice order, computes dq and its own dk/dv, hands the
gradient of the cached K/V to the cache (summed there per earlier slice), and adds to its own
dk/dv what later slices sent. There is no graph edge between slices, so each slice's backward
is its own ``torch.autograd.backward`` call, as a pipeline schedule wants. The gradient sums
are added inside this node (not by autograd into leaves) so they also happen when the backward
is asked only for some inputs (``torch.autograd.grad(..., inputs=...)``, as in B/W splitting).

How the keys are attended: a kernel that aligns causal masks bottom-right (math, flash_attn)
takes the earlier slices' K/V and its own concatenated in one causal call; the others take the
earlier K/V as one non-causal block and their own as a square causal block, merged by lse
(``blocks.py``). Autograd backends (sdpa, flex) run one call over the concatenation and
recompute it in the backward, so they keep nothing but q/k/v. The concatenation is a temporary
copy; the cache itself only holds aliases.

With a ``context`` (the chunk's SliceContext) whose ``current_service`` is set (a light op), each
call first serves one request of its partner rank. With ``current_delegation`` set, the oldest
slices of the prefix are attended by a partner rank (``remote.py``): forward sends the request,
runs the local blocks meanwhile and merges the partner's (out, lse) with them; backward does
the same with the kernel backward and hands the partner's dk/dv of the oldest slices to the
cache. Forward and backward each read the delegation current when they run (a B may delegate
differently from its F). Only explicit kernels can do this.

Tensors are in Megatron's layout [s, b, heads, d]; kernels see [b, heads, s, d] views. The
output is made contiguous in [s, b, heads, d], so flattening the heads is free and the saved
output is the same memory the next layer (linear_proj) keeps.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from .backends import Backend, is_kernel
from .blocks import KeyBlock, blocks_backward, blocks_forward
from .cache import LayerCache
from .merge import merge_partials
from .remote import RemoteKeys


class PairCounter(Protocol):
    """Where a slice's attention learns its delegation and counts its work (a SliceContext)."""

    current_delegation: RemoteKeys | None

    def count_pairs(self, local: int, remote: int) -> None: ...


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd(x: Tensor) -> Tensor:
    return x.permute(2, 0, 1, 3)


def _with_prefix(prefix: tuple[Tensor, Tensor] | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return (k, v) if prefix is None else (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))


def _blocks(prefix: tuple[Tensor, Tensor] | None, k: Tensor, v: Tensor, general: bool) -> list[KeyBlock]:
    """One bottom-right causal block over all keys if the kernel can, else the earlier slices
    (all visible) and the slice's own square causal block."""
    if prefix is None or general:
        return [KeyBlock(*_with_prefix(prefix, k, v), True)]
    return [KeyBlock(prefix[0], prefix[1], False), KeyBlock(k, v, True)]


def _split(
    grads: list[tuple[Tensor, Tensor]], own: int
) -> tuple[tuple[Tensor, Tensor] | None, Tensor, Tensor]:
    """(gradient of the earlier slices' K/V or None, own dk, own dv) from per-block gradients."""
    if len(grads) == 2:
        return grads[0], *grads[1]
    dk, dv = grads[0]
    cut = dk.shape[2] - own
    past = (dk[:, :, :cut], dv[:, :, :cut]) if cut else None
    return past, dk[:, :, cut:], dv[:, :, cut:]


def serve_partner(context: PairCounter | None) -> None:
    """A light op's attention call first serves one request of the heavy op paired with it
    (SlimPipe's redistribution: the runtime sets ``current_service`` around a light op, so the
    two ops go layer by layer side by side); nothing otherwise."""
    service = getattr(context, "current_service", None)
    if service is not None:
        service.serve_one()


def _delegation(context: PairCounter | None, index: int, backend, name: str) -> RemoteKeys | None:
    """The running op's delegation, checked against this slice and backend (None: none)."""
    delegation = None if context is None else context.current_delegation
    if delegation is None or delegation.oldest_slices == 0:
        return None
    if not is_kernel(backend):
        raise ValueError(
            f"{name}: --pp-attn-redistribution needs an attention kernel with an explicit backward "
            f"(math, torch_flash, flash_attn), not {backend.name!r}; set --pp-attn-redistribution 0"
        )
    if delegation.oldest_slices > index:
        raise ValueError(
            f"{name}: slice {index} cannot hand its {delegation.oldest_slices} oldest K/V slices to a "
            f"partner: it has only {index} earlier slices"
        )
    return delegation


def _count(context: PairCounter | None, q_len: int, batch: int, local: int, remote: int, passes: int) -> None:
    """Query-key pairs: ``local``/``remote`` earlier keys all visible, the own slice causal."""
    if context is not None:
        own = q_len * (q_len + 1) // 2
        context.count_pairs(passes * batch * (q_len * local + own), passes * batch * q_len * remote)


class _SliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: LayerCache,
        index: int,
        scale: float,
        backend,
        context: PairCounter | None,
    ):
        cache.check_forward(index)
        serve_partner(context)
        qb, kb, vb = _bhsd(q), _bhsd(k), _bhsd(v)
        delegation = _delegation(context, index, backend, cache.name)
        lse = None
        if delegation is not None:
            oldest = cache.prefix(delegation.oldest_slices)
            pending = delegation.forward(qb, *oldest, scale, backend.name)
            prefix = cache.prefix(index, start=delegation.oldest_slices)
            blocks = _blocks(prefix, kb, vb, backend.general_causal)
            parts = [backend.forward(qb, b.k, b.v, b.causal, scale) for b in blocks]
            out, lse = merge_partials([*parts, pending.wait()])
            out = out.to(q.dtype)
            remote = oldest[0].shape[2]
            del parts, oldest
        elif is_kernel(backend):
            prefix = cache.prefix(index)
            out, lse = blocks_forward(backend, qb, _blocks(prefix, kb, vb, backend.general_causal), scale)
            remote = 0
        else:
            prefix = cache.prefix(index)
            out = backend.attend(qb, *_with_prefix(prefix, kb, vb), scale)
            remote = 0
        local = 0 if prefix is None else prefix[0].shape[2]
        _count(context, qb.shape[2], qb.shape[0], local, remote, passes=1)
        del prefix
        cache.append(kb, vb)
        out = _sbhd(out).contiguous()
        ctx.save_for_backward(q, k, v, out if lse is not None else None, lse)
        ctx.meta = (cache, index, scale, backend, context)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cache, index, scale, backend, context = ctx.meta
        cache.check_backward(index)
        serve_partner(context)
        qb, kb, vb, doutb = _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(dout)
        delegation = _delegation(context, index, backend, cache.name)
        start = 0 if delegation is None else delegation.oldest_slices
        pending = None
        if delegation is not None:
            oldest = cache.prefix(start)
            pending = delegation.backward(qb, *oldest, doutb, _bhsd(out), lse, scale, backend.name)
            remote = oldest[0].shape[2]
            del oldest
        else:
            remote = 0
        prefix = cache.prefix(index, start=start)
        if is_kernel(backend):
            blocks = _blocks(prefix, kb, vb, backend.general_causal)
            dq, grads = blocks_backward(backend, doutb, qb, blocks, _bhsd(out), lse, scale)
        else:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (qb, *_with_prefix(prefix, kb, vb))]
                dq, dkk, dvv = torch.autograd.grad(backend.attend(*leaves, scale), leaves, doutb)
            grads = [(dkk, dvv)]
        past, dk, dv = _split(grads, kb.shape[2])
        local = 0 if prefix is None else prefix[0].shape[2]
        _count(context, qb.shape[2], qb.shape[0], local, remote, passes=2)
        del prefix
        if pending is not None:
            dq_remote, dk_remote, dv_remote = pending.wait()
            dq = dq + dq_remote.to(dq.dtype)
            cache.add_grads(start, dk_remote, dv_remote)
        if past is not None:
            cache.add_grads(index, *past, start=start)
        later = cache.finish(index)
        if later is not None:
            dk = dk + later[0].to(dk.dtype)
            dv = dv + later[1].to(dv.dtype)
        return _sbhd(dq), _sbhd(dk), _sbhd(dv), None, None, None, None, None


def sliced_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: LayerCache,
    index: int,
    scale: float,
    backend: Backend,
    context: PairCounter | None = None,
) -> Tensor:
    """Output [s_j, b, h, d] of slice ``index``. q [s_j, b, h, d] and k, v [s_j, b, g, d] are the
    slice's own (rotary already applied from the slice's position offset); the K/V of earlier
    slices come from ``cache``. ``context`` (optional): the delegation of the running op and
    the pair counters (see the module docstring)."""
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"slice {index}: {q.shape[0]} queries but {k.shape[0]} keys; a slice brings both")
    return _SliceAttention.apply(q, k, v, cache, index, scale, backend, context)
