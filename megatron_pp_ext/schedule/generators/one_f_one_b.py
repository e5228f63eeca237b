"""1F1B (PipeDream-flush) and Megatron's interleaved 1F1B, over (microbatch, slice) units.

With k slices a unit is one slice of one microbatch; forwards go in unit order, backwards
microbatch by microbatch with slices last-first. k=1 is the classic schedule.
"""

from __future__ import annotations

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .request import ScheduleRequest


def one_f_one_b(request: ScheduleRequest) -> Schedule:
    """Rank r runs p-1-r warm-up forwards (plus k-1, so that the last slice of the first
    microbatch is forwarded before its backward), then alternates one forward and one backward,
    then drains the remaining backwards."""
    pp, slices = request.pp, request.slices
    forwards = units(request.microbatches, slices)
    backwards = backward_units(request.microbatches, slices)
    total = len(forwards)
    ranks: list[list[Op]] = []
    for rank in range(pp):
        warmup_forwards = min(pp - 1 - rank + slices - 1, total)
        ops = [Op(OpKind.F, rank, mb, j) for mb, j in forwards[:warmup_forwards]]
        next_forward = warmup_forwards
        for mb, j in backwards:
            if next_forward < total:
                f_mb, f_j = forwards[next_forward]
                ops.append(Op(OpKind.F, rank, f_mb, f_j))
                next_forward += 1
            ops.append(Op(OpKind.BW, rank, mb, j))
        ranks.append(ops)
    return Schedule(
        name=request.name or "1f1b",
        pp=pp,
        microbatches=request.microbatches,
        num_stages=pp,
        slices=slices,
        placement=Placement(pp, pp, "interleaved"),
        ranks=ranks,
    )
