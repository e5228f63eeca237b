"""IR: ops print and parse, placements put stages where the papers say, schedules round-trip."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.ir import Op, OpKind, Placement, Schedule, load, parse_op, save
from megatron_pp_ext.schedule.lowering import lower


@pytest.mark.parametrize(
    "op",
    [
        Op(OpKind.F, 0, 3),
        Op(OpKind.B, 2, 5, 1),
        Op(OpKind.W, 7, 0, 3),
        Op(OpKind.BW, 1, 1),
        Op(OpKind.SEND_F, 2, 4, 1, peer=3),
        Op(OpKind.RECV_B, 2, 4, 0, peer=1),
    ],
)
def test_op_text_round_trip(op: Op) -> None:
    assert parse_op(str(op)) == op


def test_op_text_is_readable() -> None:
    assert str(Op(OpKind.F, 2, 5, 1)) == "F2:5.1"
    assert str(Op(OpKind.SEND_F, 2, 5, 0, peer=3)) == "SEND_F2:5>3"
    with pytest.raises(ValueError, match="cannot read op"):
        parse_op("X1:2")


def test_interleaved_placement_is_round_robin() -> None:
    place = Placement(4, 8, "interleaved")
    assert [place.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert place.stages_of(1) == [1, 5]


def test_vshape_placement_folds_back() -> None:
    place = Placement(4, 8, "vshape")
    assert [place.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert place.stages_of(0) == [0, 7]


def test_placement_rejects_stage_counts_not_multiple_of_pp() -> None:
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        Placement(4, 6)


@pytest.mark.parametrize("suffix", [".json", ".txt"])
def test_schedule_round_trips_through_files(tmp_path, suffix: str) -> None:
    schedule = lower(generate("1f1b", 3, 5, slices=2))
    path = str(tmp_path / f"s{suffix}")
    save(schedule, path)
    loaded = load(path)
    assert loaded.ranks == schedule.ranks
    assert (loaded.pp, loaded.microbatches, loaded.slices, loaded.num_stages) == (3, 5, 2, 3)


def test_hand_written_text_schedule_loads() -> None:
    text = """
    # two ranks, two microbatches, written by hand
    name: mine
    pp: 2
    microbatches: 2
    rank 0: F0:0 F0:1 BW0:0 BW0:1
    rank 1: F1:0 BW1:0 F1:1 BW1:1
    """
    schedule = Schedule.from_text(text)
    assert schedule.name == "mine"
    assert schedule.ranks[1][1] == Op(OpKind.BW, 1, 0)
    assert schedule.num_stages == 2 and schedule.placement.style == "interleaved"
