"""The quick tier's selection (``conftest.py``): covering subsets, and ``tiers.py`` kept current."""

from __future__ import annotations

import fnmatch
import itertools
import subprocess
import sys
from pathlib import Path

from conftest import covering_subset
from tiers import FULL_ONLY, RUN_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_a_cross_product_is_covered_by_its_longest_axis() -> None:
    schedules, sizes, features = ["1f1b", "zb-h1", "v-zb", "dualpipev"], ["2", "3"], ["none", "offload"]
    cases = [dict(s=a, p=b, f=c) for a, b, c in itertools.product(schedules, sizes, features)]
    chosen = covering_subset(cases)
    assert len(chosen) == len(schedules)  # every schedule once, sizes and features along the way
    for name, values in (("s", schedules), ("p", sizes), ("f", features)):
        assert {cases[i][name] for i in chosen} == set(values)
    assert covering_subset(cases) == chosen  # the same on every run (and every xdist worker)


def test_single_parameter_cases_are_all_kept() -> None:
    cases = [{"case": str(n)} for n in range(5)]
    assert covering_subset(cases) == list(range(5))


def test_every_full_only_pattern_and_first_file_names_collected_tests() -> None:
    """A renamed test would leave its pattern matching nothing, and the quick tier silently
    running it again: every pattern must match a test of the full tier."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0"]
        + ["--tier", "full", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(ids) > 2000, done.stdout[-2000:] + done.stderr[-2000:]
    stale = [pattern for pattern in FULL_ONLY if not fnmatch.filter(ids, pattern)]
    assert not stale, f"tests/tiers.py patterns matching no test: {stale}"
    files = {test_id.split("::", 1)[0] for test_id in ids}
    assert not [path for path in RUN_FIRST if path not in files]
