"""Cutting one sequence into k slices for sequence-level pipelining.

Two ways (REFERENCE sec. 4):

* **uniform** (SlimPipe): k equal slices. Later slices attend to more keys, so they cost more.
* **balanced** (Seq1F1B): slice lengths chosen so every slice has the same forward FLOPs. The cut
  points are solved from the end of the sequence (the last, most expensive slices are the shortest),
  each rounded to a multiple of ``unit`` tokens that attention kernels handle well, and the first
  slice takes the remainder. Rounding each cut point on its own keeps the error of every slice
  within one unit's worth of FLOPs instead of letting it pile up on the first slice.

A request that cannot be met raises :class:`PartitionError` naming the flag to change
(``--slices`` or ``--seq-length``) and the nearest values that would work.
"""

from __future__ import annotations

import math

from .models import ModelShape

DEFAULT_UNIT = 8  # tokens; bf16 tensor-core tiles and flash-attention blocks like multiples of 8
PARTITIONS = ("uniform", "balanced")


class PartitionError(ValueError):
    """A sequence that cannot be cut as asked. ``flag`` names the command-line flag to change."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


def causal_pairs(length: int, end: int) -> int:
    """(query, key) pairs of a slice of ``length`` tokens ending at position ``end`` under a causal
    mask (bottom-right aligned: each query sees every key up to and including itself)."""
    return length * end - length * (length - 1) // 2


def slice_forward_flops(shape: ModelShape, length: int, end: int) -> int:
    """Forward FLOPs of one layer for one sequence's slice: GEMMs over its tokens plus attention
    of its queries against every key up to the slice's end."""
    return shape.layer_linear_flops_per_token() * length + shape.attention_flops_per_pair() * causal_pairs(
        length, end
    )


def _nearest(values: list[int], target: int, count: int = 2) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:count])


def _check_common(seq_length: int, num_slices: int, unit: int) -> None:
    if unit < 1:
        raise ValueError(f"slice rounding unit must be at least 1 token, got {unit}")
    if num_slices < 1:
        raise PartitionError(f"--slices must be at least 1, got {num_slices}", flag="--slices")
    if seq_length < 1:
        raise PartitionError(f"--seq-length must be at least 1, got {seq_length}", flag="--seq-length")
    if num_slices == 1:
        return
    if seq_length % unit:
        low = seq_length // unit * unit
        near = [v for v in (low, low + unit) if v >= unit * num_slices] or [unit * num_slices]
        raise PartitionError(
            f"--seq-length {seq_length} cannot be cut into slices that are multiples of {unit} "
            f"tokens; nearest valid --seq-length: {', '.join(map(str, near))}",
            flag="--seq-length",
        )
    most = seq_length // unit
    if num_slices > most:
        raise PartitionError(
            f"--slices {num_slices} is too many for --seq-length {seq_length}: every slice needs at "
            f"least {unit} tokens; use --slices <= {most} or --seq-length >= {num_slices * unit}",
            flag="--slices",
        )


def uniform_slices(seq_length: int, num_slices: int, unit: int = DEFAULT_UNIT) -> list[int]:
    """k equal slices, each a multiple of ``unit`` tokens (SlimPipe)."""
    _check_common(seq_length, num_slices, unit)
    if num_slices == 1:
        return [seq_length]
    if seq_length % (num_slices * unit):
        units = seq_length // unit
        slices_ok = [k for k in range(2, units + 1) if units % k == 0] or [1]
        step = num_slices * unit
        low = seq_length // step * step
        lengths_ok = [v for v in (low, low + step) if v > 0]
        raise PartitionError(
            f"--slices {num_slices} does not divide --seq-length {seq_length} into equal slices that "
            f"are multiples of {unit} tokens; nearest valid --slices: "
            f"{', '.join(map(str, _nearest(slices_ok, num_slices)))}; nearest valid --seq-length: "
            f"{', '.join(map(str, lengths_ok))}",
            flag="--slices",
        )
    return [seq_length // num_slices] * num_slices


def _prefix_flops(shape: ModelShape, position: float) -> float:
    """Forward FLOPs of one layer over tokens [0, position): the running total the cuts split."""
    return (
        shape.layer_linear_flops_per_token() * position
        + shape.attention_flops_per_pair() * position * (position + 1) / 2
    )


def _position_of(shape: ModelShape, flops: float) -> float:
    """Inverse of :func:`_prefix_flops` (the positive root of a quadratic)."""
    half_pair = shape.attention_flops_per_pair() / 2
    linear = shape.layer_linear_flops_per_token() + half_pair
    return (-linear + math.sqrt(linear * linear + 4 * half_pair * flops)) / (2 * half_pair)


def balanced_slices(
    shape: ModelShape, seq_length: int, num_slices: int, unit: int = DEFAULT_UNIT
) -> list[int]:
    """k slices of equal forward FLOPs (Seq1F1B), lengths multiples of ``unit`` except that the
    first slice takes whatever remains. Cut j sits where the prefix holds j/k of the FLOPs."""
    _check_common(seq_length, num_slices, unit)
    if num_slices == 1:
        return [seq_length]
    total = _prefix_flops(shape, seq_length)
    cuts = [seq_length]
    for j in range(num_slices - 1, 0, -1):
        ideal = _position_of(shape, total * j / num_slices)
        cut = round(ideal / unit) * unit
        cut = max(min(cut, cuts[-1] - unit), j * unit)
        cuts.append(cut)
    cuts.append(0)
    cuts.reverse()
    return [cuts[i + 1] - cuts[i] for i in range(num_slices)]


def slice_lengths(
    partition: str,
    shape: ModelShape,
    seq_length: int,
    num_slices: int,
    unit: int = DEFAULT_UNIT,
) -> list[int]:
    """Lengths for ``partition`` ("uniform" or "balanced", as in a schedule's meta["partition"])."""
    if partition == "uniform":
        return uniform_slices(seq_length, num_slices, unit)
    if partition == "balanced":
        return balanced_slices(shape, seq_length, num_slices, unit)
    raise PartitionError(
        f"unknown slice partition {partition!r}; choose from: {', '.join(PARTITIONS)}",
        flag="--slice-partition",
    )
