"""Schedule generators and their registry.

Each generator is a small function ``ScheduleRequest -> Schedule`` in its own module. The
registry says what each needs (placement, chunks per rank, minimum microbatches) so that an
impossible request fails early with the flag to change, before anything is generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import Schedule
from .one_f_one_b import one_f_one_b
from .request import Costs, RequestError, ScheduleRequest

__all__ = ["Costs", "RequestError", "ScheduleRequest", "SCHEDULES", "GeneratorSpec", "generate"]


@dataclass(frozen=True)
class GeneratorSpec:
    name: str
    build: Callable[[ScheduleRequest], Schedule]
    summary: str
    placement: str = "interleaved"  # "interleaved" or "vshape"
    default_vpp: int = 1
    allowed_vpp: tuple[int, ...] | None = (1,)  # None: any vpp >= 1
    default_partition: str = "uniform"  # how sliced runs cut the sequence by default
    min_microbatches: Callable[[int, int, int], int] = lambda pp, vpp, slices: 1


SCHEDULES: dict[str, GeneratorSpec] = {}


def register(spec: GeneratorSpec) -> None:
    SCHEDULES[spec.name] = spec


register(GeneratorSpec("1f1b", one_f_one_b, "PipeDream-flush 1F1B (Megatron's default)"))


def generate(
    name: str,
    pp: int,
    microbatches: int,
    vpp: int | None = None,
    slices: int = 1,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> Schedule:
    """Build schedule ``name``; raise :class:`RequestError` (naming the flag) if it cannot be built."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise RequestError(
            f"unknown schedule {name!r}; choose from: {', '.join(SCHEDULES)}", flag="--schedule"
        )
    if pp < 1:
        raise RequestError(f"pipeline size must be at least 1, got {pp}", flag="--pp")
    vpp = spec.default_vpp if vpp is None else vpp
    if vpp < 1 or (spec.allowed_vpp is not None and vpp not in spec.allowed_vpp):
        allowed = "any value >= 1" if spec.allowed_vpp is None else " or ".join(map(str, spec.allowed_vpp))
        raise RequestError(f"{name} takes --vpp {allowed}, got {vpp}", flag="--vpp")
    if slices < 1:
        raise RequestError(f"--slices must be at least 1, got {slices}", flag="--slices")
    needed = spec.min_microbatches(pp, vpp, slices)
    if microbatches < needed:
        raise RequestError(
            f"{name} with pp={pp}, vpp={vpp}, slices={slices} needs at least {needed} microbatches, "
            f"got {microbatches}",
            flag="--microbatches",
        )
    request = ScheduleRequest(
        pp=pp,
        microbatches=microbatches,
        vpp=vpp,
        slices=slices,
        costs=costs or Costs(),
        memory_limit=memory_limit,
        name=name,
    )
    schedule = spec.build(request)
    schedule.meta.setdefault("partition", spec.default_partition)
    return schedule
