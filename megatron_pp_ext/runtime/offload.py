"""Activation offload on the runtime (PipeOffload): OFFLOAD and RELOAD ops move what a unit's
forward saved for its backward to host memory and back.

During the F of a unit that the schedule offloads, every tensor autograd saves
(``saved_tensors_hooks``) is packed into a handle that points at a :class:`_Stored` record of its
storage: a view and its base share one record, so an OFFLOAD copies each storage once and a
RELOAD rebuilds every view on the new device storage. Left on the device, because copying them
would cost more than it frees or would free nothing: parameters and views of them, storages under
``min_bytes``, tensor subclasses and non-strided tensors, and storages that something besides the
saved tensors still holds (the K/V cache of sliced attention, a message being sent). A storage
saved by several units moves only once all of them have been offloaded.

The stage input is saved by the first layer and also kept by the runner (B returns its
gradient); the engine swaps the input tensor's data out with its storage and back, so it is
freed too.

Host buffers come from a pool keyed by byte size and are reused across steps. On an accelerator
they are pinned and the copies run on their own streams (device-to-host and host-to-device),
ordered by events: an OFFLOAD waits for the forward on the compute stream, a RELOAD for that
OFFLOAD, and the backward waits for the RELOAD when it first unpacks the unit's tensors. On CPU
the copies are synchronous into a separate pool, so accounting and ordering are real and
testable.

Accounting: the activation meter counts a storage until the device storage is really freed (a
finalizer releases it), and counts it again from a RELOAD; the pool counts host bytes.

Deferred weight gradients (B/W split): B unpacks the reloaded tensors as usual; what W still
needs (the weight GEMMs' inputs) stays on the device until W, held by the weight-gradient store.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..schedule.ir import Op, OpKind
from .memory import ActivationMeter, Hold

Unit = tuple[int, int, int]  # (stage, microbatch, slice)
Meta = tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]]  # dtype, offset, size, stride
DEFAULT_MIN_BYTES = 1024  # below this a copy costs more (latency, bookkeeping) than it frees


@dataclass
class OffloadStats:
    """What the copies of one step did."""

    offloaded_bytes: int = 0  # device to host
    reloaded_bytes: int = 0  # host to device
    offload_copies: int = 0
    reload_copies: int = 0
    held_elsewhere_bytes: int = 0  # storages an OFFLOAD left on the device because others hold them
    host_peak_bytes: int = 0  # most host buffer bytes in use at once
    host_buffers_allocated: int = 0  # new host buffers (0 once the pool is warm)
    copy_seconds: float = 0.0  # CPU: time spent copying; accelerator: time to issue the copies


class HostPool:
    """Host buffers (bytes) by size, reused across steps: the pool keeps as many buffers of a
    size as were ever in use at once. Each free buffer carries the event of its last copy on an
    accelerator: the next copy into it waits for that event."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[tuple[Tensor, Any]]] = defaultdict(list)
        self.reserved = 0  # bytes of every buffer allocated so far
        self.in_use = 0
        self.peak = 0
        self.allocations = 0

    def take(self, nbytes: int) -> tuple[Tensor, Any]:
        if self._free[nbytes]:
            buffer, event = self._free[nbytes].pop()
        else:
            buffer, event = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None
            self.reserved += nbytes
            self.allocations += 1
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return buffer, event

    def give(self, buffer: Tensor, event: Any) -> None:
        self.in_use -= buffer.numel()
        self._free[buffer.numel()].append((buffer, event))

    def reset_peak(self) -> None:
        self.peak = self.in_use


class _Saved:
    """What autograd keeps for one saved tensor: the tensor itself (it stays on the device), or
    its key and layout in the :class:`_Stored` record of its storage."""

    __slots__ = ("tensor", "hold", "stored", "key", "meta")

    def __init__(
        self,
        tensor: Tensor | None = None,
        hold: Hold | None = None,
        stored: _Stored | None = None,
        key: int = 0,
        meta: Meta | None = None,
    ) -> None:
        self.tensor = tensor
        self.hold = hold
        self.stored = stored
        self.key = key
        self.meta = meta

    def release(self) -> None:
        """Let go (the runner releases the stage input's handle after B, like a Hold)."""
        if self.hold is not None:
            self.hold.release()
        self.tensor = self.stored = None


class _Stored:
    """One device storage saved for backward: where its bytes are now and which units need it.

    ``device`` is a byte view of the whole device storage while it is there; ``host`` the host
    copy once made (kept until the record dies, so a second OFFLOAD copies nothing).
    ``originals`` are detached aliases of the saved tensors, handed back as long as the storage
    never moved; ``bound`` are tensors whose data follows the storage (the stage input)."""

    __slots__ = (
        "engine",
        "nbytes",
        "device",
        "ref",
        "hold",
        "host",
        "last_copy",
        "ready",
        "units",
        "offloaded",
        "originals",
        "bound",
        "next_key",
        "__weakref__",
    )

    def __init__(self, engine: OffloadEngine, storage: torch.UntypedStorage) -> None:
        self.engine = engine
        self.nbytes = storage.nbytes()
        self.host: Tensor | None = None
        self.last_copy: Any = None  # event of the last copy touching ``host``
        self.ready: Any = None  # event the compute stream waits for before using ``device``
        self.units: set[Unit] = set()
        self.offloaded: set[Unit] = set()
        self.originals: dict[int, Tensor] = {}
        self.bound: list[tuple[Tensor, Meta]] = []
        self.next_key = 0
        self.adopt(storage)

    def adopt(self, storage: torch.UntypedStorage) -> None:
        """Point at ``storage`` on the device and count it."""
        self.device: Tensor | None = _bytes_of(storage)
        self.ref = weakref.ref(storage)
        self.hold: Hold | None = self.engine.meter.hold(self.device)

    def keep(self, tensor: Tensor) -> int:
        self.originals[self.next_key] = tensor
        self.next_key += 1
        return self.next_key - 1

    def view(self, key: int, meta: Meta) -> Tensor:
        """The saved tensor ``key`` on the device (rebuilt on the reloaded storage if it moved)."""
        original = self.originals.get(key)
        if original is not None:
            return original
        if self.device is None:
            raise RuntimeError(
                f"a tensor saved by unit(s) {sorted(self.units)} is still in host memory: the "
                "schedule needs a RELOAD of the unit before its backward"
            )
        self.engine.wait(self)
        return _rebuild(self.device, meta)

    def others_hold(self) -> bool:
        """Whether a tensor that is not ours refers to the storage (so moving it frees nothing)."""
        storage = self.ref()
        if storage is None or _use_count is None:
            return False
        ours = 1 + len(self.originals) + len(self.bound)  # the byte view, aliases, bound tensors
        return _use_count(storage) > ours + 1  # + 1: the storage object asking

    def __del__(self) -> None:
        if self.host is not None:
            self.engine.pool.give(self.host, self.last_copy)
            self.host = None


def _bytes_of(storage: torch.UntypedStorage) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _rebuild(device_bytes: Tensor, meta: Meta) -> Tensor:
    dtype, offset, size, stride = meta
    return torch.empty(0, dtype=dtype, device=device_bytes.device).set_(
        device_bytes.untyped_storage(), offset, size, stride
    )


def _meta(tensor: Tensor) -> Meta:
    return (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def _storage_use_count() -> Any:
    """torch's count of references to a storage, if this torch exposes it."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    return lambda storage: counter(storage._cdata)


_use_count = _storage_use_count()


class OffloadEngine:
    """Moves the saved activations of one rank's offloaded units between device and host.

    One engine per :class:`PipelineRuntime` (its host pool and copy streams live across steps);
    :meth:`begin` arms it for a step whose op list has OFFLOAD ops."""

    def __init__(self, device: torch.device | str, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.accelerated = self.device.type != "cpu"
        self.pool = HostPool(pin=self.accelerated)
        self.meter = ActivationMeter()
        self.stats = OffloadStats()
        self._allocations_before = 0  # pool allocations when the step began
        self._module: Any = torch.get_device_module(self.device) if self.accelerated else None
        self._streams: tuple[Any, Any] | None = None
        self._params: set[int] = set()
        self._selected: set[Unit] = set()
        self._units: dict[Unit, dict[int, _Stored]] = {}  # saved, not yet reloaded
        self._offloaded: set[Unit] = set()
        self._by_pointer: weakref.WeakValueDictionary[int, _Stored] = weakref.WeakValueDictionary()
        self._placeholders: dict[torch.dtype, Tensor] = {}

    # ---- a step ------------------------------------------------------------------------------

    def begin(self, meter: ActivationMeter, ops: Iterable[Op], parameters: Iterable[Tensor]) -> bool:
        """Arm the engine for a step running ``ops`` (this rank's list); False if it has no
        OFFLOAD, in which case the engine stays out of the way."""
        self.discard()
        self._selected = {op.unit for op in ops if op.kind == OpKind.OFFLOAD}
        self.meter = meter
        self.stats = OffloadStats()
        self.pool.reset_peak()
        self._allocations_before = self.pool.allocations
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        return bool(self._selected)

    def finish(self) -> None:
        """End of a step: every offloaded unit must have been reloaded; wait for the copies."""
        stranded = sorted(unit for unit in self._units if unit in self._offloaded)
        if stranded:
            raise RuntimeError(f"units {stranded} were offloaded and never reloaded")
        self._synchronize()
        self.stats.host_peak_bytes = self.pool.peak
        self.stats.host_buffers_allocated = self.pool.allocations - self._allocations_before
        self._units.clear()
        self._offloaded.clear()

    def discard(self) -> None:
        """Forget the step (after a failure): wait for copies in flight, drop the records."""
        self._synchronize()
        self._units.clear()
        self._offloaded.clear()
        self._by_pointer.clear()

    # ---- F -----------------------------------------------------------------------------------

    @contextmanager
    def saving(self, unit: Unit, input_tensor: Tensor | None) -> Iterator[Any]:
        """The forward of ``unit`` runs inside: count (and, for an offloaded unit, take charge
        of) what autograd saves. Yields the handle to release after the unit's backward for the
        stage input (something with ``release()``, like a :class:`Hold`)."""
        if unit not in self._selected:
            with self.meter.saving():
                yield self.meter.hold(input_tensor)
            return
        self._units[unit] = {}
        handle = _Saved() if input_tensor is None else self._pack(unit, input_tensor, bind=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: self._pack(unit, tensor), _unpack):
            yield handle

    def _movable(self, tensor: Tensor) -> bool:
        if type(tensor) is not Tensor or tensor.layout != torch.strided or tensor.device != self.device:
            return False
        if tensor.is_conj() or tensor.is_neg():
            return False
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        return pointer != 0 and pointer not in self._params and storage.nbytes() >= self.min_bytes

    def _pack(self, unit: Unit, tensor: Tensor, bind: bool = False) -> _Saved:
        if not self._movable(tensor):
            return _Saved(tensor=tensor.detach(), hold=self.meter.hold(tensor))  # see memory.saving
        storage = tensor.untyped_storage()
        stored = self._by_pointer.get(storage.data_ptr())
        if stored is None or stored.ref() is not storage:
            stored = _Stored(self, storage)
            self._by_pointer[storage.data_ptr()] = stored
        elif stored.device is None:  # moved out, but someone kept the device storage alive
            stored.adopt(storage)
        stored.units.add(unit)
        self._units[unit][id(stored)] = stored
        meta = _meta(tensor)
        if bind:
            stored.bound.append((tensor, meta))
        return _Saved(stored=stored, key=stored.keep(tensor.detach()), meta=meta)

    # ---- OFFLOAD and RELOAD ------------------------------------------------------------------

    def offload(self, unit: Unit) -> None:
        """Copy out every storage of ``unit`` that can go (see the module docstring)."""
        records = self._units.get(unit)
        if records is None:
            raise RuntimeError(f"OFFLOAD of unit {unit}: its forward has not run on this rank")
        self._offloaded.add(unit)
        started = time.perf_counter()
        for stored in records.values():
            stored.offloaded.add(unit)
            if stored.device is None or not stored.units <= stored.offloaded:
                continue
            if stored.others_hold():
                self.stats.held_elsewhere_bytes += stored.nbytes
                continue
            self._copy_out(stored)
        self.stats.copy_seconds += time.perf_counter() - started

    def reload(self, unit: Unit) -> None:
        """Bring ``unit``'s storages back to the device (the copies may still be running)."""
        if unit not in self._offloaded:
            raise RuntimeError(f"RELOAD of unit {unit} before its OFFLOAD")
        started = time.perf_counter()
        for stored in self._units.pop(unit).values():
            if stored.device is None:
                self._copy_in(stored)
        self.stats.copy_seconds += time.perf_counter() - started

    def _copy_out(self, stored: _Stored) -> None:
        if stored.host is None:
            stored.host, free = self.pool.take(stored.nbytes)
            stored.last_copy = self._copy(stored.host, stored.device, free, to_host=True)
            self.stats.offloaded_bytes += stored.nbytes
            self.stats.offload_copies += 1
        for tensor, _ in stored.bound:
            tensor.data = self._placeholder(tensor.dtype)
        storage, hold = stored.ref(), stored.hold
        stored.device = stored.hold = None
        stored.originals.clear()
        if storage is not None and hold is not None:
            weakref.finalize(storage, hold.release)  # counted until it is really freed

    def _copy_in(self, stored: _Stored) -> None:
        storage = stored.ref()
        if storage is not None:  # never freed (someone else kept it): nothing to copy
            stored.adopt(storage)
        else:
            target = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
            stored.ready = self._copy(target, stored.host, stored.last_copy, to_host=False)
            stored.last_copy = stored.ready
            stored.adopt(target.untyped_storage())
            self.stats.reloaded_bytes += stored.nbytes
            self.stats.reload_copies += 1
        assert stored.device is not None
        for tensor, meta in stored.bound:
            tensor.data = _rebuild(stored.device, meta)

    def _copy(self, target: Tensor, source: Tensor, after: Any, to_host: bool) -> Any:
        """``target.copy_(source)``: synchronous on CPU; on an accelerator on the copy stream for
        the direction, after the compute stream's work so far and the event ``after``. Returns
        the copy's event (None on CPU)."""
        if not self.accelerated:
            target.copy_(source)
            return None
        d2h, h2d = self._copy_streams()
        stream = d2h if to_host else h2d
        stream.wait_stream(self._module.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with self._module.stream(stream):
            target.copy_(source, non_blocking=True)
            event = stream.record_event()
        (source if to_host else target).record_stream(stream)  # not reused while copying
        return event

    def wait(self, stored: _Stored) -> None:
        """Make the compute stream wait for ``stored``'s reload (once)."""
        if stored.ready is not None:
            self._module.current_stream(self.device).wait_event(stored.ready)
            stored.ready = None

    def _copy_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (self._module.Stream(self.device), self._module.Stream(self.device))
        return self._streams

    def _synchronize(self) -> None:
        if self._streams is not None:
            for stream in self._streams:
                stream.synchronize()

    def _placeholder(self, dtype: torch.dtype) -> Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._placeholders[dtype]


@contextmanager
def saving(
    engine: OffloadEngine | None, meter: ActivationMeter, unit: Unit, input_tensor: Tensor | None
) -> Iterator[Any]:
    """The forward of ``unit`` runs inside: its saved tensors (and the stage input, whose handle
    this yields for release after the backward) are counted by ``meter``, or taken in charge by
    ``engine`` when it offloads the unit."""
    if engine is not None:
        with engine.saving(unit, input_tensor) as handle:
            yield handle
        return
    with meter.saving():
        yield meter.hold(input_tensor)


def _unpack(saved: _Saved) -> Tensor:
    if saved.stored is None:
        assert saved.tensor is not None
        return saved.tensor
    assert saved.meta is not None
    return saved.stored.view(saved.key, saved.meta)
