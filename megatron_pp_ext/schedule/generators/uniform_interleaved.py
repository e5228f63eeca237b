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
``lag`` is coprime to v, so no two ops of a rank share a slot. ``lag >= (2p-1)/3`` lets a
backward go from chunk c+1 on rank 0 to chunk c on rank p-1 in time, and ``first_backward`` lets
a unit's last-stage B follow its last-stage F (with k slices, the first backward of a microbatch
is its last slice). A rank's order is its ops sorted by slot; the runtime and the simulator run
each op as soon as its inputs are there, so the empty slots of the warm-up close up.

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


def chunk_lag(pp: int, chunks: int) -> int:
    """Periods of three slots between a unit's F on rank 0 for one chunk and for the next: the
    smallest ``lag >= (2p-1)/3`` coprime to the chunk count."""
    lag = max(1, -(-(2 * pp - 1) // 3))
    while math.gcd(lag, chunks) != 1:
        lag += 1
    return lag


def uniform_interleaved(request: ScheduleRequest) -> Schedule:
    pp, chunks, slices = request.pp, request.vpp, request.slices
    lag = chunk_lag(pp, chunks)
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
        name=request.name or "uniform-interleaved",
        pp=pp,
        microbatches=request.microbatches,
        num_stages=pp * chunks,
        slices=slices,
        placement=Placement(pp, pp * chunks, "interleaved"),
        ranks=ranks,
        meta={"lag": lag},
    )
