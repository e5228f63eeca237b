"""Timeline pictures and Perfetto traces of simulated schedules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_pp_ext.schedule import plot
from megatron_pp_ext.schedule.flops import flop_costs_for
from megatron_pp_ext.schedule.generators import generate
from megatron_pp_ext.schedule.simulate import simulate


@pytest.fixture(scope="module")
def sliced_result():
    schedule = generate("1f1b", 4, 8, slices=2)
    return simulate(schedule, flop_costs_for("llama-7b", schedule, seq_length=8192))


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_timeline_files_are_written(tmp_path: Path, sliced_result, suffix: str, magic: bytes) -> None:
    path = tmp_path / f"timeline{suffix}"
    plot.plot_timeline(sliced_result, str(path), time_unit="s")
    data = path.read_bytes()
    assert len(data) > 1000 and magic in data[:400]


def test_trace_is_perfetto_json(tmp_path: Path, sliced_result) -> None:
    path = tmp_path / "trace.json"
    plot.write_trace(sliced_result, str(path))
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(sliced_result.events)
    assert all(re.fullmatch(r"(F|B|W|BW) \d+\.\d+ s\d+", e["name"]) for e in spans)
    assert {e["pid"] for e in spans} == set(range(4))
    assert all(e["ts"] >= 0 and e["dur"] > 0 for e in spans)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert max(c["args"]["M"] for c in counters) == pytest.approx(max(sliced_result.peak_memory_m))


def test_labels_drop_the_slice_when_unsliced() -> None:
    result = simulate(generate("1f1b", 2, 3))
    assert plot.op_label(result.events[0], 1) == "0"
    assert plot.trace_name(result.events[0], 1) == "F 0 s0"


def test_long_schedule_renders(tmp_path: Path) -> None:
    result = simulate(generate("1f1b", 8, 64, slices=8))
    plot.plot_timeline(result, str(tmp_path / "long.png"))
    plot.write_trace(result, str(tmp_path / "long.json"))
    spans = [e for e in json.loads((tmp_path / "long.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(result.events)
    assert (tmp_path / "long.png").stat().st_size > 1000
