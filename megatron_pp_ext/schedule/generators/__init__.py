"""Schedule generators and their registry.

Each generator is a small function ``ScheduleRequest -> Schedule`` in its own module. The
registry says what each needs (placement, chunks per rank, minimum microbatches) so that an
impossible request fails early with the flag to change, before anything is generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..ir import Schedule
from .dualpipev import dualpipev
from .interleaved import interleaved_1f1b, interleaved_1f1b_groups_of_p
from .one_f_one_b import one_f_one_b
from .request import Costs, RequestError, ScheduleRequest
from .sliced import seq1f1b, seq1f1b_interleaved, slimpipe, slimpipe_interleaved
from .uniform_interleaved import uniform_interleaved, uniform_interleaved_fast
from .vshape import v_half, v_min, v_zb
from .zero_bubble import zb_auto, zb_h1, zb_h2

__all__ = ["Costs", "RequestError", "ScheduleRequest", "SCHEDULES", "GeneratorSpec", "generate"]


@dataclass(frozen=True)
class GeneratorSpec:
    name: str
    build: Callable[[ScheduleRequest], Schedule]
    summary: str
    placement: str = "interleaved"  # "interleaved" or "vshape"
    default_vpp: int = 1
    allowed_vpp: tuple[int, ...] | None = (1,)  # None: any vpp >= min_vpp
    default_partition: str = "uniform"  # how sliced runs cut the sequence by default
    min_microbatches: Callable[[int, int, int], int] = lambda pp, vpp, slices: 1
    min_vpp: int = 1
    min_slices: Callable[[int, int], int] = lambda pp, vpp: 1

    def takes_vpp(self, vpp: int) -> bool:
        """Whether the schedule runs ``vpp`` model chunks per rank."""
        return vpp >= max(1, self.min_vpp) and (self.allowed_vpp is None or vpp in self.allowed_vpp)

    def vpp_choices(self) -> str:
        """The chunks per rank it runs, in words: "1", "2", "2 or more"."""
        if self.allowed_vpp is None:
            return f"{max(1, self.min_vpp)} or more"
        return " or ".join(map(str, self.allowed_vpp))


SCHEDULES: dict[str, GeneratorSpec] = {}


def register(spec: GeneratorSpec) -> None:
    SCHEDULES[spec.name] = spec


register(GeneratorSpec("1f1b", one_f_one_b, "PipeDream-flush 1F1B (Megatron's default)"))
register(
    GeneratorSpec(
        "interleaved-1f1b",
        interleaved_1f1b,
        "Megatron's interleaved 1F1B: v chunks per rank, groups of p microbatches (m // p even groups "
        "when p does not divide m, as PyTorch regroups)",
        default_vpp=2,
        allowed_vpp=None,
        min_vpp=2,
    )
)
register(
    GeneratorSpec(
        "interleaved-1f1b-groups-of-p",
        interleaved_1f1b_groups_of_p,
        "interleaved 1F1B with groups of exactly p whatever m: M(1+1/v) peak, a few slots longer when p "
        "does not divide m",
        default_vpp=2,
        allowed_vpp=None,
        min_vpp=2,
    )
)
register(
    GeneratorSpec(
        "uniform-interleaved",
        uniform_interleaved,
        "PipeOffload's uniform interleaved: one F/B/W pattern per unit, flat memory, chunk 0 longest-lived",
        default_vpp=2,
        allowed_vpp=None,
        min_vpp=2,
    )
)
register(
    GeneratorSpec(
        "uniform-interleaved-fast",
        uniform_interleaved_fast,
        "uniform interleaved with the smallest chunk lag at which no backward waits: ~2 slots shorter, "
        "2-4 stage-units more memory",
        default_vpp=2,
        allowed_vpp=None,
        min_vpp=2,
    )
)
register(GeneratorSpec("zb-h1", zb_h1, "Zero Bubble H1: 1F1B's memory, W fills the cool-down"))
register(GeneratorSpec("zb-h2", zb_h2, "Zero Bubble H2: up to 2p-1 in flight, no steady-state bubble"))
register(
    GeneratorSpec(
        "zb-auto", zb_auto, "Zero Bubble automatic: greedy list scheduling from costs under --memory-limit"
    )
)
_V = {"placement": "vshape", "default_vpp": 2, "allowed_vpp": (2,)}
register(GeneratorSpec("v-min", v_min, "V-shape, minimal memory (about M/3)", **_V))
register(GeneratorSpec("v-half", v_half, "V-shape, half of 1F1B's memory and bubble", **_V))
register(GeneratorSpec("v-zb", v_zb, "V-shape zero bubble at 1F1B's memory", **_V))
register(
    GeneratorSpec(
        "dualpipev",
        dualpipev,
        "DeepSeek's DualPipeV: DualPipe cut in half on a V, overlapped F&B pairs",
        min_microbatches=lambda pp, vpp, slices: -(-(2 * pp + slices - 1) // slices),
        **_V,
    )
)
register(
    GeneratorSpec("seq1f1b", seq1f1b, "Seq1F1B: 1F1B over sequence slices", default_partition="balanced")
)
register(
    GeneratorSpec(
        "seq1f1b-interleaved",
        seq1f1b_interleaved,
        "Seq1F1B interleaved: groups of ceil(p/k) microbatches",
        default_vpp=2,
        allowed_vpp=None,
        min_vpp=2,
        default_partition="balanced",
    )
)
register(GeneratorSpec("slimpipe", slimpipe, "SlimPipe: uniform slices, k + 2(p-1-r) slices in flight"))
register(
    GeneratorSpec(
        "slimpipe-interleaved",
        slimpipe_interleaved,
        "SlimPipe interleaved: k*v + 2(p-1-r) slices in flight, needs k >= p",
        default_vpp=2,
        allowed_vpp=None,
        min_vpp=2,
        min_slices=lambda pp, vpp: pp,
    )
)


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
    if not spec.takes_vpp(vpp):
        raise RequestError(f"{name} takes --vpp {spec.vpp_choices()}, got {vpp}", flag="--vpp")
    if slices < 1:
        raise RequestError(f"--slices must be at least 1, got {slices}", flag="--slices")
    needed_slices = spec.min_slices(pp, vpp)
    if slices < needed_slices:
        raise RequestError(
            f"{name} with pp={pp} needs at least {needed_slices} slices per microbatch, got {slices}",
            flag="--slices",
        )
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
