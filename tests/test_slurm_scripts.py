"""scripts/slurm: every sbatch file's ``--dry-run`` command line passes Megatron-LM's own
``parse_args`` + ``validate_args`` (with our ``add_args`` as ``extra_args_provider``) at the world
size of the script's nodes x GPUs; the launcher refuses bad layouts before a job starts; and
scripts/setup_megatron_lm.sh and the Dockerfile pin the Megatron-LM that megatron-core is pinned to.

Megatron-LM's tree is ../shared/megatron-lm (tag core_v0.16.1; MEGATRON_LM_DIR overrides). It is
imported in a subprocess (its ``megatron`` package must not shadow the installed megatron-core in
this process). One CUDA-free workaround, the only one validate_args needs on CPU:
``megatron.training.arguments.get_device_arch_version`` (which asks ``torch.cuda`` for the device's
compute capability, to decide whether CUDA_DEVICE_MAX_CONNECTIONS=1 is required) returns the
major version of the script's cluster (Hopper 9, A100 8) instead. Everything else is Megatron's
code as it runs on the cluster, with the environment the script exports.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
MEGATRON_LM = Path(os.environ.get("MEGATRON_LM_DIR", ROOT.parent / "shared" / "megatron-lm"))
PIN_TAG = "core_v0.16.1"


def dry_run(script: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "MASTER_"))}
    for name in (
        "NNODES",
        "GPUS_PER_NODE",
        "CONFIG",
        "SEQ_LENGTH",
        "CONTAINER_IMAGE",
        "DATA_PATH",
        "TOKENIZER",
    ):
        clean.pop(name, None)
    clean.update(PYTHON=sys.executable, RUN_ROOT=str(tmp_path / "runs"), **env)
    return subprocess.run(
        ["bash", str(script), "--dry-run", *args], capture_output=True, text=True, env=clean, timeout=120
    )


def parse_dry_run(out: str) -> dict:
    """The exported environment, the world size, the GPU's major compute capability and the
    arguments after pretrain_gpt.py, from a --dry-run's output."""
    lines = [line for line in out.splitlines() if line.strip()]
    env = dict(shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export "))
    arch = re.search(r"compute capability (\d+)\.", out)
    command = shlex.split(lines[-1])
    script = next(i for i, token in enumerate(command) if token.endswith("pretrain_gpt.py"))
    options = dict(token.lstrip("-").split("=", 1) for token in command[:script] if token.startswith("--"))
    if "nnodes" in options:  # torchrun
        world = int(options["nnodes"]) * int(options["nproc-per-node"])
    else:  # srun, one task per GPU
        world = int(options["nodes"]) * int(options["ntasks-per-node"])
    return {
        "env": env,
        "world_size": world,
        "arch": int(arch.group(1)) if arch else 9,
        "argv": command[script + 1 :],
        "launcher": command[: script + 1],
    }


# Runs in a subprocess with Megatron-LM's tree first on sys.path: every case through parse_args
# (with megatron_pp_ext's add_args) and validate_args, with the script's environment.
CHECK_WITH_MEGATRON = r"""
import contextlib, io, json, os, sys
cases = json.load(open(sys.argv[1]))
sys.path.insert(0, sys.argv[2])
import megatron.training.arguments as arguments
from megatron_pp_ext.megatron.hook import add_args
from megatron_pp_ext.megatron.pretrain import check_args  # the plugin's checks for pretrain_gpt.py

results = []
for case in cases:
    saved = dict(os.environ)
    os.environ.update(case["env"], WORLD_SIZE=str(case["world_size"]), RANK="0", LOCAL_RANK="0")
    arguments.get_device_arch_version = lambda: case["arch"]  # the one CUDA-free workaround
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = arguments.parse_args(extra_args_provider=add_args, ignore_unknown_args=False)
            arguments.validate_args(args)
            check_args(args)
        keys = ("data_parallel_size", "virtual_pipeline_model_parallel_size", "seq_length", "pp_schedule",
                "pp_chunks", "pp_seq_slices", "pp_offload", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "context_parallel_size", "global_batch_size",
                "micro_batch_size", "num_layers", "max_position_embeddings", "position_embedding_type",
                "untie_embeddings_and_output_weights", "add_bias_linear", "swiglu", "normalization",
                "mock_data", "bf16", "pp_p2p_timeout", "distributed_timeout_minutes")
        results.append({"ok": True, **{k: getattr(args, k, None) for k in keys}})
    except BaseException as error:  # argparse exits, Megatron asserts
        results.append({"ok": False, "error": repr(error), "output": out.getvalue()[-3000:]})
    finally:
        os.environ.clear()
        os.environ.update(saved)
print(json.dumps(results, default=str))
"""


def check_with_megatron(cases: list[dict], tmp_path: Path) -> list[dict]:
    if not (MEGATRON_LM / "megatron" / "training" / "arguments.py").is_file():
        pytest.skip(f"no Megatron-LM tree at {MEGATRON_LM} (set MEGATRON_LM_DIR)")
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    done = subprocess.run(
        [sys.executable, "-c", CHECK_WITH_MEGATRON, str(spec), str(MEGATRON_LM)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(MEGATRON_LM), str(ROOT)])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sbatch_header(script: Path, option: str) -> str:
    match = re.search(rf"^#SBATCH --{option}=(\S+)", script.read_text(), re.M)
    assert match, f"{script.name}: no #SBATCH --{option}"
    return match.group(1)


def script_cases(tmp_path: Path) -> list[tuple[str, dict]]:
    """Every sbatch file at its own node count, the Llama-3 8B ones at 1, 2, 4 and 8 nodes, one
    with the plain torchrun launcher, and a few configs through launch.sh at their layouts."""
    runs: list[tuple[str, Path, dict[str, str]]] = [(s.name, s, {}) for s in SCRIPTS]
    for script in SCRIPTS:
        if script.name.startswith("llama3-8b"):
            runs += [(f"{script.name} x{n}", script, {"NNODES": str(n)}) for n in (2, 4, 8)]
    for tag in ("256k", "512k"):  # the other 8-way cut of a sequence: TP8 with sequence parallelism
        runs.append((f"{tag} TP8 CP1", SLURM / f"llama2-70b-slimpipe-{tag}.sbatch", {"TP": "8", "CP": "1"}))
    runs.append(("torchrun fallback", SLURM / "llama3-8b-zbh2-a100.sbatch", {"CONTAINER_IMAGE": "none"}))
    runs.append(("gpt3-175b", SLURM / "launch.sh", {"CONFIG": "gpt3-175b", "NNODES": "128"}))
    runs.append(("gpt3-1.3b", SLURM / "launch.sh", {"CONFIG": "gpt3-1.3b"}))
    runs.append(("llama3-70b", SLURM / "launch.sh", {"CONFIG": "llama3-70b", "NNODES": "32"}))
    long_vzb = {"CONFIG": "llama2-7b", "NNODES": "4", "SEQ_LENGTH": "32768", "PP_SCHEDULE": "v-zb"}
    runs.append(("llama2-7b 32K v-zb", SLURM / "launch.sh", long_vzb))
    cases = []
    for name, script, env in runs:
        done = dry_run(script, tmp_path, **env)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        cases.append((name, parse_dry_run(done.stdout)))
    return cases


def test_every_sbatch_dry_run_passes_megatrons_parser(tmp_path: Path) -> None:
    assert {s.name for s in SCRIPTS} >= {
        "llama2-70b-slimpipe-64k.sbatch",
        "llama2-70b-slimpipe-128k.sbatch",
        "llama2-70b-slimpipe-256k.sbatch",
        "llama2-70b-slimpipe-512k.sbatch",
        "llama3-8b-zbh2-hopper.sbatch",
        "llama3-8b-zbh2-a100.sbatch",
    }
    cases = script_cases(tmp_path)
    results = check_with_megatron([case for _, case in cases], tmp_path)
    failed = {name: result for (name, _), result in zip(cases, results) if not result["ok"]}
    assert not failed, json.dumps(failed, indent=1)[-6000:]
    by_name = {name: result for (name, _), result in zip(cases, results)}

    # the SlimPipe paper's layouts on 256 GPUs (t, c, p, d, slices, chunks)
    for tag, layout in {
        "64k": (8, 1, 4, 8, 4, 20),
        "128k": (8, 1, 8, 4, 8, 10),
        "256k": (4, 2, 8, 4, 16, 10),
        "512k": (4, 2, 16, 2, 32, 5),
    }.items():
        got = by_name[f"llama2-70b-slimpipe-{tag}.sbatch"]
        assert got["pp_schedule"] == "slimpipe-interleaved"
        assert got["seq_length"] == {"64k": 65536, "128k": 131072, "256k": 262144, "512k": 524288}[tag]
        assert (
            got["tensor_model_parallel_size"],
            got["context_parallel_size"],
            got["pipeline_model_parallel_size"],
            got["data_parallel_size"],
            got["pp_seq_slices"],
            got["virtual_pipeline_model_parallel_size"],
        ) == layout, tag
        assert got["pp_chunks"] == got["virtual_pipeline_model_parallel_size"]  # the two never disagree
        assert got["num_layers"] == 80 and got["mock_data"] and got["bf16"]
    for tag, layout in {"256k": (8, 1, 8, 4), "512k": (8, 1, 16, 2)}.items():
        got = by_name[f"{tag} TP8 CP1"]
        assert (
            got["tensor_model_parallel_size"],
            got["context_parallel_size"],
            got["pipeline_model_parallel_size"],
            got["data_parallel_size"],
        ) == layout
    for nodes in (1, 2, 4, 8):
        for cluster in ("hopper", "a100"):
            name = f"llama3-8b-zbh2-{cluster}.sbatch" + (f" x{nodes}" if nodes > 1 else "")
            got = by_name[name]
            assert got["pp_schedule"] == "zb-h2" and got["data_parallel_size"] == nodes, name
    gpt3 = by_name["gpt3-175b"]
    assert gpt3["position_embedding_type"] == "learned_absolute" and gpt3["max_position_embeddings"] == 2048
    assert not gpt3["untie_embeddings_and_output_weights"] and gpt3["add_bias_linear"]
    assert gpt3["normalization"] == "LayerNorm" and not gpt3["swiglu"]
    assert by_name["llama2-7b 32K v-zb"]["virtual_pipeline_model_parallel_size"] == 2  # V-shape: 2 chunks

    # NCCL's rules (schedule/nccl_check.py): every layout's schedule completes one step as the
    # runtime runs it (the step's messages in one global order, communicators warmed up front),
    # under all three rules; with each RECV right before its consumer and communicators created
    # at first use, the SlimPipe layouts with 2p slices would hang at their first step
    from megatron_pp_ext.schedule.lowering import insert_p2p
    from megatron_pp_ext.schedule.nccl_check import check_nccl

    checked = 0
    for name, got in by_name.items():
        # our deadline is Megatron's: a hung peer ends every wait at --distributed-timeout-minutes
        assert got["pp_p2p_timeout"] == 60 * got["distributed_timeout_minutes"], name
        schedule = layout_schedule(got)
        if schedule is not None:
            assert check_nccl(schedule, strict=True, warmed=True) is None, name
            checked += 1
    assert checked >= len(SCRIPTS)
    for tag in ("256k", "512k"):
        naive = insert_p2p(layout_schedule(by_name[f"llama2-70b-slimpipe-{tag}.sbatch"]))
        hang = check_nccl(naive, strict=False)
        assert hang is not None and "creating" in hang.message(), tag


def layout_schedule(got: dict):
    """The schedule a parsed pretrain_gpt.py command line runs (None without a pipeline)."""
    from megatron_pp_ext.schedule.generators import generate

    pp = got["pipeline_model_parallel_size"]
    if pp < 2:
        return None
    microbatches = got["global_batch_size"] // (got["micro_batch_size"] * got["data_parallel_size"])
    slices = got.get("pp_seq_slices") or 1
    return generate(got["pp_schedule"], pp, microbatches, vpp=got.get("pp_chunks"), slices=slices)


def test_the_harness_sees_megatrons_refusals(tmp_path: Path) -> None:
    """Not vacuous: an unknown flag, CUDA_DEVICE_MAX_CONNECTIONS missing with TP > 1, and a world
    size the layout does not divide are refused by Megatron in the same harness."""
    done = dry_run(SLURM / "llama3-8b-zbh2-hopper.sbatch", tmp_path, "--", "--no-such-megatron-flag")
    assert done.returncode == 0, done.stderr
    good = parse_dry_run(dry_run(SLURM / "llama3-8b-zbh2-hopper.sbatch", tmp_path).stdout)
    unknown = parse_dry_run(done.stdout)
    no_connections = {
        **good,
        "env": {k: v for k, v in good["env"].items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"},
    }
    odd_world = {**good, "world_size": 12}
    results = check_with_megatron([unknown, no_connections, odd_world, good], tmp_path)
    assert [r["ok"] for r in results] == [False, False, False, True], results
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in results[1]["error"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_dry_run_matches_the_sbatch_header_and_per_job_directories(script: Path, tmp_path: Path) -> None:
    done = dry_run(script, tmp_path)
    assert done.returncode == 0, done.stderr
    parsed = parse_dry_run(done.stdout)
    nodes = int(sbatch_header(script, "nodes"))
    assert parsed["world_size"] == nodes * int(sbatch_header(script, "gpus-per-node"))
    assert "--container-image" in " ".join(parsed["launcher"])  # pyxis by default
    argv = parsed["argv"]
    job_dir = tmp_path / "runs" / f"{script.stem}-dryrun"  # RUN_ROOT/<job name>-<job id>
    assert argv[argv.index("--save") + 1] == str(job_dir / "checkpoints")
    assert argv[argv.index("--tensorboard-dir") + 1] == str(job_dir / "tensorboard")
    assert str(job_dir / "logs") in " ".join(parsed["launcher"])
    assert parsed["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert {"NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= set(parsed["env"])
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_torchrun_fallback_takes_the_rendezvous_from_slurm(tmp_path: Path) -> None:
    env = {"CONTAINER_IMAGE": "none", "SLURM_JOB_ID": "4242", "NNODES": "2"}
    done = dry_run(SLURM / "llama3-8b-zbh2-hopper.sbatch", tmp_path, **env)
    assert done.returncode == 0, done.stderr
    launcher = parse_dry_run(done.stdout)["launcher"]
    assert launcher[:2] == ["srun", "--nodes=2"] and "--ntasks-per-node=1" in launcher
    assert "torchrun" in launcher and "--rdzv-id=4242" in launcher and "--rdzv-backend=c10d" in launcher
    assert any(token.startswith("--rdzv-endpoint=") for token in launcher)
    assert not any(token.startswith("--container-image") for token in launcher)


def test_real_data_and_tokenizer_override_mock_data(tmp_path: Path) -> None:
    env = {"DATA_PATH": "0.7 /data/a_text_document 0.3 /data/b_text_document", "TOKENIZER": "/models/llama3"}
    done = dry_run(SLURM / "llama3-8b-zbh2-hopper.sbatch", tmp_path, **env)
    assert done.returncode == 0, done.stderr
    argv = parse_dry_run(done.stdout)["argv"]
    assert "--mock-data" not in argv
    start = argv.index("--data-path") + 1
    assert argv[start : start + 4] == ["0.7", "/data/a_text_document", "0.3", "/data/b_text_document"]
    assert argv[argv.index("--tokenizer-model") + 1] == "/models/llama3"
    done = dry_run(SLURM / "llama3-8b-zbh2-hopper.sbatch", tmp_path, DATA_PATH="/data/a")
    assert done.returncode == 2 and "TOKENIZER" in done.stderr


@pytest.mark.parametrize(
    ("script", "env", "words"),
    [
        ("llama2-70b-slimpipe-64k.sbatch", {"GLOBAL_BATCH_SIZE": "12"}, "GLOBAL_BATCH_SIZE 12"),
        ("llama2-70b-slimpipe-64k.sbatch", {"NNODES": "3"}, "not a multiple of TP x PP x CP"),
        ("llama2-70b-slimpipe-64k.sbatch", {"PP_SEQ_SLICES": "3"}, "--pp-seq-slices"),
        ("llama2-70b-slimpipe-128k.sbatch", {"PP_CHUNKS": "1"}, "--pp-chunks"),
        ("llama2-70b-slimpipe-128k.sbatch", {"PP_SCHEDULE": "no-such"}, "--pp-schedule"),
        ("llama3-8b-zbh2-hopper.sbatch", {"CLUSTER": "volta"}, "CLUSTER must be hopper or a100"),
        ("launch.sh", {"CONFIG": "gpt3-175b", "SEQ_LENGTH": "4096"}, "learned position table of 2048"),
        ("launch.sh", {"CONFIG": "no-such-model"}, "no config 'no-such-model'"),
    ],
)
def test_bad_layouts_fail_before_the_job(
    script: str, env: dict[str, str], words: str, tmp_path: Path
) -> None:
    done = dry_run(SLURM / script, tmp_path, **env)
    assert done.returncode == 2, done.stdout[-2000:]
    assert words in done.stderr, done.stderr


def test_learned_positions_take_a_bigger_table_only_when_asked(tmp_path: Path) -> None:
    env = {"CONFIG": "gpt3-1.3b", "SEQ_LENGTH": "8192", "MAX_POSITION_EMBEDDINGS": "8192"}
    done = dry_run(SLURM / "launch.sh", tmp_path, **env)
    assert done.returncode == 0, done.stderr
    argv = parse_dry_run(done.stdout)["argv"]
    assert argv[argv.index("--max-position-embeddings") + 1] == "8192"


# ---- setup script and Dockerfile ------------------------------------------------------------------


def test_setup_script_pins_the_tag_megatron_core_is_pinned_to() -> None:
    script = (ROOT / "scripts" / "setup_megatron_lm.sh").read_text()
    tag = re.search(r"^MEGATRON_LM_TAG=\$\{MEGATRON_LM_TAG:-([^}]+)\}", script, re.M)
    assert tag and tag.group(1) == PIN_TAG
    version = tuple(int(part) for part in PIN_TAG.removeprefix("core_v").split("."))
    pins = re.findall(r'"megatron-core([^"]*)"', (ROOT / "setup.py").read_text())
    assert pins, "setup.py pins megatron-core"
    for pin in pins:  # e.g. ">=0.16,<0.17" or "==0.16.1": the tag's version satisfies it
        for op, bound in re.findall(r"(>=|<=|==|<|>|~=)\s*([\d.]+)", pin):
            b = tuple(int(part) for part in bound.split("."))
            padded = version[: len(b)] if op in ("==", "~=") else version
            assert {
                ">=": padded >= b,
                "<=": padded <= b,
                ">": padded > b,
                "<": padded < b,
                "==": padded == b,
                "~=": version[: len(b) - 1] == b[:-1] and version >= b,
            }[op], f"{PIN_TAG} does not satisfy megatron-core{pin}"
    assert (
        "patches/megatron-lm-${MEGATRON_LM_TAG}.patch" in script or f"megatron-lm-{PIN_TAG}.patch" in script
    )


def test_dockerfile_builds_with_the_setup_script() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile, re.M)
    assert base and base.group(1).startswith("nvcr.io/nvidia/pytorch:")  # NGC PyTorch
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", dockerfile, re.M)
    run_lines = " ".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    assert "scripts/setup_megatron_lm.sh" in run_lines
    assert "/opt/Megatron-LM" in run_lines  # where launch.sh's MEGATRON_LM points by default
    launch = (SLURM / "launch.sh").read_text()
    assert "MEGATRON_LM=${MEGATRON_LM:-/opt/Megatron-LM}" in launch
    assert re.search(r'^\s*PIP_CONSTRAINT=""', dockerfile, re.M)  # NGC's pins lifted, as Megatron-LM's images


def test_dockerfile_base_is_the_ngc_release_megatron_lm_builds_on() -> None:
    """Megatron-LM at the pinned tag names its NGC base in docker/.ngc_version.dev."""
    version_file = MEGATRON_LM / "docker" / ".ngc_version.dev"
    if not version_file.is_file():
        pytest.skip(f"no Megatron-LM tree at {MEGATRON_LM}")
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert base and base.group(1) == version_file.read_text().strip()


def test_dockerfile_is_valid_where_a_docker_daemon_runs() -> None:
    """`docker build --check` (BuildKit's checks, no build, no pull) where a daemon answers;
    skipped, saying so, where none does (this project's CI machines have none)."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client on this machine: the Dockerfile was not checked")
    if subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("no Docker daemon answers on this machine: the Dockerfile was not checked")
    done = subprocess.run(
        [docker, "build", "--check", str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_setup_script_applies_the_patch_to_a_checkout(tmp_path: Path) -> None:
    """On a copy of the Megatron-LM tree (no network): the patch applies when it exists, a
    missing patch is skipped with a message; the installs are dry (SETUP_PIP='echo pip')."""
    if not MEGATRON_LM.is_dir():
        pytest.skip(f"no Megatron-LM tree at {MEGATRON_LM}")
    checkout = tmp_path / "Megatron-LM"
    subprocess.run(["cp", "-r", str(MEGATRON_LM), str(checkout)], check=True)
    env = {**os.environ, "SETUP_PIP": "echo pip"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_megatron_lm.sh"), str(checkout)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    patch = ROOT / "patches" / f"megatron-lm-{PIN_TAG}.patch"
    if patch.is_file():
        assert "applied" in done.stdout
    else:
        assert "no patch" in done.stdout
    assert f"pip install -e {ROOT}" in done.stdout
    assert "six" in done.stdout and "regex" in done.stdout and "pydantic" in done.stdout
