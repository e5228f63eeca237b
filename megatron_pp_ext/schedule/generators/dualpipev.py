"""DualPipeV (DeepSeek): DualPipe cut in half, on the V placement.

Rank r holds stage r (chunk 0, going down the V) and stage 2p-1-r (chunk 1, coming back up);
rank 0 computes the loss. Microbatches enter at rank 0 and the schedule overlaps the forward of
one chunk with the backward of the other (an "F&B pair", emitted here as two consecutive ops,
forward first). Backward passes are whole (BW) in the steady state and split into B and W
(zero-bubble style) at the edges, where a deferred W fills what would be a bubble. Each rank
runs eight phases; with p ranks, m units (microbatch, slice) and r the rank:

1. 2(p-r-1) forwards of chunk 0;
2. r+1 times: forward chunk 0, forward chunk 1;
3. p-r-1 times: B of chunk 1 (split), its W, forward chunk 1;
4. the main phase, m-2p+r+1 times: pair (F chunk 0, BW chunk 1), pair (F chunk 1, BW chunk 0);
5. p-r-1 times: BW chunk 1, pair (F chunk 1, BW chunk 0);
6. r+1 times: backward chunk 1, backward chunk 0, split into B and W from the middle on
   (for odd r from a chunk-1 backward, for even r from a chunk-0 one, so r+1 Ws are deferred);
7. p-r-1 times: a deferred W, B of chunk 0 (split);
8. r+1 deferred Ws.

It needs m >= 2p units. With k slices a microbatch's backwards go last slice first, so the
backward order lags the forward order by up to k-1 units: phases 2 and 6 run k-1 more times and
the main phase k-1 fewer, so each backward still finds its forward done (m*k >= 2p + k - 1).
"""

from __future__ import annotations

from collections import deque

from ..ir import Op, OpKind, Placement, Schedule, backward_units, units
from .request import ScheduleRequest


class _Rank:
    """The four FIFO streams of one rank and the queue of deferred W."""

    def __init__(self, rank: int, pp: int, microbatches: int, slices: int) -> None:
        self.stage = (rank, 2 * pp - 1 - rank)  # chunk 0, chunk 1
        self.forwards = [deque(units(microbatches, slices)) for _ in range(2)]
        self.backwards = [deque(backward_units(microbatches, slices)) for _ in range(2)]
        self.weights: deque[Op] = deque()
        self.ops: list[Op] = []

    def forward(self, chunk: int) -> None:
        mb, j = self.forwards[chunk].popleft()
        self.ops.append(Op(OpKind.F, self.stage[chunk], mb, j))

    def backward(self, chunk: int, split: bool = False) -> None:
        mb, j = self.backwards[chunk].popleft()
        stage = self.stage[chunk]
        if split:
            self.ops.append(Op(OpKind.B, stage, mb, j))
            self.weights.append(Op(OpKind.W, stage, mb, j))
        else:
            self.ops.append(Op(OpKind.BW, stage, mb, j))

    def weight(self) -> None:
        self.ops.append(self.weights.popleft())


def _phases(rank: int, pp: int, microbatches: int, slices: int) -> list[Op]:
    r, n = rank, microbatches * slices
    lag = slices - 1  # backward-order units lag the forward order by up to k-1 units
    s = _Rank(rank, pp, microbatches, slices)
    for _ in range(2 * (pp - r - 1)):  # 1: nF0
        s.forward(0)
    for _ in range(r + 1 + lag):  # 2: nF0F1
        s.forward(0)
        s.forward(1)
    for _ in range(pp - r - 1):  # 3: nB1W1F1
        s.backward(1, split=True)
        s.weight()
        s.forward(1)
    for _ in range(n - 2 * pp + r + 1 - lag):  # 4: nF0B1F1B0 (two overlapped pairs)
        s.forward(0)
        s.backward(1)
        s.forward(1)
        s.backward(0)
    for _ in range(pp - r - 1):  # 5: nB1F1B0
        s.backward(1)
        s.forward(1)
        s.backward(0)
    split = False
    tail = r + 1 + lag
    for i in range(tail):  # 6: nB1B0, the second half split into B and W
        if i == tail // 2 and tail % 2 == 0:
            split = True
        s.backward(1, split=split)
        if i == tail // 2 and tail % 2 == 1:
            split = True
        s.backward(0, split=split)
    for _ in range(pp - r - 1):  # 7: nWB0
        s.weight()
        s.backward(0, split=True)
    while s.weights:  # 8: nW
        s.weight()
    assert not any(s.forwards) and not any(s.backwards)
    return s.ops


def dualpipev(request: ScheduleRequest) -> Schedule:
    """DeepSeek's eight phases per rank (see the module docstring)."""
    pp = request.pp
    return Schedule(
        name=request.name or "dualpipev",
        pp=pp,
        microbatches=request.microbatches,
        num_stages=2 * pp,
        slices=request.slices,
        placement=Placement(pp, 2 * pp, "vshape"),
        ranks=[_phases(rank, pp, request.microbatches, request.slices) for rank in range(pp)],
    )
