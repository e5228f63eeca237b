"""Transformer Engine's own B/W split, driven by our W ops.

TE linears (TE >= 2.3) built with ``delay_wgrad_compute`` (megatron-core's TE wrappers pass
``config.delay_wgrad_compute``; ``megatron/model.py`` sets it for chunks of a B/W-split schedule)
keep each backward's weight-gradient GEMM, with its input and output gradient, in a first-in
first-out queue (``module.wgrad_store``) instead of running it, when that store is enabled both at
the forward and at the backward. ``module.backward_dw()`` pops the oldest entry and runs it.

How our runtime drives it (facts read in TE 2.3 and 2.20, ``module/base.py``, ``module/linear.py``):

- Deferral is enabled only inside this chunk's F, B and W ops (:meth:`TELinears.deferring`). Any
  other backward (a BW op, a reference model, a probe) computes TE's weight gradient at once, as
  TE without the flag does.
- Each B records its key, and W must come in the same order per chunk, since TE pops the oldest
  entry: asserted (every split generator orders a stage's W like its B).
- Without gradient-accumulation fusion ``backward_dw`` *sets* ``weight.grad`` (2.3: only when it
  is None) and ``bias.grad`` when None; with fusion TE adds into ``main_grad`` itself. W therefore
  clears those ``.grad`` fields around the call and adds what TE left there with
  :func:`accumulate_grad`, as our own deferred linears do. Megatron's DDP is not told
  ``delay_wgrad_compute``: its hooks stay on the parameters, so a BW op's gradient reaches
  ``main_grad`` the usual way (DDP's module hooks would only fire in ``backward_dw``).
- A B that left no entry in a deferring module's queue means its weight gradient was computed in
  B and dropped (the forward ran without deferral): an error, never a silent full gradient in B.
- What TE's queue keeps alive until W (the GEMM's input and output gradient) is handed to the
  activation meter, like our own store's deferred tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

Key = Any


def te_store(module: torch.nn.Module) -> Any:
    """The TE weight-gradient store of ``module`` (None when it is not a TE linear)."""
    store = getattr(module, "wgrad_store", None)
    return store if hasattr(store, "enable_delay_wgrad_compute") and hasattr(module, "backward_dw") else None


def _defers(store: Any) -> bool:
    """Built with ``delay_wgrad_compute``: only then does TE give the store a queue."""
    return getattr(store, "context", None) is not None


def _named(module: torch.nn.Module, names: Any) -> list[Tensor]:
    return [p for name in names or () if (p := getattr(module, name, None)) is not None]


class TELinears:
    """The TE linears of one chunk that defer their weight gradient, and the keys of the B ops
    whose weight gradients TE holds, oldest first."""

    def __init__(self, chunk: torch.nn.Module, deferring: bool = True) -> None:
        """``deferring``: the chunk has W ops. Then every TE linear must have been built with
        ``delay_wgrad_compute``; without W ops the deferring ones are merely kept switched off."""
        self.modules: list[torch.nn.Module] = []
        self.names: list[str] = []
        for name, module in chunk.named_modules():
            store = te_store(module)
            if store is None or (not deferring and not _defers(store)):
                continue
            if not _defers(store):
                raise ValueError(
                    f"Transformer Engine linear {name or type(module).__name__} was built without "
                    "delay_wgrad_compute, so a B op would compute its full weight gradient: build "
                    "the chunk with defer_te_wgrad=True (megatron_pp_ext.megatron.model)"
                )
            if deferring and store.context.qsize():
                raise RuntimeError(
                    f"Transformer Engine linear {name} still holds {store.context.qsize()} deferred "
                    "weight gradients of an earlier step that never reached W (a failed step not "
                    "discarded): their W would now apply them to the wrong microbatches"
                )
            self.modules.append(module)
            self.names.append(name)
        self.weights = [_named(m, getattr(m, "weight_names", ("weight",))) for m in self.modules]
        self.biases = [_named(m, getattr(m, "bias_names", ())) for m in self.modules]
        self._order: deque[Key] = deque()
        self.set_deferral(False)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def covered(self) -> list[Tensor]:
        """The weights whose gradient TE computes at W. Biases are not listed: a bias gradient
        that TE returns at B (FP8) is kept by the generic path, one it computes at W is added there."""
        return [w for weights in self.weights for w in weights]

    def set_deferral(self, on: bool) -> None:
        for module in self.modules:
            store = module.wgrad_store
            store.enable_delay_wgrad_compute() if on else store.disable_delay_wgrad_compute()

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """TE defers weight gradients inside the block (F, B and W ops of a deferring chunk)."""
        self.set_deferral(True)
        try:
            yield
        finally:
            self.set_deferral(False)

    def queued(self) -> list[int]:
        return [module.wgrad_store.context.qsize() for module in self.modules]

    def deferred(self, key: Key, before: list[int]) -> list[Tensor]:
        """After ``key``'s B (``before``: :meth:`queued` ahead of it): record the key and return
        the tensors TE's queues now keep for it."""
        tensors: list[Tensor] = []
        for name, module, count in zip(self.names, self.modules, before):
            entries = module.wgrad_store.context.queue  # queue.Queue's deque, oldest first
            if len(entries) != count + 1:
                raise RuntimeError(
                    f"B of {key}: Transformer Engine linear {name} queued {len(entries) - count} "
                    "weight gradients instead of 1 (its forward ran without deferral, or did not "
                    "run): run the chunk's forward under WeightGradStore.forwarding()"
                )
            tensor_list = entries[-1][0]
            tensors.extend(t for t in tensor_list if isinstance(t, Tensor))
        self._order.append(key)
        return tensors

    def apply(self, key: Key, accumulate: Callable[[Tensor, Tensor], None]) -> None:
        """W of ``key``: TE's ``backward_dw`` on every deferring linear (TE pops its oldest entry,
        which must be ``key``'s); ``accumulate(param, grad)`` adds what TE left in ``.grad``."""
        if not self._order or self._order[0] != key:
            oldest = self._order[0] if self._order else None
            raise RuntimeError(
                f"W for {key}: Transformer Engine computes deferred weight gradients first in, first "
                f"out, and the oldest B of this chunk is {oldest}: order each stage's W like its B"
            )
        self._order.popleft()
        with self.deferring():
            for module, weights, biases in zip(self.modules, self.weights, self.biases):
                params = weights + biases
                kept = [p.grad for p in params]
                for p in params:
                    p.grad = None
                module.backward_dw()
                for p, before in zip(params, kept):
                    fresh, p.grad = p.grad, before
                    if fresh is not None:
                        accumulate(p, fresh)

    def drop(self) -> None:
        """Forget every pending weight gradient (after a failed step)."""
        self._order.clear()
        for module in self.modules:
            entries = module.wgrad_store.context
            while entries.qsize():
                entries.get()

    def pending(self) -> list[Key]:
        return list(self._order)
