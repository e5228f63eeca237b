"""The suite's two tiers, and the time report that keeps them honest (docs/testing.md).

- **quick** (``python -m pytest -q``, the README's command): every test function runs, but a
  parametrised one runs only a *covering* subset of its cases: the fewest cases in which every
  value of every parameter appears at least once (greedy set cover, deterministic). A matrix
  of schedules x sizes x features keeps every schedule, every size and every feature, not their
  cross product. The tests ``tiers.FULL_ONLY`` names (each with the quicker test that keeps its
  feature) and cases marked ``full`` are left to the full tier.
- **full** (``python -m pytest -q --tier full``, CI's command): every case. ``heavy`` cases stay
  out of both (``-m heavy`` runs them), as before.

Nothing else differs: the same assertions run on the cases each tier keeps. At the end of a run
the plugin prints the tier, its wall time and test count, and its slowest tests.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections import defaultdict
from typing import Any

import pytest
from tiers import FULL_ONLY, RUN_FIRST

TIERS = ("quick", "full")
_TIER_VARIABLE = "PP_EXT_TIER"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=TIERS,
        default=os.environ.get(_TIER_VARIABLE, "quick"),
        help="quick: a covering subset of every parametrised matrix (the default); full: every case "
        f"(also ${_TIER_VARIABLE})",
    )


@pytest.fixture(scope="session")
def tier(request: pytest.FixtureRequest) -> str:
    """The tier this run selected: "quick" or "full"."""
    return request.config.getoption("--tier")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: left out of the quick tier (its siblings cover it)")
    config._pp_ext_started = time.monotonic()  # type: ignore[attr-defined]


def _value_key(value: Any) -> str:
    """A stable name for one parameter value (ids of objects vary between runs)."""
    if isinstance(value, (str, int, float, bool, type(None), tuple)):
        return repr(value)
    return f"{type(value).__name__}:{value!r}"[:200]


def covering_subset(cases: list[dict[str, str]]) -> list[int]:
    """Indices of the fewest cases (greedy) in which every (parameter, value) pair of ``cases``
    appears; ties go to the earlier case, so the choice is the same on every run."""
    uncovered = {(name, value) for case in cases for name, value in case.items()}
    chosen: list[int] = []
    while uncovered:
        best, gain = -1, 0
        for index, case in enumerate(cases):
            count = sum((name, value) in uncovered for name, value in case.items())
            if count > gain:
                best, gain = index, count
        chosen.append(best)
        uncovered -= set(cases[best].items())
    return sorted(chosen)


def full_only(nodeid: str) -> bool:
    """Whether ``tiers.FULL_ONLY`` leaves this test to the full tier."""
    return any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in FULL_ONLY)


def _quick_items(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """(kept, left to the full tier)."""
    groups: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        groups[item.nodeid.split("[", 1)[0]].append(item)
    keep: set[str] = set()
    for members in groups.values():
        candidates = [m for m in members if m.get_closest_marker("full") is None and not full_only(m.nodeid)]
        with_params = [m for m in candidates if getattr(m, "callspec", None) is not None]
        keep.update(m.nodeid for m in candidates if getattr(m, "callspec", None) is None)
        if with_params:
            cases = [{name: _value_key(v) for name, v in m.callspec.params.items()} for m in with_params]
            keep.update(with_params[i].nodeid for i in covering_subset(cases))
    kept = [item for item in items if item.nodeid in keep]
    return kept, [item for item in items if item.nodeid not in keep]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--tier") != "full":
        kept, left = _quick_items(items)
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = kept
    first = {path: rank for rank, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))  # stable


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The tier's wall time, its test count and its ten slowest tests (setup + call + teardown)."""
    durations: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                durations[report.nodeid] += report.duration
    if not durations:
        return
    wall = time.monotonic() - config._pp_ext_started  # type: ignore[attr-defined]
    tier = config.getoption("--tier")
    terminalreporter.section(f"tier {tier}: {len(durations)} tests in {wall:.0f} s")
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
