"""1F1B (PipeDream-flush) over (microbatch, slice) units, and the schedule shape it shares with
Seq1F1B and SlimPipe.

With k slices a unit is one slice of one microbatch; forwards go in unit order, backwards
microbatch by microbatch with slices last-first. k=1 is the classic schedule.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .request import ScheduleRequest


def one_f_one_b_order(
    pp: int, microbatches: int, slices: int, warmup: Callable[[int], int], backward: OpKind = OpKind.BW
) -> list[list[Op]]:
    """Per rank: ``warmup(rank)`` forwards, then one forward before every backward while forwards
    remain, then the remaining backwards. A backward never comes before its own forward: when a
    microbatch's last slice is not forwarded yet, the forwards it needs go first (this is the
    extra warm-up that slicing needs)."""
    forwards = units(microbatches, slices)
    total = len(forwards)
    position = {unit: index for index, unit in enumerate(forwards)}
    ranks: list[list[Op]] = []
    for rank in range(pp):
        ops: list[Op] = []
        done = 0
        for index, (mb, j) in enumerate(backward_units(microbatches, slices)):
            needed = min(total, max(warmup(rank) + index + 1, position[(mb, j)] + 1))
            while done < needed:
                f_mb, f_j = forwards[done]
                ops.append(Op(OpKind.F, rank, f_mb, f_j))
                done += 1
            ops.append(Op(backward, rank, mb, j))
        ranks.append(ops)
    return ranks


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
