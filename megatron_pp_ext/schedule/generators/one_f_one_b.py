"""1F1B (PipeDream-flush) over (microbatch, slice) units, and the schedule shape it shares with
Seq1F1B and SlimPipe.

With k slices a unit is one slice of one microbatch; forwards go in unit order, backwards
microbatch by microbatch with slices last-first. k=1 is the classic schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .request import ScheduleRequest

Unit = TypeVar("Unit", bound=Hashable)


def forwards_before_backwards(
    forwards: Sequence[Unit], backwards: Sequence[Unit], warmup: int
) -> list[tuple[bool, Unit]]:
    """The 1F1B pattern over any units: ``warmup`` forwards, then one forward before every
    backward while forwards remain, then the remaining backwards; (is_forward, unit) in order.
    A backward never comes before its own forward: when a unit is not forwarded yet, the
    forwards it needs go first (this is the extra warm-up that slicing needs)."""
    position = {unit: index for index, unit in enumerate(forwards)}
    total = len(forwards)
    order: list[tuple[bool, Unit]] = []
    done = 0
    for index, unit in enumerate(backwards):
        needed = min(total, max(warmup + index + 1, position[unit] + 1))
        order.extend((True, forward) for forward in forwards[done:needed])
        done = max(done, needed)
        order.append((False, unit))
    return order


def one_f_one_b_order(
    pp: int, microbatches: int, slices: int, warmup: Callable[[int], int], backward: OpKind = OpKind.BW
) -> list[list[Op]]:
    """Per rank, :func:`forwards_before_backwards` over (microbatch, slice) units."""
    forwards = units(microbatches, slices)
    backwards = backward_units(microbatches, slices)
    return [
        [
            Op(OpKind.F if is_forward else backward, rank, mb, j)
            for is_forward, (mb, j) in forwards_before_backwards(forwards, backwards, warmup(rank))
        ]
        for rank in range(pp)
    ]


def one_f_one_b_schedule(request: ScheduleRequest, name: str, warmup: Callable[[int], int]) -> Schedule:
    pp = request.pp
    return Schedule(
        name=request.name or name,
        pp=pp,
        microbatches=request.microbatches,
        num_stages=pp,
        slices=request.slices,
        placement=Placement(pp, pp, "interleaved"),
        ranks=one_f_one_b_order(pp, request.microbatches, request.slices, warmup),
        meta={"warmup": [min(warmup(rank), request.microbatches * request.slices) for rank in range(pp)]},
    )


def one_f_one_b(request: ScheduleRequest) -> Schedule:
    """Rank r runs p-1-r warm-up forwards (plus k-1, so that the last slice of the first
    microbatch is forwarded before its backward), then alternates one forward and one backward,
    then drains the remaining backwards."""
    pp, slices = request.pp, request.slices
    return one_f_one_b_schedule(request, "1f1b", lambda rank: pp - 1 - rank + slices - 1)
