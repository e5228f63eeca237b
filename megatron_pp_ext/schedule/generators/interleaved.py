"""Megatron's interleaved 1F1B: v model chunks per rank, virtual stage s on rank s mod p.

Microbatches go through the chunks in groups (Megatron's ``microbatch_group_size_per_vp_stage``):
every rank forwards a group through chunk 0, then through chunk 1, and so on, and runs the
backwards group by group with the chunks in reverse. A group must hold at least p units, or its
first unit would come back to rank 0 for the next chunk before rank 0 has anything else to do.
With k slices a unit is one slice of one microbatch; a group holds whole microbatches and each
microbatch's backward goes slices last-first.

When p does not divide m, ``interleaved-1f1b`` regroups as PyTorch's interleaved schedule does:
m // p groups of as even sizes as possible (each at least p), so no slot is lost to a short last
group; the larger first group costs warm-up memory (rank 0 up to M(1 + g/(pv)) for groups of g).
``interleaved-1f1b-groups-of-p`` keeps Megatron's groups of p (memory M(1 + 1/v)): the last group
is built as if full and the ops of the missing microbatches are then dropped. Dropping whole
microbatches keeps every dependency and every channel order of a valid schedule, so the result
stays valid, at the price of the holes they leave.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..ir import Op, OpKind, Placement, Schedule
from .one_f_one_b import forwards_before_backwards
from .request import ScheduleRequest

ChunkUnit = tuple[int, int, int]  # (chunk, microbatch, slice)


def group_sizes(microbatches: int, group: int) -> list[int]:
    """Groups of ``group`` microbatches, the last one possibly short."""
    return [min(group, microbatches - first) for first in range(0, microbatches, group)]


def interleaved_order(sizes: Sequence[int], chunks: int, slices: int, backward: bool) -> list[ChunkUnit]:
    """The (chunk, microbatch, slice) sequence every rank follows, forward or backward, for
    consecutive groups of ``sizes`` microbatches."""
    order: list[ChunkUnit] = []
    first = 0
    for size in sizes:
        members = range(first, first + size)
        first += size
        for step in range(chunks):
            chunk = chunks - 1 - step if backward else step
            for mb in members:
                for j in reversed(range(slices)) if backward else range(slices):
                    order.append((chunk, mb, j))
    return order


def interleaved_schedule(
    request: ScheduleRequest,
    name: str,
    group: int | Sequence[int],
    warmup: Callable[[int], int],
) -> Schedule:
    """Rank r runs ``warmup(r)`` forwards, then one forward before every backward, then the
    remaining backwards; a backward whose own forward is not done yet pulls the forwards it needs
    ahead of it (the extra warm-up that slicing needs).

    ``group`` is a group size (a short last group is built full and its missing microbatches
    dropped) or the list of group sizes, which must add up to the microbatches."""
    pp, chunks, slices, microbatches = request.pp, request.vpp, request.slices, request.microbatches
    if isinstance(group, int):
        padded = -(-microbatches // group) * group
        sizes = group_sizes(padded, group)
    else:
        sizes = list(group)
        if sum(sizes) != microbatches:
            raise ValueError(f"group sizes {sizes} do not add up to {microbatches} microbatches")
    forwards = interleaved_order(sizes, chunks, slices, backward=False)
    backwards = interleaved_order(sizes, chunks, slices, backward=True)
    total = len(forwards)
    ranks = [
        [
            Op(OpKind.F if is_forward else OpKind.BW, chunk * pp + rank, mb, j)
            for is_forward, (chunk, mb, j) in forwards_before_backwards(forwards, backwards, warmup(rank))
            if mb < microbatches
        ]
        for rank in range(pp)
    ]
    return Schedule(
        name=request.name or name,
        pp=pp,
        microbatches=microbatches,
        num_stages=pp * chunks,
        slices=slices,
        placement=Placement(pp, pp * chunks, "interleaved"),
        ranks=ranks,
        meta={"group": sizes[0], "groups": sizes, "warmup": [min(warmup(rank), total) for rank in range(pp)]},
    )


def regrouped_sizes(microbatches: int, pp: int) -> list[int]:
    """PyTorch's rounds: as many groups as whole multiples of p fit in m (at least one), their
    sizes as even as possible (the larger first), so every group holds at least p microbatches
    and none waits for padding."""
    rounds = max(1, microbatches // pp)
    base, extra = divmod(microbatches, rounds)
    return [base + (1 if index < extra else 0) for index in range(rounds)]


def _warmup(pp: int, chunks: int, slices: int, group: int) -> Callable[[int], int]:
    return lambda rank: 2 * (pp - rank - 1) + (chunks - 1) * group * slices + slices - 1


def interleaved_1f1b_groups_of_p(request: ScheduleRequest) -> Schedule:
    """Megatron's grouping whatever m: groups of exactly p, a short last group built full and its
    missing microbatches dropped. Rank 0 holds M(1 + 1/v) at most, but when p does not divide m
    the dropped microbatches leave holes: a few slots longer than :func:`interleaved_1f1b`."""
    pp, chunks, slices = request.pp, request.vpp, request.slices
    return interleaved_schedule(request, "interleaved-1f1b-groups-of-p", pp, _warmup(pp, chunks, slices, pp))


def interleaved_1f1b(request: ScheduleRequest) -> Schedule:
    """Groups of p microbatches (when m is not a multiple of p, m // p groups of about m / (m // p)
    each, as PyTorch's interleaved schedule regroups); rank r warms up with 2(p-r-1) forwards (two
    per hop, because a forward and a backward pass each hop in one steady-state step) plus (v-1)
    groups, so that the first microbatch has reached the last chunk when the first backward is due,
    plus k-1 units so that the first microbatch's last slice has too (its backward comes first)."""
    pp, chunks, slices = request.pp, request.vpp, request.slices
    sizes = regrouped_sizes(request.microbatches, pp)
    return interleaved_schedule(request, "interleaved-1f1b", sizes, _warmup(pp, chunks, slices, sizes[0]))
