"""`megatron-pp-ext simulate` end to end: table, JSON, pictures, and one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import cli_runner
import pytest

from megatron_pp_ext.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return cli_runner.run_cli(args, timeout=120)


def test_simulate_json(capsys) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schedule"] == "1f1b" and data["pp"] == 4 and data["microbatches"] == 8
    assert data["bubble_rate"] == pytest.approx(3 / 11)
    assert data["peak_memory_m"][0] == pytest.approx(1.0)


def test_simulate_all_lists_every_schedule(capsys) -> None:
    from megatron_pp_ext.schedule.generators import SCHEDULES

    assert main(["simulate", "--schedule", "all", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["schedule"] for row in data["schedules"]] == list(SCHEDULES)


def test_simulate_writes_pictures_and_schedule(tmp_path, capsys) -> None:
    png, svg, trace, saved = (tmp_path / name for name in ("t.png", "t.svg", "t.json", "s.txt"))
    for picture in (png, svg):
        assert main(["simulate", "--pp", "3", "--microbatches", "4", "--plot", str(picture)]) == 0
        assert picture.stat().st_size > 1000
    assert (
        main(["simulate", "--pp", "3", "--microbatches", "4", "--trace", str(trace), "--save", str(saved)])
        == 0
    )
    assert json.loads(trace.read_text())["traceEvents"]
    # the saved schedule loads back and simulates to the same numbers
    assert main(["simulate", "--schedule-file", str(saved), "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(out)["bubble_rate"] == pytest.approx(2 / 6)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--schedule", "nope"], "--schedule"),
        (["--microbatches", "0"], "--microbatches"),
        (["--slices", "8", "--seq-length", "4"], "--slices"),
        (["--costs", "1,1"], "--costs"),
        (["--model", "llama-9b"], "--model"),
        (["--model", "llama-7b", "--seq-length", "4100", "--slices", "3"], "--seq-length"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(args: list[str], flag: str) -> None:
    done = run_cli("simulate", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], done.stderr


def test_hand_broken_schedule_file_is_rejected(tmp_path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("pp: 2\nmicrobatches: 1\nrank 0: BW0:0 F0:0\nrank 1: F1:0 BW1:0\n")
    done = run_cli("simulate", "--schedule-file", str(path))
    assert done.returncode == 2
    assert "BW0:0 at rank 0 position 0 needs F0:0" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--lr", "-1"],
        ["train", "--pp-schedule", "v-zb", "--pp-chunks", "3"],
        ["train", "--normalization", "LayerNorm"],
        ["train", "--global-batch-size", "7"],
    ],
    ids=lambda args: " ".join(args),
)
def test_bad_train_input_fails_before_torch_is_imported(args: list[str]) -> None:
    """The checks before launch import torch only for what needs it (a GPU question, a checkpoint
    to read): most bad input is answered in a fraction of a second, not after seconds of imports."""
    code = (
        "import sys; from megatron_pp_ext.cli import main; "
        f"code = main({args!r}); "
        "assert code == 2, code; "
        "assert 'torch' not in sys.modules and 'megatron.core' not in sys.modules, 'imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "megatron-pp-ext train: error: " in done.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """``simulate ... | head``: once the reader is gone the output has nowhere to go; the command
    stops without a traceback (exit 1), as other command-line tools do. ``true`` reads nothing
    and is gone long before the simulation prints, so the write fails every time."""
    command = f"{sys.executable} -m megatron_pp_ext simulate --model llama3-8b --pp 8 | true"
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True)
    assert done.stderr == "", done.stderr
    assert done.returncode == 1


def test_simulate_takes_megatron_s_layer_split(capsys) -> None:
    """``simulate --model`` with Megatron's layer-split flags replays megatron-core's split: each
    rank's busy time follows its layers, and a split megatron-core refuses exits 2 naming the flag."""
    base = ["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json"]
    base += ["--model", "llama3-8b", "--seq-length", "4096"]
    assert main(base) == 0
    even = json.loads(capsys.readouterr().out)["busy_per_rank"]
    assert main([*base, "--decoder-first-pipeline-num-layers", "5"]) == 0  # 5 / 9 / 9 / 9
    uneven = json.loads(capsys.readouterr().out)["busy_per_rank"]
    assert uneven[0] == pytest.approx(even[0] * 5 / 8, rel=0.02)
    assert uneven[1] == pytest.approx(even[1] * 9 / 8, rel=0.02)
    assert main([*base, "--decoder-first-pipeline-num-layers", "6"]) == 2  # 26 over 3
    err = capsys.readouterr().err
    assert "--decoder-first-pipeline-num-layers" in err and "cannot share evenly" in err
