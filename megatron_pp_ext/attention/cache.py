"""The K/V cache of one (microbatch, attention layer) across the slices of that microbatch.

Forward of slice j appends its K/V (detached aliases of the tensors the slice's own attention
saves anyway, so caching costs no extra memory). Backward runs slices in reverse order: slice
j's backward hands the gradients of the cached K/V of slices < j to ``add_grads``, where they
accumulate, and ``finish(j)`` gives slice j the sum that later slices sent it and drops its
entry. The whole cache reports itself empty after slice 0 finishes. Misordered calls raise
``SlicingError`` naming the slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .slicing import SlicingError


class LayerCache:
    """Per-slice K/V [b, g, s_i, d] of one microbatch in one layer, plus their gradient sums."""

    def __init__(
        self,
        name: str = "layer",
        grad_dtype: torch.dtype | None = None,
        on_empty: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.grad_dtype = grad_dtype
        self._on_empty = on_empty
        self._kv: list[tuple[Tensor, Tensor] | None] = []
        self._grads: list[tuple[Tensor, Tensor] | None] = []
        self._lengths: list[int] = []

    def __len__(self) -> int:
        """Slices that have run forward."""
        return len(self._kv)

    @property
    def finished(self) -> bool:
        """True once every slice that ran forward has run its backward."""
        return all(kv is None for kv in self._kv)

    def check_forward(self, index: int) -> None:
        if index == len(self):
            return
        if index < len(self):
            raise SlicingError(
                f"{self.name}: slice {index} runs forward again, but slices 0..{len(self) - 1} are cached "
                "(was the last pass's cache released? recompute of the core attention is not supported)"
            )
        raise SlicingError(
            f"{self.name}: slice {index} runs forward before slice {len(self)}; "
            "a microbatch's slices must run forward in order 0, 1, 2, ..."
        )

    def append(self, k: Tensor, v: Tensor) -> None:
        self._kv.append((k.detach(), v.detach()))
        self._grads.append(None)
        self._lengths.append(k.shape[2])

    def prefix(self, index: int, start: int = 0) -> tuple[Tensor, Tensor] | None:
        """K/V of slices ``start`` .. ``index - 1`` along the sequence (a new tensor when there
        are several; None when there are none)."""
        if index <= start:
            return None
        kvs = self._kv[start:index]
        if any(kv is None for kv in kvs):
            raise SlicingError(
                f"{self.name}: slice {index} needs K/V of earlier slices that were already freed"
            )
        if len(kvs) == 1:
            return kvs[0]
        return torch.cat([kv[0] for kv in kvs], dim=2), torch.cat([kv[1] for kv in kvs], dim=2)

    def check_backward(self, index: int) -> None:
        if index >= len(self) or self._kv[index] is None:
            state = "already ran its backward" if index < len(self) else "never ran forward"
            raise SlicingError(f"{self.name}: backward of slice {index}, which {state}")
        pending = [j for j in range(index + 1, len(self)) if self._kv[j] is not None]
        if pending:
            raise SlicingError(
                f"{self.name}: backward of slice {index} runs before that of slice(s) {pending}; "
                "a microbatch's slices must run backward in reverse order (last slice first)"
            )

    def add_grads(self, index: int, dk: Tensor, dv: Tensor, start: int = 0) -> None:
        """Spread the gradient of the K/V of slices ``start`` .. ``index - 1`` over those slices."""
        dks = dk.split(self._lengths[start:index], dim=2)
        dvs = dv.split(self._lengths[start:index], dim=2)
        for i, (dk_i, dv_i) in enumerate(zip(dks, dvs), start):
            if self.grad_dtype is not None:
                dk_i, dv_i = dk_i.to(self.grad_dtype), dv_i.to(self.grad_dtype)
            held = self._grads[i]
            self._grads[i] = (
                (dk_i.clone(), dv_i.clone()) if held is None else (held[0] + dk_i, held[1] + dv_i)
            )

    def finish(self, index: int) -> tuple[Tensor, Tensor] | None:
        """Slice ``index``'s backward is done: return what later slices sent it; free the entry."""
        grads = self._grads[index]
        self._kv[index] = None
        self._grads[index] = None
        if self.finished and self._on_empty is not None:
            self._on_empty()
        return grads

    def close(self) -> None:
        """Drop everything (end of a forward-only pass); later backward calls will raise."""
        self._kv = [None] * len(self._kv)
        self._grads = [None] * len(self._grads)
        if self._on_empty is not None:
            self._on_empty()

    def nbytes(self) -> int:
        """Bytes held by cached K/V and gradient sums (aliases counted as their own size)."""
        total = 0
        for item in (*self._kv, *self._grads):
            if item is not None:
                total += sum(t.numel() * t.element_size() for t in item)
        return total
