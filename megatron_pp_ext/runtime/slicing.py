"""Sequence slices on the runtime: how a microbatch is cut, the data each slice sees, its loss.

A schedule with ``slices = k > 1`` runs every microbatch as k (microbatch, slice) units. The
runtime keeps Megatron's ``forward_step_func`` contract: the data iterators yield whole
microbatches, once per microbatch, and :class:`SliceFeeder` hands ``forward_step_func`` the
slice that runs now (``slice_batch`` cuts every ``[b, S]`` tensor of the batch along the
sequence). Before each forward the chunk's ``SliceContext`` learns which (microbatch, slice)
runs, so sliced attention finds its K/V cache and rotary embeddings their positions.

The loss of a sliced microbatch is normalised over the whole microbatch: ``loss_func`` must give
``(loss_sum, num_tokens, report)`` (Megatron's pretrain_gpt form); each slice keeps its raw sum,
and its backward (which runs after every slice of the microbatch has run forward, as the last
slice's backward comes first) scales it by 1 / (tokens of all slices) / microbatches. The
reports of a microbatch's slices are summed into one report per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..attention import SliceContext, SlicedCoreAttention
from ..schedule.ir import Op, Schedule
from ..schedule.models import ModelShape
from ..schedule.partition import DEFAULT_UNIT, slice_lengths
from ..schedule.validate import slice_order_error

SliceFn = Callable[[Any, int, int, int], Any]  # (batch, start, end, seq_length) -> slice


def plan_slices(
    schedule: Schedule,
    seq_length: int,
    shape: ModelShape,
    partition: str | None = None,
    unit: int = DEFAULT_UNIT,
) -> tuple[int, ...]:
    """Slice lengths for ``schedule``: its ``meta["partition"]`` ("uniform" or "balanced") unless
    ``partition`` overrides it. Raises PartitionError naming the flag and the nearest valid values."""
    chosen = partition or schedule.meta.get("partition", "uniform")
    return tuple(slice_lengths(chosen, shape, seq_length, schedule.slices, unit))


def slice_batch(batch: Any, start: int, end: int, seq_length: int) -> Any:
    """Tokens [start, end) of a Megatron batch: every tensor ``[b, S]`` is cut along dim 1, a
    ``[b, 1, S, S]`` attention mask to its rows [start, end) and keys [0, end); other values pass
    unchanged. Dicts, lists and tuples are walked."""
    if isinstance(batch, Tensor):
        if batch.dim() == 2 and batch.shape[1] == seq_length:
            return batch[:, start:end]
        if batch.dim() == 4 and batch.shape[2] == batch.shape[3] == seq_length:
            return batch[:, :, start:end, :end]
        return batch
    if isinstance(batch, dict):
        return {key: slice_batch(value, start, end, seq_length) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(value, start, end, seq_length) for value in batch)
    return batch


class SliceFeeder:
    """One chunk's data iterator during a sliced step: pulls a whole microbatch from ``source``
    when its first slice asks for data and yields the slice that :meth:`select` named."""

    def __init__(self, source: Iterator[Any], lengths: Sequence[int], cut: SliceFn = slice_batch) -> None:
        self.source = source
        self.lengths = tuple(lengths)
        self.starts = [sum(self.lengths[:j]) for j in range(len(self.lengths) + 1)]
        self.cut = cut
        self._current: tuple[int, int] | None = None
        self._batch: tuple[int, Any] | None = None  # (microbatch, whole batch)

    def select(self, microbatch: int, slice_index: int) -> None:
        self._current = (microbatch, slice_index)

    def __iter__(self) -> SliceFeeder:
        return self

    def __next__(self) -> Any:
        if self._current is None:
            raise RuntimeError("no slice selected: the runtime calls select() before each forward")
        microbatch, index = self._current
        if self._batch is None or self._batch[0] != microbatch:
            self._batch = (microbatch, next(self.source))
        batch = self._batch[1]
        if index == len(self.lengths) - 1:
            self._batch = None  # the last slice: the whole batch is no longer needed
        return self.cut(batch, self.starts[index], self.starts[index + 1], self.starts[-1])


@dataclass
class SliceLosses:
    """What the loss stage collected from one microbatch's slices so far. ``total``: under
    context parallelism, the count of all CP ranks (set after the last slice's forward)."""

    num_tokens: Tensor | int = 0
    reports: list[Any] = field(default_factory=list)
    total: Tensor | int | None = None

    def add(self, num_tokens: Tensor | int, report: Any) -> None:
        self.num_tokens = self.num_tokens + num_tokens
        self.reports.append(report)

    def normaliser(self, num_microbatches: int, cp_size: int = 1) -> Callable[[Tensor], Tensor]:
        """Scales a slice's raw loss sum like Megatron scales a whole microbatch's, by the token
        count of all its slices, read when the backward runs (all slices have run forward).
        Under CP by ``cp_size`` / the count of all CP ranks (DDP averages over DP x CP)."""

        def normalise(loss: Tensor) -> Tensor:
            count = self.num_tokens if self.total is None else self.total
            loss = loss / torch.clamp(torch.as_tensor(count, device=loss.device), min=1)
            return (loss if cp_size == 1 else loss * cp_size) / num_microbatches

        return normalise


def sliced_loss(result: Any) -> tuple[Tensor, Tensor | int, Any]:
    """Check a ``loss_func`` result of a slice: the three-value form is needed."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise ValueError(
            "sequence-sliced schedules need loss_func to return (loss_sum, num_tokens, report), "
            "so the loss of a microbatch is normalised over all its slices' tokens; the two-value "
            "form (an already averaged loss) cannot be combined exactly"
        )
    return result[0], result[1], result[2]


def combine_reports(reports: Sequence[Any]) -> Any:
    """One report for a microbatch: the slices' reports summed (Megatron's reports are sums and
    token counts, so the sum is the unsliced report)."""
    first = reports[0]
    if isinstance(first, dict):
        return {key: combine_reports([report[key] for report in reports]) for key in first}
    if isinstance(first, (Tensor, int, float)):
        total = first
        for report in reports[1:]:
            total = total + report
        return total
    raise TypeError(
        f"cannot combine the loss reports of a microbatch's slices: {type(first).__name__} is not a "
        "tensor, a number or a dict of them"
    )


SEQUENCE_LOAD_BALANCING = ("aux_loss", "none")  # what a sliced router computes per sequence


def check_sliced_moe(config: Any, schedule: Schedule | None = None) -> None:
    """Refuse mixture-of-experts statistics that slices cannot give. Routing is per token; the
    load-balancing loss and the z-loss are the sequence's through ``megatron/sliced_router.py``,
    which reads the sequence's tokens per expert at the first backward: ``schedule`` must run
    every slice of a microbatch forward before that (``validate.slice_order_error``). Other
    load-balancing types (``seq_aux_loss`` reshapes by the slice's length, ``global_aux_loss``
    accumulates in forward order) and a capacity factor (it drops tokens by the sequence's counts)
    would be per slice: another loss."""
    if getattr(config, "num_moe_experts", None) is None:
        return
    found = []
    balancing = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    types = balancing if isinstance(balancing, list) else [balancing]
    if getattr(config, "moe_aux_loss_coeff", 0.0) and any(t not in SEQUENCE_LOAD_BALANCING for t in types):
        found.append(f"--moe-router-load-balancing-type {' '.join(map(str, types))}")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        found.append(f"--moe-expert-capacity-factor {config.moe_expert_capacity_factor}")
    if found:
        raise ValueError(
            f"{', '.join(found)}: a sequence-sliced schedule would compute it per slice, not per "
            "sequence (token dropping and these load-balancing statistics are not the sequence's "
            "under slices); use --moe-router-load-balancing-type aux_loss, or drop the capacity "
            "factor, or run an unsliced schedule"
        )
    uses_statistics = getattr(config, "moe_aux_loss_coeff", 0.0) or getattr(config, "moe_z_loss_coeff", None)
    if schedule is not None and uses_statistics:
        error = slice_order_error(schedule)
        if error is not None:
            raise ValueError(
                f"{schedule.name}: {error}; the mixture-of-experts load-balancing loss needs every "
                "slice's routing before a backward: set --moe-aux-loss-coeff 0 or use another schedule"
            )


def slice_contexts(chunks: Sequence[torch.nn.Module]) -> list[SliceContext]:
    """Each chunk's SliceContext (the one its SlicedCoreAttention layers share)."""
    contexts = []
    for index, chunk in enumerate(chunks):
        found = None
        for module in chunk.modules():
            if isinstance(module, SlicedCoreAttention) and module.slice_context is not None:
                found = module.slice_context
                break
        if found is None:
            raise ValueError(
                f"model chunk {index} cannot run sequence slices: it has no SlicedCoreAttention with "
                "a SliceContext; build it with build_chunks(..., sliced=True) or the sliced layer "
                "spec plus megatron_pp_ext.megatron.sliced.enable_slicing"
            )
        contexts.append(found)
    return contexts


class StepSlicing:
    """The slices of one step on one rank: lengths, the chunks' contexts and data feeders."""

    def __init__(
        self,
        lengths: Sequence[int],
        chunks: Sequence[torch.nn.Module],
        iterators: Sequence[Iterator[Any] | None],
        cut: SliceFn | None = None,
    ) -> None:
        self.lengths = tuple(lengths)
        self.contexts = slice_contexts(chunks)
        seq_length = sum(self.lengths)
        for context in self.contexts:
            context.release()  # whatever a failed step left
            context.set_slicing(self.lengths, seq_length)
        self.feeders = [
            None if it is None else SliceFeeder(it, self.lengths, cut or slice_batch) for it in iterators
        ]

    def shape_fn(self, full_shape: Sequence[int]) -> Callable[[Op], tuple[int, ...]]:
        """Message shape of an op: the whole microbatch's (S, b, h) with S cut to the slice."""
        rest = tuple(int(n) for n in full_shape[1:])
        if int(full_shape[0]) != sum(self.lengths):
            raise ValueError(
                f"slice lengths {list(self.lengths)} sum to {sum(self.lengths)} tokens but the "
                f"activation shape has sequence length {full_shape[0]}"
            )
        return lambda op: (self.lengths[op.slice], *rest)

    @contextmanager
    def running(self, chunk_index: int, op: Op) -> Iterator[None]:
        """Tell chunk ``chunk_index`` that the forward of ``op``'s (microbatch, slice) runs."""
        feeder = self.feeders[chunk_index]
        if feeder is not None:
            feeder.select(op.microbatch, op.slice)
        with self.contexts[chunk_index].running(op.microbatch, op.slice):
            yield

    def release(self) -> None:
        """Drop every K/V cache (after a failed step)."""
        for context in self.contexts:
            context.release()
