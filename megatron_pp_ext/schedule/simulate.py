"""The simulator: lower a schedule, then replay it (``replay.py``: time, bubbles and activation
memory per rank, the semantics of the replay).
"""

from __future__ import annotations

from collections.abc import Mapping

from .completion import FREE
from .costs import CostModel
from .ir import Schedule
from .lowering import lower
from .replay import SimResult, replay


def simulate(
    schedule: Schedule,
    costs: CostModel | None = None,
    holds: Mapping[tuple[int, int], float] | None = None,
    completion: str = FREE,
) -> SimResult:
    """Replay ``schedule`` (lowered first if needed) under ``costs`` (unit costs by default).
    ``holds``: (rank, position in the lowered schedule) -> the earliest time that rank may start
    the op there (``iterations.py``: an iteration's start and its validation gate).
    ``completion``: when messages complete (``completion.py``; default: sends never wait)."""
    return replay(lower(schedule), costs, schedule, holds, completion)
