"""Checks on how a sequence is cut into slices, with errors that name the problem.

Slice lengths come from the schedule side (uniform or FLOP-balanced partitions); the attention
only needs them to be positive and to cover the sequence exactly, and the model needs each
slice's position offset for rotary embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence


class SlicingError(ValueError):
    """Slice lengths that cannot describe the sequence, or a slice run out of its place."""


def check_slicing(slice_lengths: Sequence[int], seq_length: int | None = None) -> tuple[int, ...]:
    """Return ``slice_lengths`` as a tuple after checking that they are positive integers that
    sum to ``seq_length`` (when given)."""
    lengths = tuple(slice_lengths)
    if not lengths:
        raise SlicingError("slice lengths are empty: a sequence needs at least one slice")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int):
            raise SlicingError(f"slice {index} has length {length!r}; lengths must be integers")
        if length < 1:
            raise SlicingError(
                f"slice {index} has length {length}; every slice needs at least one token "
                f"(slice lengths {list(lengths)})"
            )
    if seq_length is not None and sum(lengths) != seq_length:
        raise SlicingError(
            f"slice lengths {list(lengths)} sum to {sum(lengths)} tokens but the sequence has "
            f"{seq_length}; the slices must cover the sequence exactly"
        )
    return lengths


def slice_offsets(slice_lengths: Sequence[int]) -> list[int]:
    """Start position of each slice, plus the sequence length at the end."""
    offsets = [0]
    for length in slice_lengths:
        offsets.append(offsets[-1] + length)
    return offsets
