"""docs/vocab_parallel.md's "Figures" tables are what scripts/vocab_parallel_table.py prints: two of
their rows recomputed through the script's ``row`` (a 1F1B and a V-Half one, the kind that went
stale once), so a change of the simulator or a generator cannot leave the document behind."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "vocab_parallel.md"


def table_script() -> ModuleType:
    path = REPO / "scripts" / "vocab_parallel_table.py"
    spec = importlib.util.spec_from_file_location("vocab_parallel_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented_row(model: str, schedule: str, pp: int, variant: str) -> str:
    """The document's line for (model, schedule, p, vocab), read from its "Figures" section."""
    figures = DOC.read_text().split("## Figures", 1)[1]
    found = [
        line
        for line in figures.splitlines()
        if [cell.strip() for cell in line.strip("|").split("|")][:5]
        == [model, schedule, str(pp), str(4 * pp), variant]
    ]
    assert len(found) == 1, f"{DOC.name} lists {len(found)} rows for {model} {schedule} p={pp} {variant}"
    return found[0]


@pytest.mark.parametrize(
    ("model", "schedule", "pp", "variant"),
    [("llama3-8b", "1f1b", 8, "vocab-1"), ("llama3-8b", "v-half", 8, "vocab-2")],
)
def test_documented_rows_are_the_scripts(model: str, schedule: str, pp: int, variant: str) -> None:
    expected = documented_row(model, schedule, pp, variant)
    assert table_script().row(model, schedule, pp, 4 * pp, variant) == expected, (
        "docs/vocab_parallel.md is stale: regenerate its tables with python scripts/vocab_parallel_table.py"
    )


def test_the_script_prints_the_documents_header() -> None:
    header = table_script().HEADER.splitlines()[0]
    assert DOC.read_text().split("## Figures", 1)[1].count(header + "\n") == 2
