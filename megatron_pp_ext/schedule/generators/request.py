"""What a generator is asked for, and the error raised for a request that cannot be met."""

from __future__ import annotations

from dataclasses import dataclass


class RequestError(ValueError):
    """An impossible request. ``flag`` names the command-line flag to change."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class Costs:
    """Op durations in any consistent unit (the automatic ZB scheduler plans with them)."""

    forward: float = 1.0
    backward: float = 1.0  # B: input gradient only
    weight: float = 1.0  # W: weight gradient
    comm: float = 0.0  # p2p latency between ranks


@dataclass(frozen=True)
class ScheduleRequest:
    """Sizes and knobs of one schedule. ``vpp`` is chunks (virtual stages) per rank.

    ``memory_limit`` is in units of M (activation of one whole microbatch over all layers);
    generators that take one (automatic ZB) respect it, others ignore it.
    """

    pp: int
    microbatches: int
    vpp: int = 1
    slices: int = 1
    costs: Costs = Costs()
    memory_limit: float | None = None
    name: str = ""
