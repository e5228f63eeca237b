"""Which activations to offload to host memory (PipeOffload): the policies behind ``--pp-offload``.

* ``none``: no copies.
* ``full``: every unit (stage, microbatch, slice) that lives long enough to gain from a copy.
* ``selective``: the units of the model chunks in ``chunks`` (chunk indices on each rank); by
  default the one chunk whose units live longest, e.g. the first chunk of interleaved 1F1B. The
  longest-lived units are the ones alive at the peak, so offloading them lowers the peak more
  than their share of the activations.
* ``auto``: from PipeOffload's k (copy time over compute time, ``costs.offload_ratio``): full
  when k <= 1, else the longest-lived 1/k of each rank's units, so the copies stay hidden. A copy
  then takes about k times a unit's F+B+W, some 3k forward times, so auto also issues each RELOAD
  at least ceil(3k) compute ops ahead of its backward.

A unit's lifespan is the number of compute ops its rank runs between the unit's F and its B (or
BW): the schedule alone says it, no cost model needed. :func:`apply_offload` inserts the copies
with ``lowering.insert_offload``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .costs import CostModel, offload_fraction
from .generators.request import RequestError
from .ir import BACKWARD_KINDS, Op, OpKind, Schedule
from .lowering import Unit, insert_offload

POLICIES = ("none", "full", "selective", "auto")


class OffloadError(RequestError):
    """An offload request that cannot work; ``flag`` names the option to change."""


@dataclass(frozen=True)
class OffloadPolicy:
    """What ``--pp-offload`` and its knobs chose. ``ratio`` is k, which ``auto`` needs;
    ``lookahead`` is how many compute ops ahead of its B a RELOAD is issued."""

    mode: str = "none"
    chunks: tuple[int, ...] | None = None
    ratio: float | None = None
    lookahead: int = 1

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise OffloadError(
                f"unknown offload policy {self.mode!r}; choose from {', '.join(POLICIES)}", "--pp-offload"
            )
        if self.chunks is not None and self.mode != "selective":
            raise OffloadError("--pp-offload-chunks needs --pp-offload selective", "--pp-offload-chunks")
        if self.ratio is not None and not self.ratio > 0:
            raise OffloadError(f"k must be positive, got {self.ratio}", "--pp-offload")
        if self.lookahead < 0:
            raise OffloadError(
                f"the reload lookahead must be at least 0 (compute ops), got {self.lookahead}",
                "--pp-offload-lookahead",
            )


def parse_chunks(text: str | Iterable[int] | None) -> tuple[int, ...] | None:
    """``"0,2"`` (or a list) -> (0, 2); None or "" -> None (the policy's default)."""
    if text is None or text == "":
        return None
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        chunks = tuple(sorted({int(part) for part in parts}))
    except ValueError:
        raise OffloadError(
            f"expected chunk indices like 0 or 0,1, got {text!r}", "--pp-offload-chunks"
        ) from None
    if min(chunks) < 0:
        raise OffloadError(f"chunk indices start at 0, got {text!r}", "--pp-offload-chunks")
    return chunks


def add_offload_args(parser: argparse.ArgumentParser, simulator: bool = False) -> None:
    """``--pp-offload`` and its knobs, for ``simulate`` and for Megatron's command line (the hook
    and ``train``); the simulator also takes ``--pp-ranks-per-host``."""
    group = parser.add_argument_group("activation offload to host memory (PipeOffload)")
    group.add_argument(
        "--pp-offload",
        choices=POLICIES,
        default="none",
        help="copy activations to host memory: every unit (full), the longest-lived chunk or "
        "--pp-offload-chunks (selective), or the share that k allows (auto)",
    )
    group.add_argument("--pp-offload-chunks", default=None, help="chunk indices to offload, e.g. 0 or 0,1")
    bandwidth = "bytes/s with --model (default 50e9), else M per time unit (default: no time)"
    group.add_argument(
        "--pp-host-bandwidth",
        type=float,
        default=None,
        help="host link bandwidth per direction for auto: "
        + (bandwidth if simulator else "bytes/s (default: measured on the device)"),
    )
    group.add_argument(
        "--pp-compute-throughput",
        type=float,
        default=None,
        help="delivered FLOP/s of one device for auto"
        + (" with --model (default 400e12 x 0.5)" if simulator else " (default: measured on the device)"),
    )
    group.add_argument(
        "--pp-offload-lookahead", type=int, default=1, help="compute ops between a RELOAD and its backward"
    )
    if simulator:
        group.add_argument("--pp-ranks-per-host", type=int, default=1, help="ranks that share one host link")


def policy_from_args(args: Any, ratio: float | None = None) -> OffloadPolicy:
    """The policy the flags of :func:`add_offload_args` ask for, with k for auto."""
    return OffloadPolicy(
        getattr(args, "pp_offload", "none"),
        parse_chunks(getattr(args, "pp_offload_chunks", None)),
        ratio=ratio,
        lookahead=getattr(args, "pp_offload_lookahead", 1),
    )


def lifespans(schedule: Schedule) -> dict[Unit, int]:
    """Compute ops each unit's rank runs between the unit's F and its B (or BW)."""
    spans: dict[Unit, int] = {}
    for ops in schedule.ranks:
        forward_at: dict[Unit, int] = {}
        for index, op in enumerate(op for op in ops if op.is_compute):
            if op.kind == OpKind.F:
                forward_at[op.unit] = index
            elif op.kind in BACKWARD_KINDS and op.unit in forward_at:
                spans[op.unit] = index - forward_at[op.unit] - 1
    return spans


def _longest_lived_chunk(schedule: Schedule, spans: dict[Unit, int]) -> int:
    totals = [0.0] * schedule.vpp
    counts = [0] * schedule.vpp
    for unit, span in spans.items():
        chunk = schedule.placement.chunk_index(unit[0])
        totals[chunk] += span
        counts[chunk] += 1
    means = [total / count if count else 0.0 for total, count in zip(totals, counts)]
    return max(range(schedule.vpp), key=lambda chunk: (means[chunk], -chunk))


def _longest_lived_share(schedule: Schedule, spans: dict[Unit, int], share: float) -> set[Unit]:
    """On each rank, the ``share`` of its units that live longest (earlier F first on ties)."""
    chosen: set[Unit] = set()
    for ops in schedule.ranks:
        forwards = [op.unit for op in ops if op.kind == OpKind.F]
        ranked = sorted(forwards, key=lambda unit: -spans.get(unit, 0))  # stable: F order on ties
        chosen.update(ranked[: math.floor(share * len(ranked) + 1e-9)])
    return chosen


def select_units(schedule: Schedule, policy: OffloadPolicy) -> set[Unit] | None:
    """The units to offload; None means every unit."""
    if policy.mode == "none":
        return set()
    if policy.mode == "full":
        return None
    spans = lifespans(schedule)
    if policy.mode == "selective":
        chunks = policy.chunks
        if chunks is None:
            chunks = (_longest_lived_chunk(schedule, spans),)
        if max(chunks) >= schedule.vpp:
            raise OffloadError(
                f"chunk {max(chunks)} does not exist: {schedule.name} has {schedule.vpp} chunk(s) per rank "
                f"(indices 0..{schedule.vpp - 1})",
                "--pp-offload-chunks",
            )
        return {unit for unit in spans if schedule.placement.chunk_index(unit[0]) in chunks}
    if policy.ratio is None:
        raise OffloadError(
            "auto needs k: give --pp-host-bandwidth and --pp-compute-throughput (or a model to derive them)",
            "--pp-offload",
        )
    share = offload_fraction(policy.ratio)
    return None if share >= 1.0 else _longest_lived_share(schedule, spans, share)


def apply_offload(schedule: Schedule, policy: OffloadPolicy) -> Schedule:
    """``schedule`` with OFFLOAD/RELOAD ops for the units ``policy`` picks (unchanged for none)."""
    if policy.mode == "none":
        return schedule
    units = select_units(schedule, policy)
    lookahead = policy.lookahead
    if policy.mode == "auto" and policy.ratio is not None:
        lookahead = max(lookahead, math.ceil(3 * policy.ratio))
    offloaded = insert_offload(schedule, units, lookahead)
    copies = sum(1 for _, _, op in offloaded.all_ops() if op.kind == OpKind.OFFLOAD)
    meta = {"offload": policy.mode, "offloaded_units": copies}
    if policy.ratio is not None:
        meta["offload_k"] = round(policy.ratio, 4)
    return offloaded.with_ranks(offloaded.ranks, **meta)


def ratio_from_costs(schedule: Schedule, costs: CostModel) -> float:
    """k from a cost model: copy time of the units over their compute time (F + B + W). Each
    direction of the link carries one copy per unit, so k <= 1 lets both hide behind compute."""
    copy_total = compute_total = 0.0
    for _, _, op in schedule.all_ops():
        if op.is_compute:
            compute_total += costs.duration(op)
            if op.kind == OpKind.F:
                copy_total += costs.copy_time(Op(OpKind.OFFLOAD, *op.unit))
    if compute_total <= 0:
        raise OffloadError("the cost model gives no compute time to hide copies behind", "--pp-offload")
    return copy_total / compute_total
