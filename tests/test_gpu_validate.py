"""scripts/gpu_validate.sh on a machine without a GPU: the phase list, the probe, bad usage.

The script is what a GPU machine runs to validate the project (docs/benchmarks.md gets its
results). Here it must list every phase without Python, run the probe with its GPU checks as SKIP
lines, append the probe's block to the file ``DOCS`` names (never the real docs) and write its log
under ``OUT``, and refuse an unknown phase with one line naming the valid ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_validate.sh"
PHASES = [
    "preflight",
    "probe",
    "train-pp1",
    "bw-split",
    "offload",
    "attention-memory",
    "post-validation",
    "shared-gpu",
    "pretrain-gpt",
    "cpu-suite",
    "sliced-attention",
    "bench",
    "bench-offload",
    "moe",
]
PROBE_STEPS = ["versions", "imports", "nvidia-smi", "cuda", "bf16", "nccl"]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def test_dry_run_lists_every_phase_once_without_python() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "/nonexistent/python3"}  # no interpreter is needed
    result = run("--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n\n")[0].splitlines()  # the phases; the rounds follow (test_gpu_rounds.py)
    assert lines[0].startswith("phase ")
    assert [line.split()[0] for line in lines[1:]] == PHASES
    for line in lines[1:]:
        assert "GPU: " in line and "needs: " in line and "min" in line, line


def test_unknown_phase_exits_2_naming_the_valid_ones() -> None:
    result = run("probe", "no-such-phase")
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "no-such-phase" in line
    assert all(phase in line for phase in PHASES)


@pytest.mark.slow
def test_probe_without_gpu_skips_the_gpu_checks_and_appends_to_docs(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OUT": str(out),
        "DOCS": str(docs),
        "CUDA_VISIBLE_DEVICES": "",  # no GPU, whatever machine runs the suite
    }
    result = run("probe", env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for step in ("versions", "imports"):
        assert f"PASS probe/{step} " in result.stdout
    for step in ("cuda", "bf16", "nccl"):
        assert f"SKIP probe/{step} (" in result.stdout
        assert "SKIP: no CUDA device" in result.stdout
    assert "0 failed" in result.stdout

    text = docs.read_text()
    assert text.startswith("# Benchmarks\n")
    assert text.count("## GPU validation, ") == 1 and "UTC" in text
    for field in (
        "- date: ",
        "- device (nvidia-smi",
        "- versions: python ",
        "torch ",
        "megatron-core ",
        "- setup: ",
    ):
        assert field in text, field
    assert "### probe" in text
    for step in PROBE_STEPS:
        assert f"`probe/{step}`" in text, step
    assert "`python3 scripts/gpu/probe.py cuda`" in text
    assert (out / "summary.md").read_text() == text[len("# Benchmarks\n") :]
    log = (out / "probe.log").read_text()
    assert "=== probe/versions: python3 scripts/gpu/probe.py versions" in log
    real_docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert str(out) not in real_docs, "the block went to the real docs"
