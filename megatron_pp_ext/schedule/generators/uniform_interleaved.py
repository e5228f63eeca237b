"""PipeOffload's uniform interleaved schedule: every rank repeats one pattern per unit, so the
activation memory stays flat over time and the first chunk holds most of it.

Megatron's interleaved 1F1B forwards a group of p microbatches through chunk 0 before any of
them reaches chunk 1, so at the end of its warm-up rank 0 holds a whole group of chunk-1 units
beside the chunk-0 ones, and offloading chunk 0 removes only about half of its peak. Here units
(microbatches, or slices of them) enter one at a time and move through the chunks at a fixed lag,
as in PipeOffload's schedule (Wan et al., ICML'25, figure 2), on a timetable of unit-cost slots:

* per unit a rank runs v forwards, v input-gradient backwards (B) and v weight-gradient passes
  (W): one period of 3v slots;
* the F of chunk c runs on rank r at slot ``3v*u + 3*lag*c + r``: a unit walks down the ranks one
  slot per hop and comes back to rank 0 for the next chunk ``3*lag`` slots later;
* the B of chunk c runs at ``3v*u_b + first_backward + 3*lag*(v-1-c) + 2*(p-1-r)``: it walks up
  the ranks two slots per hop, leaving the slot in between to the W of the B just run.

On rank r every F falls on a slot equal to r mod 3, every B on r+1 and every W on r+2, and
``lag`` is coprime to v, so no two ops of a rank share a slot; ``first_backward`` lets a unit's
last-stage B follow its last-stage F (with k slices, the first backward of a microbatch is its
last slice). A rank's order is its ops sorted by slot; the runtime and the simulator run each op
as soon as its inputs are there, so the empty slots of the warm-up close up.

The lag trades memory for time. A unit's forward needs p slots to reach the last rank before
its next chunk starts on rank 0 (``3 lag >= p``), and its backward 2p-1 slots to come back from
chunk c+1 on rank 0 to chunk c on rank p-1 (``3 lag >= 2p-1``). PipeOffload's lag is the
smallest coprime to v from p/2 up (:func:`chunk_lag`, the default): a backward may then wait a
slot or two at a chunk boundary, which costs about two slots of makespan, while every unit of
chunk c lives 6(v-1-c) slots less per period of lag saved: 2 to 4 stage-units less on every rank,
and these are exactly the chunks that stay on the device under selective offload.
``uniform-interleaved-fast`` takes the smallest lag that never waits, ``lag >= (2p-1)/3``
(:func:`fast_chunk_lag`).

A unit of chunk c on rank r lives ``3*(2*lag*(v-1-c) + p - r)`` slots from its F to the end of
its W (slice j of k: 2(k-1-j) periods more), so rank r holds about ``(2*lag*(v-1-c) + p - r)/v``
units of chunk c at any time: chunk 0 the most, the last chunk (p-r)/v. Offloading chunk 0
leaves only the short-lived chunks on the device, which is how selective offload lowers the peak
better than linearly here.
"""

from __future__ import annotations

import math

from ..ir import Op, OpKind, Placement, Schedule
from .request import ScheduleRequest


def _coprime_from(lag: int, chunks: int) -> int:
    lag = max(1, lag)
    while math.gcd(lag, chunks) != 1:
        lag += 1
    return lag


def chunk_lag(pp: int, chunks: int) -> int:
    """PipeOffload's periods of three slots between a unit's F on rank 0 for one chunk and for
    the next: the smallest ``lag >= p/2`` coprime to the chunk count (the least memory at which
    the schedule keeps interleaved 1F1B's bubble within a couple of slots)."""
    return _coprime_from(-(-pp // 2), chunks)


def fast_chunk_lag(pp: int, chunks: int) -> int:
    """The smallest ``lag >= (2p-1)/3`` coprime to the chunk count: no backward ever waits at a
    chunk boundary (shortest makespan, more memory)."""
    return _coprime_from(-(-(2 * pp - 1) // 3), chunks)


def uniform_interleaved(request: ScheduleRequest) -> Schedule:
    """PipeOffload's schedule with its memory-lean lag (:func:`chunk_lag`)."""
    return uniform_interleaved_with_lag(request, chunk_lag(request.pp, request.vpp), "uniform-interleaved")


def uniform_interleaved_fast(request: ScheduleRequest) -> Schedule:
    """The same timetable with the smallest lag at which no backward waits (:func:`fast_chunk_lag`):
    about two slots shorter, 2 to 4 stage-units more memory per rank."""
    return uniform_interleaved_with_lag(
        request, fast_chunk_lag(request.pp, request.vpp), "uniform-interleaved-fast"
    )


def uniform_interleaved_with_lag(request: ScheduleRequest, lag: int, name: str) -> Schedule:
    pp, chunks, slices = request.pp, request.vpp, request.slices
    period = 3 * chunks
    # the last stage's B of a microbatch's last slice (backward unit mb*k) follows that slice's F
    first_backward = period * (slices - 1) + 3 * lag * (chunks - 1) + pp
    ranks: list[list[Op]] = []
    for rank in range(pp):
        timetable: list[tuple[int, Op]] = []
        for mb in range(request.microbatches):
            for j in range(slices):
                forward_unit = mb * slices + j
                backward_unit = mb * slices + (slices - 1 - j)
                for chunk in range(chunks):
                    stage = chunk * pp + rank
                    forward_slot = period * forward_unit + 3 * lag * chunk + rank
                    backward_slot = (
                        period * backward_unit
                        + first_backward
                        + 3 * lag * (chunks - 1 - chunk)
                        + 2 * (pp - 1 - rank)
                    )
                    timetable.append((forward_slot, Op(OpKind.F, stage, mb, j)))
                    timetable.append((backward_slot, Op(OpKind.B, stage, mb, j)))
                    timetable.append((backward_slot + 1, Op(OpKind.W, stage, mb, j)))
        timetable.sort(key=lambda entry: entry[0])
        ranks.append([op for _, op in timetable])
    return Schedule(
        name=request.name or name,
        pp=pp,
        microbatches=request.microbatches,
        num_stages=pp * chunks,
        slices=slices,
        placement=Placement(pp, pp * chunks, "interleaved"),
        ranks=ranks,
        meta={"lag": lag},
    )
