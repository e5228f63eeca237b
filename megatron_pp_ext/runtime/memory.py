"""Activation accounting: live activation bytes on one rank, and their peak.

Pipeline schedules differ mainly in how many microbatches' activations a rank holds at once, so
the runtime counts them itself instead of trusting the allocator (which on CPU reports nothing
and on GPU mixes in weights, gradients and caches). Counted are:

* what autograd saves for backward during a forward (``saved_tensors_hooks``),
* what a deferred W still holds after its B (inputs and output-gradients of the weight GEMMs,
  gradients computed at B and not yet applied),
* tensors the executor stashes: received inputs, outputs waiting to be sent, gradients in flight.

Bytes are counted once per underlying storage (views and aliases share it); parameter storages
are excluded. On GPU the executor also reports ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

StorageKey = tuple[str, int]


def _storage_key(tensor: Tensor) -> tuple[StorageKey, int] | None:
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    pointer = storage.data_ptr()
    if pointer == 0:
        return None
    return (str(tensor.device), pointer), storage.nbytes()


class Hold:
    """A reference to one tensor's storage in the meter; released explicitly or when collected."""

    __slots__ = ("_meter", "_key")

    def __init__(self, meter: ActivationMeter, key: StorageKey | None) -> None:
        self._meter = meter
        self._key = key

    def release(self) -> None:
        if self._key is not None:
            key, self._key = self._key, None
            self._meter._drop(key)

    def __del__(self) -> None:
        self.release()


class _Saved:
    """What autograd stores instead of a saved tensor: the tensor plus its hold."""

    __slots__ = ("tensor", "hold")

    def __init__(self, tensor: Tensor, hold: Hold) -> None:
        self.tensor = tensor
        self.hold = hold


class ActivationMeter:
    """Counts live activation bytes of one rank by storage, and remembers the peak.

    ``enabled=False``: counts nothing and costs nothing (no saved-tensor hooks, no-op holds),
    for runs that neither report nor check activation memory (a step then reports ``peak``
    None)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._refs: dict[StorageKey, list[int]] = {}  # key -> [holders, bytes]
        self._excluded: set[StorageKey] = set()
        self.live = 0
        self.peak: int | None = 0 if enabled else None
        self._nothing = Hold(self, None)

    def exclude(self, tensors: Iterable[Tensor]) -> None:
        """Never count these storages (model parameters)."""
        if not self.enabled:
            return
        for tensor in tensors:
            found = _storage_key(tensor)
            if found is not None:
                self._excluded.add(found[0])

    def hold(self, tensor: Tensor | None) -> Hold:
        if not self.enabled:
            return self._nothing
        found = None if tensor is None else _storage_key(tensor)
        if found is None or found[0] in self._excluded:
            return Hold(self, None)
        key, nbytes = found
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return Hold(self, key)

    def hold_all(self, tensors: Iterable[Tensor | None]) -> list[Hold]:
        if not self.enabled:
            return []
        return [self.hold(t) for t in tensors]

    def _drop(self, key: StorageKey) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live -= entry[1]

    def reset_peak(self) -> None:
        if self.enabled:
            self.peak = self.live

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count every tensor autograd saves for backward inside the block, for as long as the
        graph keeps it."""
        if not self.enabled:
            yield
            return

        def pack(tensor: Tensor) -> Any:
            # a new tensor object on the same storage: the executor frees a stage output it has
            # sent by swapping the object's storage (Megatron's deallocate_output_tensor), and
            # an op that saved its own output (tanh, sigmoid) must still find the values
            return _Saved(tensor.detach(), self.hold(tensor))

        def unpack(saved: Any) -> Tensor:
            return saved.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


@dataclass(frozen=True)
class OpMemory:
    """Activation bytes of one unit of one stage, for calibrating the simulator.

    ``forward``: what its F keeps alive until its backward (saved tensors and the stashed stage
    input; the output is sent and freed); ``after_backward``: what its deferred W still holds after
    B (the W share); ``after_weight``: left after W (should be 0).
    """

    forward: int
    after_backward: int
    after_weight: int


def measure_op_memory(
    chunk: torch.nn.Module,
    run_forward: Callable[[torch.nn.Module], Tensor],
    input_tensor: Tensor | None = None,
) -> OpMemory:
    """Measure one F, B and W of ``chunk`` in isolation.

    ``run_forward(chunk)`` runs the chunk's forward (after ``set_input_tensor``) and returns its
    output (a loss scalar on the last stage). ``input_tensor`` is the stage input (None on the
    first stage). Gradients land in the parameters, so call this on a scratch model.
    """
    from megatron.core.utils import get_attr_wrapped_model

    from .weight_grad import WeightGradStore, attach_store, run_backward

    meter = ActivationMeter()
    meter.exclude(chunk.parameters())
    store = WeightGradStore()
    uncovered = attach_store(chunk, store)
    holds: list[Hold] = []
    store.on_hold = lambda key, tensors: holds.extend(meter.hold_all(tensors))
    store.on_release = lambda key: [h.release() for h in holds]
    try:
        stage_input = None if input_tensor is None else input_tensor.detach().requires_grad_(True)
        input_hold = meter.hold(stage_input)
        get_attr_wrapped_model(chunk, "set_input_tensor")(stage_input)
        with meter.saving(), store.forwarding():
            output = run_forward(chunk)
        forward = meter.live
        grad = torch.ones_like(output) if output.numel() == 1 else torch.randn_like(output)
        inputs = ([stage_input] if stage_input is not None else []) + uncovered
        with store.collect("probe"):
            grads = run_backward(output, grad, inputs)
        for param, param_grad in zip(uncovered, grads[len(inputs) - len(uncovered) :]):
            if param_grad is not None:
                store.add("probe", param, param_grad)
        del output, grads, grad
        input_hold.release()
        stage_input = None
        after_backward = meter.live
        store.apply("probe")
        after_weight = meter.live
    finally:
        for module in chunk.modules():
            if getattr(module, "wgrad_store", None) is store:
                module.wgrad_store = None
    return OpMemory(forward=forward, after_backward=after_backward, after_weight=after_weight)


def measure_slice_memory(
    chunk: torch.nn.Module,
    context: Any,
    lengths: Sequence[int],
    run_forward: Callable[[torch.nn.Module, int], Tensor],
    make_input: Callable[[int], Tensor | None],
) -> list[OpMemory]:
    """:func:`measure_op_memory` for the k slices of one microbatch on a sliced chunk: forwards in
    slice order (each slice attends to the cached K/V of the earlier ones), then B and W of each
    slice last-first. ``forward`` of slice j is what its F adds; ``after_backward`` what its W
    still needs after its B. ``context`` is the chunk's SliceContext; ``run_forward(chunk, j)``
    runs slice j's forward, ``make_input(j)`` gives its stage input (None on the first stage)."""
    from megatron.core.utils import get_attr_wrapped_model

    from .weight_grad import WeightGradStore, attach_store, run_backward

    meter = ActivationMeter()
    meter.exclude(chunk.parameters())
    store = WeightGradStore()
    uncovered = attach_store(chunk, store)
    holds: dict[int, list[Hold]] = {}
    store.on_hold = lambda key, tensors: holds.setdefault(key, []).extend(meter.hold_all(tensors))
    store.on_release = lambda key: [h.release() for h in holds.pop(key, [])]
    context.release()
    context.set_slicing(list(lengths))
    forwards: list[int] = []
    units: list[tuple[Tensor | None, Hold, Tensor]] = []
    try:
        for j in range(len(lengths)):
            before = meter.live
            stage_input = make_input(j)
            if stage_input is not None:
                stage_input = stage_input.detach().requires_grad_(True)
            hold = meter.hold(stage_input)
            get_attr_wrapped_model(chunk, "set_input_tensor")(stage_input)
            with context.running(0, j), meter.saving(), store.forwarding():
                output = run_forward(chunk, j)
            units.append((stage_input, hold, output))
            forwards.append(meter.live - before)
        shares = [0] * len(lengths)
        for j in reversed(range(len(lengths))):
            stage_input, hold, output = units.pop()
            grad = torch.ones_like(output) if output.numel() == 1 else torch.randn_like(output)
            inputs = ([stage_input] if stage_input is not None else []) + uncovered
            with store.collect(j):
                grads = run_backward(output, grad, inputs)
            for param, param_grad in zip(uncovered, grads[len(inputs) - len(uncovered) :]):
                if param_grad is not None:
                    store.add(j, param, param_grad)
            del output, grads, grad, stage_input
            hold.release()
            after_backward = meter.live
            store.apply(j)
            shares[j] = after_backward - meter.live
    finally:
        context.release()
        for module in chunk.modules():
            if getattr(module, "wgrad_store", None) is store:
                module.wgrad_store = None
    return [OpMemory(forward=f, after_backward=s, after_weight=0) for f, s in zip(forwards, shares)]
