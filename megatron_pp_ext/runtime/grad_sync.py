"""Megatron's gradient and parameter synchronisation contract, for any schedule.

Megatron's schedules drive its ``DistributedDataParallel`` through three fields of the model
config (set by Megatron-LM's ``training.py``, one entry per model chunk, or one callable for a
single chunk):

- ``no_sync_func``: a context under which DDP's grad hooks only accumulate into ``main_grad``;
- ``grad_sync_func``: starts a chunk's data-parallel gradient reduction (``start_grad_sync``),
  asynchronous under ``overlap_grad_reduce``, once the chunk's gradients are complete;
- ``param_sync_func``: starts a chunk's parameter all-gather (distributed optimizer with
  ``overlap_param_gather``) ahead of its first forward.

Megatron's own schedules know when a chunk's gradients are complete from their fixed shape; here
it is read off the rank's op list: after the chunk's last weight-gradient op, which is its last W
under the B/W split (a B leaves the weight gradients to its W) and its last BW otherwise. Every
chunk stays under its ``no_sync`` until then, so DDP's hooks never dispatch a bucket early (they
do not fire at W at all: W adds into ``main_grad`` itself), and each chunk's reduction starts
exactly once per step, after its last contribution. Without ``grad_sync_func`` a DDP chunk with
``overlap_grad_reduce`` has its ``start_grad_sync`` called at that point, and without
``no_sync_func`` a DDP chunk's own ``no_sync`` is used, for the same reason. Everything left is
finished by ``finalize_model_grads`` (``finish_grad_sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..schedule.ir import Op, OpKind

WEIGHT_OPS = (OpKind.BW, OpKind.W)


class GradSync:
    """One step's synchronisation calls for one rank's chunks and op list."""

    def __init__(
        self,
        config: Any,
        chunks: Sequence[torch.nn.Module],
        ops: Sequence[Op],
        chunk_of: Callable[[int], int],
        forward_only: bool = False,
        late_chunks: Sequence[int] = (),
    ) -> None:
        """``late_chunks``: chunks whose gradients are complete only after the whole op list (the
        one holding the vocabulary-parallel shards, whose embedding gradient lands when the step's
        last BCAST_DEMB completes); they act at position ``len(ops)``, which the executor passes
        to :meth:`after` once those gradients are in."""
        self.chunks = list(chunks)
        count = len(self.chunks)
        no_sync = getattr(config, "no_sync_func", None)
        if no_sync is None and all(hasattr(chunk, "no_sync") for chunk in self.chunks):
            no_sync = [chunk.no_sync for chunk in self.chunks]
        grad_sync = getattr(config, "grad_sync_func", None)
        if grad_sync is None and all(_overlaps_grad_reduce(chunk) for chunk in self.chunks):
            grad_sync = [chunk.start_grad_sync for chunk in self.chunks]
        param_sync = getattr(config, "param_sync_func", None)
        # A single no_sync for several chunks covers them together (one slot of all chunks); a
        # single grad or param sync function serves each chunk with its own parameters, as
        # megatron-core's interleaved schedule copies it per chunk.
        self.no_sync, no_sync_slots = _per_slot(no_sync, count)
        self.grad_sync, grad_sync_slots = _per_slot(
            _per_chunk(None if forward_only else grad_sync, count), count
        )
        self.param_sync, param_sync_slots = _per_slot(_per_chunk(param_sync, count), count)
        last_weight: dict[int, int] = {}
        first_forward: dict[int, int] = {}
        for position, op in enumerate(ops):
            chunk = chunk_of(op.stage) if op.kind in WEIGHT_OPS or op.kind == OpKind.F else None
            if chunk is None:
                continue
            if op.kind in WEIGHT_OPS:
                last_weight[chunk] = position
            elif chunk not in first_forward:
                first_forward[chunk] = position
        for chunk in late_chunks:
            last_weight[chunk] = len(ops)
        self.end = len(ops)
        # position -> slots whose chunks are all done (or whose first forward is) at that op
        self._release = _positions(no_sync_slots, last_weight, max)
        self._grad_start = _positions(grad_sync_slots, last_weight, max)
        self._param_start = _positions(param_sync_slots, first_forward, min)
        self._open: dict[int, AbstractContextManager[Any]] = {}

    def begin(self) -> None:
        """Enter every chunk's ``no_sync``."""
        for slot, func in enumerate(self.no_sync or []):
            context = func()
            context.__enter__()
            self._open[slot] = context

    def before(self, position: int) -> None:
        """Start the parameter gather of the chunks whose first forward is at ``position``."""
        for slot in self._param_start.get(position, ()):
            self.param_sync[slot](self._parameters(slot, self.param_sync))

    def after(self, position: int) -> None:
        """After the last weight-gradient op of a chunk: leave its ``no_sync``, start its sync."""
        for slot in self._release.get(position, ()):
            self._close(slot)
        for slot in self._grad_start.get(position, ()):
            self.grad_sync[slot](self._parameters(slot, self.grad_sync))

    def finish(self) -> None:
        """Leave every ``no_sync`` still open (chunks with no weight op here, forward-only)."""
        for slot in list(self._open):
            self._close(slot)

    def _close(self, slot: int) -> None:
        context = self._open.pop(slot, None)
        if context is not None:
            context.__exit__(None, None, None)

    def _parameters(self, slot: int, funcs: list[Callable[..., Any]]) -> Any:
        if len(funcs) == len(self.chunks):
            return self.chunks[slot].parameters()
        return (param for chunk in self.chunks for param in chunk.parameters())


def _overlaps_grad_reduce(chunk: torch.nn.Module) -> bool:
    config = getattr(chunk, "ddp_config", None)
    return bool(getattr(config, "overlap_grad_reduce", False)) and hasattr(chunk, "start_grad_sync")


def _per_chunk(value: Any, count: int) -> Any:
    """A single callable as one per chunk (megatron-core's ``[func for _ in model]``)."""
    return [value] * count if callable(value) else value


def _per_slot(value: Any, count: int) -> tuple[list[Callable[..., Any]] | None, list[list[int]]]:
    """Megatron's field as (callables, chunk indices of each): a list has one per chunk, a single
    callable covers every chunk."""
    if value is None:
        return None, []
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{len(value)} sync functions in the model config for {count} model chunks")
        return list(value), [[index] for index in range(count)]
    return [value], [list(range(count))]


def _positions(
    slots: list[list[int]], positions: dict[int, int], pick: Callable[..., int]
) -> dict[int, list[int]]:
    """For each slot whose chunks all appear in ``positions``: the op position it acts at."""
    acting: dict[int, list[int]] = {}
    for slot, chunks in enumerate(slots):
        found = [positions[chunk] for chunk in chunks if chunk in positions]
        if found:
            acting.setdefault(pick(found), []).append(slot)
    return acting
