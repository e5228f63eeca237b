"""A core-attention module with Megatron's DotProductAttention.forward signature that runs
sequence-sliced causal attention.

Megatron builds core attention as ``submodules.core_attention(config=..., layer_number=...,
attn_mask_type=..., attention_type=..., softmax_scale=..., ...)`` and calls it with
[s, b, heads, d] tensors, expecting [s, b, heads * d] back. This module accepts those arguments
(it reads the head dim and dropout from ``config`` when given) and keeps nothing else from
Megatron. Its ``slice_context`` (one ``SliceContext`` per model chunk, set with
``attach_slice_context``) says which microbatch and slice run now; without one, or with no
slice running, it is plain causal attention over what it is given. With context parallelism
(``config.context_parallel_size`` > 1; the group from Megatron's ``pg_collection.cp`` or
``cp_group``) each rank holds its two pieces of every slice and attends through
``cp_attention.py``; an unsliced sequence is then attended as one slice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .backends import BACKEND_NAMES, choose_backend
from .cache import LayerCache
from .context import SliceContext
from .cp_attention import context_parallel_attention
from .partial import check_shapes
from .sliced import sliced_attention


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)


def _mask_type_name(mask_type: Any) -> str | None:
    return None if mask_type is None else str(getattr(mask_type, "name", mask_type))


class SlicedCoreAttention(torch.nn.Module):
    """Causal core attention that, while a slice runs, attends it to the cached earlier slices."""

    def __init__(
        self,
        config: Any = None,
        layer_number: int = 1,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        *,
        slice_context: SliceContext | None = None,
        backend: str = "auto",
        cp_group: Any = None,
        **megatron_kwargs: Any,
    ) -> None:
        """``megatron_kwargs`` (cp_comm_type, pg_collection, ...) are accepted; only
        ``pg_collection.cp`` is read, when the config asks for context parallelism."""
        super().__init__()
        if backend not in BACKEND_NAMES:
            raise ValueError(
                f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}"
            )
        dropout = (
            attention_dropout if attention_dropout is not None else getattr(config, "attention_dropout", 0.0)
        )
        if dropout:
            raise NotImplementedError(
                f"sliced attention has no attention dropout; set attention_dropout=0 (got {dropout})"
            )
        if attention_type != "self":
            raise NotImplementedError(
                f"sliced attention is self-attention only (got attention_type={attention_type!r})"
            )
        self._check_mask_type(attn_mask_type)
        if softmax_scale is None and getattr(config, "kv_channels", None):
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.slice_context = slice_context
        self.cp_group = _context_parallel_group(config, cp_group, megatron_kwargs.get("pg_collection"))
        self.cp_size = 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)

    @staticmethod
    def _check_mask_type(mask_type: Any) -> None:
        name = _mask_type_name(mask_type)
        if name not in (None, "causal", "causal_bottom_right"):
            raise NotImplementedError(f"sliced attention is causal only (got attn_mask_type {name})")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """query [s, b, h, d], key/value [s, b, g, d] -> [s, b, h * d]. ``attention_mask`` is
        ignored (the mask is causal by construction)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("sliced attention takes no attention_bias and no packed_seq_params")
        self._check_mask_type(attn_mask_type)
        check_shapes(_bhsd(query), _bhsd(key), _bhsd(value))
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        ctx = self.slice_context
        delegating = ctx is not None and ctx.current is not None and ctx.delegating
        backend = choose_backend(
            self.backend, _bhsd(query), _bhsd(key), need_grad=need_grad, kernel_only=delegating
        )
        if ctx is None or ctx.current is None:
            out = self._unsliced(query, key, value, scale, backend)
        else:
            out = self._sliced(ctx, query, key, value, scale, backend, need_grad)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _unsliced(self, query: Tensor, key: Tensor, value: Tensor, scale: float, backend: Any) -> Tensor:
        cache = LayerCache(f"layer {self.layer_number}")
        if self.cp_group is not None:
            return context_parallel_attention(query, key, value, cache, 0, scale, backend, self.cp_group)
        return sliced_attention(query, key, value, cache, 0, scale, backend)

    def _sliced(
        self,
        ctx: SliceContext,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        scale: float,
        backend: Any,
        need_grad: bool,
    ) -> Tensor:
        microbatch, index = ctx.current
        lengths = ctx.slicing(microbatch)
        if lengths is not None and query.shape[0] * self.cp_size != lengths[index]:
            share = f" ({self.cp_size} context-parallel ranks)" if self.cp_size > 1 else ""
            raise ValueError(
                f"slice {index} of microbatch {microbatch} has {query.shape[0]} tokens{share} but the "
                f"slicing {list(lengths)} gives it {lengths[index]}"
            )
        cache = ctx.layer_cache(self)
        if self.cp_group is not None:
            out = context_parallel_attention(
                query, key, value, cache, index, scale, backend, self.cp_group, ctx
            )
        else:
            out = sliced_attention(query, key, value, cache, index, scale, backend, ctx)
        if not need_grad and ctx.is_last_slice():
            cache.close()  # a forward-only pass is over for this microbatch and layer
        return out


def _context_parallel_group(config: Any, cp_group: Any, pg_collection: Any) -> Any:
    """The context-parallel group to attend over, or None. ``cp_group`` wins; otherwise Megatron's
    ``pg_collection.cp``, but only when ``config.context_parallel_size`` > 1 (a model built without
    CP in a world with a CP group, such as a single-process reference, attends alone)."""
    size = int(getattr(config, "context_parallel_size", 1) or 1)
    group = cp_group
    if group is None and size > 1:
        group = getattr(pg_collection, "cp", None)
        if group is None:
            raise ValueError(
                f"context_parallel_size={size} but no context-parallel group: pass cp_group or "
                "Megatron's pg_collection"
            )
    if group is None:
        return None
    ranks = torch.distributed.get_world_size(group)
    if size > 1 and ranks != size:
        raise ValueError(f"context_parallel_size={size} but the context-parallel group has {ranks} ranks")
    return group if ranks > 1 else None


def attach_slice_context(model: torch.nn.Module, slice_context: SliceContext | None) -> int:
    """Give every SlicedCoreAttention in ``model`` (one model chunk) the chunk's context; return
    how many there were."""
    count = 0
    for module in model.modules():
        if isinstance(module, SlicedCoreAttention):
            module.slice_context = slice_context
            count += 1
    return count
