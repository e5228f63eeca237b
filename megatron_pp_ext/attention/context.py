"""What the pipeline runtime tells a model chunk's sliced attention layers.

One ``SliceContext`` per model chunk (no global state). Before running the forward of
(microbatch m, slice j) the runtime calls ``begin(m, j)``; every sliced attention layer of the
chunk then reads the current slice from here and keeps its K/V cache for microbatch m here.
Backward needs no call: each slice's graph already knows its cache. A microbatch's caches are
freed as its slices finish backward (all of them after slice 0), after the last slice of a
forward-only pass when the slicing is known, or by ``release(m)``.

With attention redistribution (SlimPipe) the runtime also sets ``current_delegation`` around
each F/B/BW op that hands its oldest K/V slices to a partner rank (the backward runs later under
autograd and reads the delegation of the B op running then, not its F's), ``current_service``
around each op that serves a partner's (its attention calls serve one request each), and
``delegating`` for a step in which any op of the chunk delegates, so the layers pick an explicit
kernel. Sliced
attention counts the query-key pairs it computes here and those it hands away.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .cache import LayerCache
from .remote import PartnerService, RemoteKeys
from .slicing import SlicingError, check_slicing, slice_offsets


class SliceContext:
    """Current (microbatch, slice) of a model chunk, its slicing, and its K/V caches."""

    def __init__(
        self,
        slice_lengths: Sequence[int] | None = None,
        seq_length: int | None = None,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        """``grad_dtype``: dtype of the sums of cached-K/V gradients (None: the K/V dtype)."""
        self.grad_dtype = grad_dtype
        self._slicing: dict[int | None, tuple[int, ...]] = {}
        if slice_lengths is not None:
            self.set_slicing(slice_lengths, seq_length)
        self._current: tuple[int, int] | None = None
        self._caches: dict[tuple[int, Hashable], LayerCache] = {}
        self.current_delegation: RemoteKeys | None = None  # set by the runtime per F/B op
        self.current_service: PartnerService | None = None  # set by the runtime per light op
        self.delegating = False  # some op of this step delegates: the layers need a kernel
        # Query-key pairs x passes (forward 1, backward 2) x sequences, summed over layers:
        # computed here, and handed to partners.
        self.pairs_local = 0
        self.pairs_remote = 0

    def count_pairs(self, local: int, remote: int) -> None:
        self.pairs_local += local
        self.pairs_remote += remote

    # --- slicing -----------------------------------------------------------------------------
    def set_slicing(
        self, slice_lengths: Sequence[int], seq_length: int | None = None, microbatch: int | None = None
    ) -> None:
        """Slice lengths for ``microbatch`` (None: the default for all microbatches)."""
        self._slicing[microbatch] = check_slicing(slice_lengths, seq_length)

    def slicing(self, microbatch: int | None = None) -> tuple[int, ...] | None:
        """Slice lengths of ``microbatch`` (default: the current one), or None if never set."""
        if microbatch is None and self._current is not None:
            microbatch = self._current[0]
        return self._slicing.get(microbatch, self._slicing.get(None))

    def slice_bounds(self, slice_index: int | None = None, microbatch: int | None = None) -> tuple[int, int]:
        """[start, end) token positions of a slice (default: the current one) in its sequence."""
        microbatch, slice_index = self._pick(microbatch, slice_index)
        lengths = self.slicing(microbatch)
        if lengths is None:
            raise SlicingError(f"no slicing set for microbatch {microbatch}; call set_slicing first")
        if not 0 <= slice_index < len(lengths):
            raise SlicingError(
                f"slice {slice_index} is out of range: microbatch {microbatch} has {len(lengths)} slices"
            )
        offsets = slice_offsets(lengths)
        return offsets[slice_index], offsets[slice_index + 1]

    def position_offset(self, slice_index: int | None = None, microbatch: int | None = None) -> int:
        """Position of a slice's first token: what rotary embeddings of that slice start from."""
        return self.slice_bounds(slice_index, microbatch)[0]

    # --- the running slice -------------------------------------------------------------------
    def begin(self, microbatch: int, slice_index: int) -> None:
        """Set the (microbatch, slice) whose forward runs next."""
        lengths = self.slicing(microbatch)
        if slice_index < 0 or (lengths is not None and slice_index >= len(lengths)):
            count = "?" if lengths is None else len(lengths)
            raise SlicingError(
                f"slice {slice_index} is out of range: microbatch {microbatch} has {count} slices"
            )
        self._current = (microbatch, slice_index)

    def end(self) -> None:
        """No slice is running (attention layers then refuse to run)."""
        self._current = None

    @contextmanager
    def running(self, microbatch: int, slice_index: int) -> Iterator[SliceContext]:
        """``with ctx.running(m, j): chunk(x_j)`` runs the forward of slice j of microbatch m."""
        self.begin(microbatch, slice_index)
        try:
            yield self
        finally:
            self.end()

    @property
    def current(self) -> tuple[int, int] | None:
        """(microbatch, slice) set by ``begin``, or None."""
        return self._current

    def _pick(self, microbatch: int | None = None, slice_index: int | None = None) -> tuple[int, int]:
        if self._current is None and (microbatch is None or slice_index is None):
            raise SlicingError("no slice is running: call begin(microbatch, slice) before the forward")
        cur_mb, cur_slice = self._current if self._current else (None, None)
        return (cur_mb if microbatch is None else microbatch), (
            cur_slice if slice_index is None else slice_index
        )

    def is_last_slice(self) -> bool | None:
        """Whether the running slice is its microbatch's last (None: slicing unknown)."""
        microbatch, slice_index = self._pick()
        lengths = self.slicing(microbatch)
        return None if lengths is None else slice_index == len(lengths) - 1

    # --- caches ------------------------------------------------------------------------------
    def layer_cache(self, layer: Hashable) -> LayerCache:
        """The cache of ``layer`` for the running microbatch (created on its first slice)."""
        microbatch, _ = self._pick()
        key = (microbatch, layer)
        cache = self._caches.get(key)
        if cache is None:
            name = f"microbatch {microbatch}, layer {getattr(layer, 'layer_number', layer)}"

            def drop() -> None:
                if self._caches.get(key) is cache:
                    del self._caches[key]

            cache = LayerCache(name, self.grad_dtype, on_empty=drop)
            self._caches[key] = cache
        return cache

    def release(self, microbatch: int | None = None) -> None:
        """Drop the caches of ``microbatch`` (None: all), e.g. after a forward-only pass."""
        for key in [key for key in self._caches if microbatch is None or key[0] == microbatch]:
            del self._caches[key]

    def cached_microbatches(self) -> list[int]:
        """Microbatches that still hold a cache."""
        return sorted({mb for mb, _ in self._caches})

    def cached_bytes(self, microbatch: int | None = None) -> int:
        """Bytes the caches of ``microbatch`` (None: all) hold."""
        return sum(
            c.nbytes() for (mb, _), c in self._caches.items() if microbatch is None or mb == microbatch
        )
