"""Lock-step slots: a schedule's dependency structure without its durations.

Every compute op lasts one unit and messages are instant, so an op's start is its slot. SlimPipe's
pairing (``redistribute.py``) and the message order of its attention exchanges
(``message_order.py``) both read time this way, so the two ops of a pair end together in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .costs import UniformCosts
from .ir import Op, Schedule


@dataclass
class SlotCosts:
    """Every compute op one unit, messages instant; anything else from ``base``."""

    base: Any

    def duration(self, op: Op) -> float:
        return 1.0

    def comm_latency(self, op: Op) -> float:
        return 0.0

    def copy_time(self, op: Op) -> float:
        return 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def slot_costs(schedule: Schedule, costs: Any = None) -> SlotCosts:
    """Unit durations and instant messages; ``costs`` supplies what a replay asks besides them
    (default: uniform costs)."""
    if costs is None:
        costs = UniformCosts(
            num_stages=schedule.num_stages, num_slices=schedule.slices, chunks_per_rank=schedule.vpp
        )
    return SlotCosts(costs)
