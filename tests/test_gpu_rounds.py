"""The GPU rounds of scripts/gpu_validate.sh and what they carry (scripts/gpu/prepare_carry.sh), on
a machine without a GPU and without torch.

A round is one command of at most 8 minutes on the first GPU the project meets (a 15-minute
booking, at most 8 files back): ``--dry-run`` must list round-1..round-5 with their parts, each
part a step its phase really defines, the time limits summing (with the setup) to 8 minutes at
most; an unknown round is refused in one line. prepare_carry.sh, with its downloads stubbed by a
script writing fake wheels and a tiny stand-in Megatron-LM tree, must fill the carried folder with
one wheel per package and a trimmed Megatron-LM, print the folder and the install line, and refuse
a second version of a package or a folder over the limit. shared_gpu.py's plan puts the schedule
families before the variants.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_validate.sh"
CARRY = ROOT / "scripts" / "gpu" / "prepare_carry.sh"
ROUNDS = [f"round-{n}" for n in range(1, 6)]
LIMIT_S = 8 * 60
NO_PYTHON = {"PATH": "/usr/bin:/bin", "PYTHON": "/nonexistent/python3"}  # nothing may need Python


def bash(script: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def dry_rounds() -> dict[str, dict]:
    """--dry-run's rounds: name -> {total, setup, steps, files, parts: [(phase/step, seconds, command)]}."""
    result = bash(SCRIPT, "--dry-run", env=NO_PYTHON)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    phases, _, rounds_text = result.stdout.partition("\n\n")
    rounds: dict[str, dict] = {}
    current = None
    header = re.compile(
        r"^(round-\d+)\s+at most (\d+) s = ([\d.]+) min "
        r"\(setup (\d+) s \+ steps (\d+) s\), (\d+) files back: \S"
    )
    for line in rounds_text.splitlines()[1:]:
        match = header.match(line)
        if match:
            current = rounds[match[1]] = {
                "total": int(match[2]),
                "minutes": float(match[3]),
                "setup": int(match[4]),
                "steps": int(match[5]),
                "files": int(match[6]),
                "parts": [],
            }
            continue
        part = re.match(r"^  (\S+/\S+)\s+(\d+) s  (.+)$", line)
        assert part and current is not None, f"unexpected line in the rounds: {line!r}"
        current["parts"].append((part[1], int(part[2]), part[3]))
    return rounds


def test_dry_run_lists_the_rounds_with_their_parts_and_minutes_each_within_8_minutes() -> None:
    rounds = dry_rounds()
    assert list(rounds) == ROUNDS
    for name, info in rounds.items():
        seconds = [limit for _, limit, _ in info["parts"]]
        assert info["parts"], name
        assert info["steps"] == sum(seconds) and info["total"] == info["setup"] + sum(seconds), name
        assert info["setup"] >= 30, "setup (wheels, torch's first import) is part of a round's 8 minutes"
        assert info["total"] <= LIMIT_S and info["minutes"] <= 8.0, f"{name}: {info['total']} s"
        phases = {part.split("/")[0] for part, _, _ in info["parts"]}
        assert info["files"] == len(phases) + 1 <= 8, name  # a log per phase and summary.md
        for part, limit, command in info["parts"]:
            assert limit > 0 and "NO SUCH STEP" not in command, (name, part)
    parts = {name: [part for part, _, _ in info["parts"]] for name, info in rounds.items()}
    commands = {part: command for info in rounds.values() for part, _, command in info["parts"]}
    one = parts["round-1"]
    assert rounds["round-1"]["parts"][0][:2] == ("preflight/primitives", 30)
    for phase in ("probe", "train-pp1", "bw-split", "attention-memory", "shared-gpu"):
        assert any(part.startswith(phase + "/") for part in one), phase
    assert "--runs 1f1b@2" in commands["shared-gpu/canary-pp2"]
    # round-2: the families first, then the variants, then sliced attention at 16K..128K
    assert parts["round-2"][0] == "shared-gpu/families-first"
    assert "--runs families,rest" in commands["shared-gpu/families-first"]
    lengths = [int(commands[p].split()[2]) for p in parts["round-2"][1:]]
    assert lengths == [16384, 32768, 65536, 131072]
    assert all("--backends torch_flash" in commands[p] for p in parts["round-2"][1:])
    assert parts["round-3"] == ["pretrain-gpt/zb-h1", "pretrain-gpt/seq1f1b-k2", "offload/sanitizer"]
    assert "TORCH_CUDA_SANITIZER=1" in commands["offload/sanitizer"]
    assert "--pp-seq-slices 2" in commands["pretrain-gpt/seq1f1b-k2"]
    assert parts["round-4"] == ["bench/against-megatron", "post-validation/200-steps"]
    for part in parts["round-5"]:
        command = commands[part]
        for flag in ("--num-experts 4", "--moe-router-topk 2", "--expert-model-parallel-size 2", "--pp 2"):
            assert flag in command, (part, flag)
        assert "--distributed-backend gloo" in command
    schedules = [commands[p].split("--pp-schedule ")[1] for p in parts["round-5"]]
    assert schedules == ["dualpipev", "zb-h1", "dualpipev", "v-zb"]
    paired = [p for p in parts["round-5"] if "--overlap-moe-expert-parallel-comm" in commands[p]]
    assert paired == ["moe/dualpipev-paired", "moe/v-zb-paired"]
    assert all("--moe-token-dispatcher-type alltoall" in commands[p] for p in paired)


def test_a_round_naming_a_step_its_phase_lacks_fails_the_dry_run(tmp_path: Path) -> None:
    """The dry run checks every part against the steps the phase functions define."""
    broken = tmp_path / "gpu_validate.sh"
    text = SCRIPT.read_text()
    assert "probe/cuda:20" in text
    broken.write_text(text.replace("probe/cuda:20", "probe/no-such-step:20").replace(
        'REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)', f"REPO={ROOT}"
    ))  # fmt: skip
    result = bash(broken, "--dry-run", env=NO_PYTHON)
    assert result.returncode == 1
    assert re.search(r"^  probe/no-such-step\s+20 s  NO SUCH STEP$", result.stdout, re.M)


def test_an_unknown_round_exits_2_naming_the_valid_ones() -> None:
    result = bash(SCRIPT, "round-6", env=NO_PYTHON)
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "'round-6'" in line
    assert all(name in line for name in ROUNDS)


def test_shared_gpu_plan_runs_the_families_first_then_every_variant_once() -> None:
    plan = [ROOT / "scripts" / "gpu" / "shared_gpu.py", "--plan", "--runs", "families,rest"]
    done = subprocess.run(
        [sys.executable, *map(str, plan)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    runs = done.stdout.split()
    families = ["zb-h2@4", "v-zb@4", "dualpipev@4", "seq1f1b@4", "slimpipe@4", "interleaved-1f1b@2"]
    assert runs[: len(families)] == families
    assert len(runs) == len(set(runs))
    from megatron_pp_ext.schedule.generators import SCHEDULES

    assert set(runs) == {f"{name}@{pp}" for name in SCHEDULES for pp in (2, 3, 4)}


# ---- prepare_carry.sh ------------------------------------------------------------------------------

FAKE_PIP = textwrap.dedent(
    """\
    import os, re, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_PIP_LOG"], "a") as log:
        log.write(" ".join(args) + "\\n")
    target = args[args.index("-d") + 1]
    value_flags = {"-d", "--python-version", "--implementation", "--platform", "--abi"}
    specs, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in value_flags:
            skip = True
        elif not arg.startswith("-"):
            specs.append(arg)
    deps = {"pydantic": ["pydantic-core==2.33.2", "annotated-types==0.7.0", "typing-inspection==0.4.1",
                         "typing-extensions==4.14.0"],
            "hypothesis": ["sortedcontainers==2.4.0"]}
    if "--no-deps" not in args:
        specs += [dep for spec in list(specs) for dep in deps.get(re.split("[<>=!~]", spec)[0], [])]
    for spec in specs:
        name = re.split("[<>=!~]", spec)[0]
        version = spec.split("==")[1] if "==" in spec else "1.0"
        binary = "cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64"
        tags = binary if name in ("regex", "pydantic-core") else "py3-none-any"
        path = os.path.join(target, f"{name.replace('-', '_')}-{version}-{tags}.whl")
        with open(path, "wb") as wheel:
            wheel.write(b"PK" + b"x" * 4096)
    """
)


def fake_megatron_lm(root: Path) -> Path:
    tree = root / "megatron-lm"
    files = {
        "pretrain_gpt.py": "import gpt_builders\n",
        "gpt_builders.py": "",
        "model_provider.py": "",
        "LICENSE": "license\n",
        "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 16\nPATCH = 1\n",
        "megatron/core/__init__.py": "",
        "megatron/core/datasets/helpers.py": "",
        "megatron/training/__init__.py": "",
        "megatron/training/training.py": "from megatron.rl.parallel_utils import x\n",
        "megatron/training/tests/test_training.py": "",
        "megatron/training/__pycache__/training.cpython-312.pyc": "",
        "megatron/legacy/model/__init__.py": "",
        "megatron/legacy/fused_kernels/__init__.py": "",
        "megatron/rl/__init__.py": "",
        "megatron/rl/parallel_utils.py": "",
        "megatron/rl/rl_utils.py": "",
        "megatron/post_training/__init__.py": "",
        "docs/index.md": "",
        "examples/run.sh": "",
        "tests/unit_tests/test_x.py": "",
        ".git/HEAD": "ref: refs/heads/main\n",
        "pretrain_bert.py": "",
    }
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    return tree


@pytest.fixture
def carry_env(tmp_path: Path) -> dict[str, str]:
    pip = tmp_path / "fake_pip.py"
    pip.write_text(FAKE_PIP)
    return {
        **os.environ,
        "PIP_DOWNLOAD": f"{sys.executable} {pip}",
        "FAKE_PIP_LOG": str(tmp_path / "pip.log"),
        "MEGATRON_LM": str(fake_megatron_lm(tmp_path)),
        "CARRY_DIR": str(tmp_path / "carry"),
    }


EXPECTED_WHEELS = {
    "megatron_core-0.16.1-py3-none-any.whl",
    "packaging-1.0-py3-none-any.whl",
    "six-1.0-py3-none-any.whl",
    "regex-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "pydantic-1.0-py3-none-any.whl",
    "pydantic_core-2.33.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "annotated_types-0.7.0-py3-none-any.whl",
    "typing_inspection-0.4.1-py3-none-any.whl",
    "typing_extensions-4.14.0-py3-none-any.whl",
    "hypothesis-1.0-py3-none-any.whl",
    "sortedcontainers-2.4.0-py3-none-any.whl",
}


def test_prepare_carry_fills_the_folder_under_the_limit_and_says_what_to_carry(
    carry_env: dict[str, str], tmp_path: Path
) -> None:
    carry = tmp_path / "carry"
    for attempt in range(2):  # a second run replaces its Megatron-LM copy and keeps the wheels
        result = bash(CARRY, env=carry_env)
        assert result.returncode == 0, f"run {attempt}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
    assert {p.name for p in carry.glob("*.whl")} == EXPECTED_WHEELS
    calls = Path(carry_env["FAKE_PIP_LOG"]).read_text().splitlines()
    for call in calls:  # binary wheels for CPython 3.12 on x86-64, into the folder
        for flag in ("--only-binary=:all:", "--python-version 3.12", "--implementation cp", "x86_64"):
            assert flag in call, (flag, call)
        assert f"-d {carry}" in call
    assert any("--no-deps" in call and "megatron-core==0.16.1" in call for call in calls)
    assert any("--no-deps" not in call and "pydantic" in call.split() for call in calls)

    copy = carry / "megatron-lm"
    copied = {str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()}
    assert copied == {
        "pretrain_gpt.py",
        "gpt_builders.py",
        "model_provider.py",
        "LICENSE",
        ".prepare_carry",
        "megatron/core/package_info.py",
        "megatron/core/datasets/README",  # where megatron_lm_run.py copies the built helpers
        "megatron/training/__init__.py",
        "megatron/training/training.py",
        "megatron/legacy/model/__init__.py",
        "megatron/legacy/fused_kernels/__init__.py",
        "megatron/rl/__init__.py",
        "megatron/rl/parallel_utils.py",
    }
    out = result.stdout
    size = re.search(r"size: .* = ([\d.]+) MiB of 64 MiB", out)
    assert size and float(size[1]) < 64
    assert f"carry: {carry}" in out
    assert re.search(r"pip install .*--no-index --no-deps .*--target /tmp/site \S*carry/\*\.whl", out)
    assert "MEGATRON_LM=" in out and "carry/megatron-lm" in out


def test_prepare_carry_refuses_two_versions_of_one_package(carry_env: dict[str, str], tmp_path: Path) -> None:
    carry = tmp_path / "carry"
    carry.mkdir()
    stale = "pydantic_core-2.27.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    (carry / stale).write_bytes(b"PK")  # left over from an earlier run
    result = bash(CARRY, env=carry_env)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert "more than one version of: pydantic-core" in line
    assert stale in line and "pydantic_core-2.33.2-" in line
    assert "typing-extensions" not in line  # only the duplicated package is named
    assert not (carry / "megatron-lm").exists()  # refused before the copy


def test_prepare_carry_refuses_a_folder_over_the_limit_with_the_figure(carry_env: dict[str, str]) -> None:
    result = bash(CARRY, env={**carry_env, "CARRY_LIMIT_MIB": "1"})  # the working tree alone is more
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    figure = re.search(r"the working tree ([\d.]+) MiB = ([\d.]+) MiB, over the 1 MiB", line)
    assert figure and float(figure[2]) >= float(figure[1]) > 1, line


def test_prepare_carry_refuses_a_megatron_lm_of_another_version(carry_env: dict[str, str]) -> None:
    info = Path(carry_env["MEGATRON_LM"]) / "megatron" / "core" / "package_info.py"
    info.write_text("MAJOR = 0\nMINOR = 15\nPATCH = 0\n")
    result = bash(CARRY, env=carry_env)
    assert result.returncode == 1
    assert "is megatron-core 0.15.0, not 0.16.1" in result.stderr


def test_the_default_carry_folder_is_git_ignored() -> None:
    done = subprocess.run(
        ["git", "check-ignore", "-q", ".whl/megatron_core-0.16.1-py3-none-any.whl"], cwd=ROOT, check=False
    )
    assert done.returncode == 0, ".whl/ must be in .gitignore"


# ---- preflight.py ------------------------------------------------------------------------------


def preflight(*args: str, timeout: float) -> subprocess.CompletedProcess:
    script = ROOT / "scripts" / "gpu" / "preflight.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever machine runs the suite
    command = [sys.executable, str(script), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def test_preflight_skips_without_a_gpu_saying_why() -> None:
    done = preflight(timeout=120)
    assert done.returncode == 77, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("SKIP: ") and ("no CUDA device" in last or "torch does not import" in last), last


@pytest.mark.slow
@pytest.mark.full  # about 12 s of three processes importing torch: the full tier's
def test_preflight_on_cpu_runs_the_gloo_staging_and_prints_each_primitive() -> None:
    """--cpu: the two gloo ranks' all_reduce (plain and coalesced) and isend/irecv, the bf16 matmul
    and SDPA, each a PASS line, then the step's PASS line."""
    pytest.importorskip("torch")
    done = preflight("--cpu", "--timeout", "240", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in ("gloo-all-reduce", "gloo-isend-irecv", "bf16-matmul", "sdpa-flash"):
        assert any(line.startswith(f"PASS {name}: ") for line in lines), name
    assert lines[-1].startswith("PASS: 4 primitives: ")
