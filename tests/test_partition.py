"""Sequence slicing: uniform (SlimPipe) and computation-balanced (Seq1F1B) cuts."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedule.models import PRESETS, get_model
from megatron_pp_ext.schedule.partition import (
    PartitionError,
    balanced_slices,
    causal_pairs,
    slice_forward_flops,
    slice_lengths,
    uniform_slices,
)


def slice_flops(shape, lengths: list[int]) -> list[int]:
    ends = itertools.accumulate(lengths)
    return [slice_forward_flops(shape, length, end) for length, end in zip(lengths, ends)]


def test_causal_pairs_of_all_slices_cover_the_triangle() -> None:
    lengths = [100, 60, 40]
    ends = itertools.accumulate(lengths)
    assert sum(causal_pairs(s, e) for s, e in zip(lengths, ends)) == 200 * 201 // 2


def test_uniform_cuts_equal_slices() -> None:
    assert uniform_slices(32768, 8) == [4096] * 8
    assert uniform_slices(4099, 1) == [4099]  # one slice never needs cutting


def test_uniform_error_names_slices_and_nearest_values() -> None:
    with pytest.raises(PartitionError) as info:
        uniform_slices(4096, 3)
    assert info.value.flag == "--slices"
    message = str(info.value)
    assert "--slices" in message and "--seq-length" in message
    assert "2, 4" in message  # the nearest slice counts that divide 4096 into multiples of 8


def test_too_many_slices_names_slices() -> None:
    for cut in (lambda: uniform_slices(64, 16), lambda: balanced_slices(get_model("tiny"), 64, 16)):
        with pytest.raises(PartitionError) as info:
            cut()
        assert info.value.flag == "--slices"
        assert "--slices <= 8" in str(info.value)


def test_ragged_sequence_names_seq_length() -> None:
    with pytest.raises(PartitionError) as info:
        balanced_slices(get_model("llama-7b"), 4100, 4)
    assert info.value.flag == "--seq-length"
    assert "4096, 4104" in str(info.value)


def test_unknown_partition_names_its_flag() -> None:
    with pytest.raises(PartitionError) as info:
        slice_lengths("zigzag", get_model("tiny"), 64, 2)
    assert info.value.flag == "--slice-partition"


def test_balanced_slices_shrink_toward_the_end() -> None:
    lengths = balanced_slices(get_model("llama-7b"), 32768, 8)
    assert sum(lengths) == 32768
    assert lengths == sorted(lengths, reverse=True)
    assert all(length % 8 == 0 for length in lengths[1:])
    assert lengths[0] > 1.5 * lengths[-1]  # attention makes late tokens dearer


def test_the_cut_depends_on_the_shape() -> None:
    """At 4K tokens the tiny model (h=64) is attention-bound, so its cuts are far from uniform;
    Llama-70B (GQA, wide FFN) is GEMM-bound, so its cuts are nearly uniform."""
    dense = balanced_slices(get_model("tiny"), 4096, 4)
    wide = balanced_slices(get_model("llama-70b"), 4096, 4)
    assert dense[0] - dense[-1] > wide[0] - wide[-1]


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from(sorted(PRESETS)),
    units=st.integers(min_value=8, max_value=8192),
    unit=st.sampled_from([8, 16, 64]),
    data=st.data(),
)
def test_balanced_slices_have_equal_flops_within_one_unit(model: str, units: int, unit: int, data) -> None:
    shape = get_model(model)
    seq_length = units * unit
    num_slices = data.draw(st.integers(min_value=1, max_value=max(1, units // 4)))
    lengths = balanced_slices(shape, seq_length, num_slices, unit)
    assert sum(lengths) == seq_length and len(lengths) == num_slices
    assert all(length % unit == 0 and length > 0 for length in lengths)
    flops = slice_flops(shape, lengths)
    target = sum(flops) / num_slices
    one_unit = slice_forward_flops(shape, unit, seq_length)  # a unit's worth at its dearest spot
    assert max(abs(f - target) for f in flops) <= one_unit
