"""The validator accepts good schedules and names the first broken rule of bad ones."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import Op, OpKind, Schedule
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.validate import ScheduleError, validate


def two_rank(rank0: str, rank1: str, microbatches: int = 2, **header: str) -> Schedule:
    lines = ["pp: 2", f"microbatches: {microbatches}"]
    lines += [f"{key}: {value}" for key, value in header.items()]
    lines += [f"rank 0: {rank0}", f"rank 1: {rank1}"]
    return Schedule.from_text("\n".join(lines))


def test_accepts_hand_written_1f1b() -> None:
    schedule = two_rank("F0:0 F0:1 BW0:0 BW0:1", "F1:0 BW1:0 F1:1 BW1:1")
    validate(schedule)
    validate(lower(schedule))


@pytest.mark.parametrize(
    ("rank0", "rank1", "message"),
    [
        ("F0:0 F0:1 BW0:0 BW0:1", "F1:0 BW1:0 F1:1", "missing op B1:1"),
        ("F0:0 F0:1 BW0:0 BW0:1 BW0:1", "F1:0 BW1:0 F1:1 BW1:1", "appears twice"),
        ("F0:0 F0:1 BW0:0 BW0:1", "BW1:0 F1:0 F1:1 BW1:1", "BW1:0 at rank 1 position 0 needs F1:0"),
        ("F0:0 F0:1 B0:0 W0:0 W0:1 B0:1", "F1:0 BW1:0 F1:1 BW1:1", "W0:1 at rank 0 position 4 runs before"),
        ("F0:0 F0:1 B0:0 BW0:1", "F1:0 BW1:0 F1:1 BW1:1", "missing op W0:0"),
        ("F0:0 F1:1 BW0:0 BW0:1", "F1:0 BW1:0 F0:1 BW1:1", "belongs to rank 1"),
        ("F0:0 F0:2 BW0:0 BW0:1", "F1:0 BW1:0 F1:1 BW1:1", "microbatch out of range"),
    ],
)
def test_rejects_broken_schedules_naming_the_rule(rank0: str, rank1: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(two_rank(rank0, rank1))


def test_rejects_cross_rank_deadlock() -> None:
    # rank 0 waits for the backward of microbatch 1 before it forwards microbatch 1.
    schedule = two_rank("F0:0 BW0:0 BW0:1 F0:1", "F1:0 BW1:0 F1:1 BW1:1")
    with pytest.raises(ScheduleError, match="BW0:1 at rank 0 position 2 needs F0:1"):
        validate(schedule)
    deadlock = two_rank("F0:0 BW0:0 F0:1 BW0:1", "F1:0 F1:1 BW1:0 BW1:1")
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0 waits at BW0:0 .* for B/BW1:0 on rank 1; rank 1 waits at F1:1"
    ):
        validate(deadlock)


def test_rejects_slice_order_inside_a_microbatch() -> None:
    schedule = two_rank("F0:0 F0:0.1 BW0:0 BW0:0.1", "F1:0 F1:0.1 BW1:0.1 BW1:0", microbatches=1, slices="2")
    with pytest.raises(ScheduleError, match=r"BW0:0 at rank 0 position 2 needs B/BW0:0\.1"):
        validate(schedule)


def test_rejects_channels_ordered_differently_on_both_ends() -> None:
    schedule = lower(generate("1f1b", 3, 4))
    rank1 = schedule.ranks[1]
    first, second = rank1.index(Op(OpKind.RECV_F, 1, 0, 0, 0)), rank1.index(Op(OpKind.RECV_F, 1, 1, 0, 0))
    # Move microbatch 1's receive+forward in front of microbatch 0's on rank 1.
    rank1[first : first + 2], rank1[second : second + 2] = (
        rank1[second : second + 2],
        rank1[first : first + 2],
    )
    with pytest.raises(ScheduleError, match=r"channel rank 0 -> rank 1 \(F\): message 0"):
        validate(schedule)


def test_rejects_a_missing_receive() -> None:
    schedule = lower(generate("1f1b", 2, 2))
    schedule.ranks[1] = [op for op in schedule.ranks[1] if op != Op(OpKind.RECV_F, 1, 1, 0, 0)]
    with pytest.raises(ScheduleError, match="rank 0 sends SEND_F0:1>1 to rank 1, which never receives it"):
        validate(schedule)
