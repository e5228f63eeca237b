"""Data dependencies between compute ops: what must have run before an op can run.

One place states the rules that the validator checks, the list scheduler respects and the
simulator replays:

* F of (stage s, microbatch m, slice j) needs F of stage s-1 (its input) and F of slice j-1 on
  stage s (slice j attends to the K/V cached by the earlier slices).
* B (or BW) needs its own F, the backward of stage s+1 (the output gradient; on the last stage
  the loss is computed from the F output itself) and the backward of slice j+1 on stage s
  (later slices hand back the gradients of the K/V they read from slice j).
* W needs the B of the same unit, on the same rank.
"""

from __future__ import annotations

from .ir import Op, OpKind

Unit = tuple[int, int, int]  # (stage, microbatch, slice)


def forward_dependencies(stage: int, microbatch: int, slice_: int) -> list[tuple[OpKind, Unit]]:
    deps: list[tuple[OpKind, Unit]] = []
    if stage > 0:
        deps.append((OpKind.F, (stage - 1, microbatch, slice_)))
    if slice_ > 0:
        deps.append((OpKind.F, (stage, microbatch, slice_ - 1)))
    return deps


def backward_dependencies(
    stage: int, microbatch: int, slice_: int, num_stages: int, num_slices: int
) -> list[tuple[str, Unit]]:
    """Returns ("F", unit) or ("BACKWARD", unit): the latter is satisfied by a B or a BW."""
    deps: list[tuple[str, Unit]] = [("F", (stage, microbatch, slice_))]
    if stage < num_stages - 1:
        deps.append(("BACKWARD", (stage + 1, microbatch, slice_)))
    if slice_ < num_slices - 1:
        deps.append(("BACKWARD", (stage, microbatch, slice_ + 1)))
    return deps


def compute_dependencies(op: Op, num_stages: int, num_slices: int) -> list[tuple[str, Unit]]:
    """Dependencies of a compute op as (what, unit), what in {"F", "BACKWARD", "B"}."""
    stage, microbatch, slice_ = op.unit
    if op.kind == OpKind.F:
        return [("F", unit) for _, unit in forward_dependencies(stage, microbatch, slice_)]
    if op.kind in (OpKind.B, OpKind.BW):
        return backward_dependencies(stage, microbatch, slice_, num_stages, num_slices)
    if op.kind == OpKind.W:
        return [("B", op.unit)]
    raise ValueError(f"{op} is not a compute op")


def describe(what: str, unit: Unit) -> str:
    stage, microbatch, slice_ = unit
    kind = "B/BW" if what == "BACKWARD" else what
    return f"{kind}{stage}:{microbatch}" + (f".{slice_}" if slice_ else "")
