"""Megatron's interleaved 1F1B: v model chunks per rank, virtual stage s on rank s mod p.

Microbatches go through the chunks in groups (Megatron's ``microbatch_group_size_per_vp_stage``):
every rank forwards a group through chunk 0, then through chunk 1, and so on, and runs the
backwards group by group with the chunks in reverse. A group must hold at least p units, or its
first unit would come back to rank 0 for the next chunk before rank 0 has anything else to do.
With k slices a unit is one slice of one microbatch; a group holds whole microbatches and each
microbatch's backward goes slices last-first.

When m is not a multiple of the group size, the schedule is built as if the last group were
full and the ops of the missing microbatches are then dropped. Dropping whole microbatches keeps
every dependency and every channel order of a valid schedule, so the result stays valid (Megatron
instead refuses a last group smaller than p).
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir import Op, OpKind, Placement, Schedule
from .one_f_one_b import forwards_before_backwards
from .request import ScheduleRequest

ChunkUnit = tuple[int, int, int]  # (chunk, microbatch, slice)


def interleaved_order(
    microbatches: int, chunks: int, slices: int, group: int, backward: bool
) -> list[ChunkUnit]:
    """The (chunk, microbatch, slice) sequence every rank follows, forward or backward."""
    order: list[ChunkUnit] = []
    for first in range(0, microbatches, group):
        members = range(first, min(first + group, microbatches))
        for step in range(chunks):
            chunk = chunks - 1 - step if backward else step
            for mb in members:
                for j in reversed(range(slices)) if backward else range(slices):
                    order.append((chunk, mb, j))
    return order


def interleaved_schedule(
    request: ScheduleRequest, name: str, group: int, warmup: Callable[[int], int]
) -> Schedule:
    """Rank r runs ``warmup(r)`` forwards, then one forward before every backward, then the
    remaining backwards; a backward whose own forward is not done yet pulls the forwards it needs
    ahead of it (the extra warm-up that slicing needs)."""
    pp, chunks, slices = request.pp, request.vpp, request.slices
    padded = -(-request.microbatches // group) * group
    forwards = interleaved_order(padded, chunks, slices, group, backward=False)
    backwards = interleaved_order(padded, chunks, slices, group, backward=True)
    total = len(forwards)
    ranks = [
        [
            Op(OpKind.F if is_forward else OpKind.BW, chunk * pp + rank, mb, j)
            for is_forward, (chunk, mb, j) in forwards_before_backwards(forwards, backwards, warmup(rank))
            if mb < request.microbatches
        ]
        for rank in range(pp)
    ]
    return Schedule(
        name=request.name or name,
        pp=pp,
        microbatches=request.microbatches,
        num_stages=pp * chunks,
        slices=slices,
        placement=Placement(pp, pp * chunks, "interleaved"),
        ranks=ranks,
        meta={"group": group, "warmup": [min(warmup(rank), total) for rank in range(pp)]},
    )


def interleaved_1f1b(request: ScheduleRequest) -> Schedule:
    """Groups of p microbatches; rank r warms up with 2(p-r-1) forwards (two per hop, because a
    forward and a backward pass each hop in one steady-state step) plus (v-1) groups, so that
    the first microbatch has reached the last chunk when the first backward is due, plus k-1
    units so that the first microbatch's last slice has too (its backward comes first)."""
    pp, chunks, slices = request.pp, request.vpp, request.slices
    group = pp
    return interleaved_schedule(
        request,
        "interleaved-1f1b",
        group,
        lambda rank: 2 * (pp - rank - 1) + (chunks - 1) * group * slices + slices - 1,
    )
