"""Sequence-sliced schedules: Seq1F1B and SlimPipe, flat and interleaved.

Both cut every microbatch into k slices along the sequence and schedule (microbatch, slice)
units: forwards in order, each microbatch's backwards last slice first (a slice's backward hands
the gradients of the K/V it read back to the earlier slices). They differ in how the sequence is
cut (Seq1F1B balances the FLOPs of the slices, SlimPipe cuts uniform slices; see
``default_partition`` in the registry) and in how many units a rank keeps in flight.
"""

from __future__ import annotations

from ..ir import Schedule
from .interleaved import interleaved_schedule
from .one_f_one_b import one_f_one_b_schedule
from .request import ScheduleRequest


def seq1f1b(request: ScheduleRequest) -> Schedule:
    """1F1B over units: rank r warms up with p-r+k-2 units (capped at m*k), so that the last
    slice of the first microbatch is forwarded when its backward is due."""
    pp, slices = request.pp, request.slices
    return one_f_one_b_schedule(request, "seq1f1b", lambda rank: pp - rank + slices - 2)


def slimpipe(request: ScheduleRequest) -> Schedule:
    """Rank r keeps at most k + 2(p-1-r) slices in flight: forwards until that limit, then one
    forward per backward. Two units per hop, because a slice costs little and the backward
    takes about twice the forward, so the extra units keep rank r busy while the first
    backward comes back; the whole-microbatch activations of 1F1B shrink to about one
    microbatch plus 2(p-1) slices."""
    pp, slices = request.pp, request.slices
    return one_f_one_b_schedule(request, "slimpipe", lambda rank: slices + 2 * (pp - 1 - rank) - 1)


def seq1f1b_interleaved(request: ScheduleRequest) -> Schedule:
    """Megatron's interleaved schedule over units. A group needs p units for the round trip,
    not p microbatches, so groups hold ceil(p/k) whole microbatches: less warm-up memory than
    interleaving whole microbatches. Warm-up as in interleaved 1F1B (k-1 extra units for the
    last slice of the first microbatch)."""
    pp, chunks, slices = request.pp, request.vpp, request.slices
    group = -(-pp // slices)
    return interleaved_schedule(
        request,
        "seq1f1b-interleaved",
        group,
        lambda rank: 2 * (pp - rank - 1) + (chunks - 1) * group * slices + slices - 1,
    )


def slimpipe_interleaved(request: ScheduleRequest) -> Schedule:
    """Interleaved SlimPipe: one microbatch per group (its k >= p slices are enough units for
    the round trip); rank r keeps at most k*v + 2(p-1-r) slices in flight."""
    pp, chunks, slices = request.pp, request.vpp, request.slices
    return interleaved_schedule(
        request,
        "slimpipe-interleaved",
        1,
        lambda rank: slices * chunks + 2 * (pp - 1 - rank) - 1,
    )
