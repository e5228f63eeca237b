"""The patch for Megatron-LM's pretrain_gpt.py, against the real tree at the pinned release.

``../shared/megatron-lm`` is Megatron-LM at tag core_v0.16.1 (the megatron-core pin). Each test
session copies it, applies ``patches/megatron-lm-core_v0.16.1.patch`` with ``git apply`` and runs
Megatron-LM's own code from the copy: its argument parser and validation with our flags, its
``get_model`` with the patched model provider (which stage each chunk holds), and its
``train_step`` driving our schedule on gloo (``megatron_lm_driver.py``, with the CPU shim it
documents). A V-shape zero-bubble schedule must give the losses and final weights of 1F1B.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from exactness import check, check_worst, training_tolerance
from runtime_case import rel_error

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "megatron-lm-core_v0.16.1.patch"
TREE = Path(os.environ.get("MEGATRON_LM_DIR", ROOT.parent / "shared" / "megatron-lm"))
DRIVER = Path(__file__).with_name("megatron_lm_driver.py")

pytestmark = pytest.mark.skipif(not TREE.is_dir(), reason=f"no Megatron-LM tree at {TREE}")

# A tiny Llama-style model that Megatron-LM builds on CPU: local spec, no fused kernels.
TINY = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 176 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 1 "
    "--global-batch-size 6 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 256 --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--normalization RMSNorm --swiglu --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--use-cpu-initialization --no-rope-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
    "--rerun-mode disabled --eval-interval 100 --eval-iters 1 --no-create-attention-mask-in-dataloader"
).split()
# The suite's tolerance (exactness.py) for TINY's two steps of 6 sequences of 32 tokens.
TINY_TOLERANCE = training_tolerance(
    SimpleNamespace(num_layers=8, hidden_size=64, ffn_hidden_size=176, seq_length=32, dtype="float32"),
    microbatches=6,
    steps=2,
    micro_batch=1,
)


def apply_patch(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", "--verbose", str(PATCH)], cwd=tree, capture_output=True, text=True, check=False
    )


TRAINING_DEPS = ("six", "regex", "pydantic", "triton")  # Megatron-LM's training package needs them


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for package in TRAINING_DEPS:
        pytest.importorskip(package, reason="Megatron-LM's training deps: pip install -e '.[megatron-lm]'")
    return make_patched_tree(tmp_path_factory.mktemp("megatron-lm") / "megatron-lm")


def make_patched_tree(tree: Path) -> Path:
    """Megatron-LM copied to ``tree`` with the patch applied."""
    shutil.copytree(TREE, tree)
    result = apply_patch(tree)
    assert result.returncode == 0, result.stderr
    # The dataset index helpers: Megatron compiles them with the system python3's suffix; the
    # installed megatron-core (same release) has them built for this interpreter.
    import megatron.core.datasets as installed

    helpers = list(Path(installed.__file__).parent.glob("helpers_cpp*"))
    assert helpers, "the installed megatron-core has no built helpers_cpp module"
    for built in helpers:
        shutil.copy(built, tree / "megatron" / "core" / "datasets" / built.name)
    return tree


def run_driver(tree: Path, tmp_path: Path, mode: str, nproc: int, flags: list[str]) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tree)]), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(_free_port()), str(DRIVER), mode, str(out), "--", *TINY, *flags,
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_patch_is_small_and_applies_cleanly(tmp_path: Path) -> None:
    tree = tmp_path / "megatron-lm"
    shutil.copytree(TREE, tree, ignore=shutil.ignore_patterns("megatron", "examples", "tools", "tasks"))
    check = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=tree, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    changed = [
        line for line in PATCH.read_text().splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert len(changed) <= 16, "the patch only calls the plugin; its logic belongs in megatron_pp_ext"
    assert all("pp_ext" in line or line.startswith("-") for line in changed if line.startswith("+"))


PARSE = """
import contextlib, io, json, os, sys
sys.path[:0] = [{tree!r}]
os.environ.setdefault("WORLD_SIZE", "4")
from megatron.training import arguments
from megatron.training.arguments import parse_args, validate_args
from megatron_pp_ext.megatron import pretrain as pp_ext
arguments.get_device_arch_version = lambda: 10  # asks torch.cuda under TP/CP > 1 (driver's shim 7)
outcomes = []
for argv in json.loads({cases!r}):
    sys.argv = ["pretrain_gpt.py", *argv]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_args(pp_ext.extra_args_provider())
        validate_args(args, {{}})
        pp_ext.check_args(args)
        outcomes.append({{"ok": True, "vp": args.virtual_pipeline_model_parallel_size}})
    except SystemExit as error:  # the parser's error (our checks run there): the usage, then one line
        last = stderr.getvalue().splitlines()[-1]
        outcomes.append({{"ok": False, "error": f"exit {{error.code}}: {{last}}"}})
    except BaseException as error:
        outcomes.append({{"ok": False, "error": f"{{type(error).__name__}}: {{error}}"}})
print(json.dumps(outcomes))
"""

PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
VP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
V_ZB = ["--pp-schedule", "v-zb"]
TIED = [flag for flag in TINY if flag != "--untie-embeddings-and-output-weights"]
CP2 = ["--context-parallel-size", "2"]
TP2_PP2 = [*PP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
SEQ30 = [*TINY, "--seq-length", "30"]  # not 2 x CP pieces of equal length
MASK = [flag for flag in TINY if flag != "--no-create-attention-mask-in-dataloader"]

# (command line, None if Megatron's parser and our checks accept it, else a piece of the error)
CASES = [
    ([*TINY, *PP4, "--pp-schedule", "zb-h1"], None),
    ([*TINY, *PP4, *V_ZB, *VP2], None),
    ([*TINY, *PP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "4"], None),
    ([*TINY, *PP4, *V_ZB, VP2[0], "3"], "--num-virtual-stages-per-pipeline-rank"),
    ([*TINY, *PP4, "--pp-schedule", "interleaved-1f1b", "--pp-chunks", "2", VP2[0], "4"], "disagree"),
    # B/W split on the TE spec: TE's deferred weight gradient (checked against TE's version where
    # TE imports, test_te_wgrad.py; here, without TE, Megatron's own checks decide)
    ([*TINY, *PP4, "--pp-schedule", "zb-h1", "--transformer-impl", "transformer_engine"], None),
    ([*TINY, *PP4, *V_ZB, *VP2, "--transformer-impl", "transformer_engine"], None),
    ([*TINY, *PP4, "--pp-schedule", "1f1b", "--cpu-offloading-num-layers", "1"], "--pp-offload"),
    ([*TINY, *PP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "5"], "--pp-seq-slices"),
    ([*TIED, *PP4, *V_ZB, *VP2], "--untie-embeddings-and-output-weights"),
    ([*TINY, *PP4, "--pp-schedule", "no-such-schedule"], "--pp-schedule"),
    ([*TINY, *PP2, *CP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "2"], None),
    ([*TINY, *PP2, *CP2, "--pp-schedule", "zb-h1"], None),
    ([*SEQ30, *PP2, *CP2, "--pp-schedule", "1f1b"], "multiple of 2 * context-parallel-size"),  # Megatron's
    ([*MASK, *PP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "2"], "--no-create-attention-mask"),
    ([*TINY, *PP2, "--pp-schedule", "1f1b", "--pp-vocab-parallel", "vocab-1"], None),
    ([*TIED, *PP2, "--pp-schedule", "1f1b", "--pp-vocab-parallel", "vocab-1"], "--untie-embeddings"),
    ([*TINY, *PP2, *CP2, "--pp-schedule", "1f1b", "--pp-vocab-parallel", "vocab-2"], None),  # as train
    (
        [*TINY, *PP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "2", "--pp-vocab-parallel", "vocab-1"],
        "--calculate-per-token-loss",
    ),
]


# -- one table, both entry points: the same flags after the same model, given to train and to
# pretrain_gpt.py (WORLD_SIZE 4, global batch 6), are accepted by both or refused by both naming
# the same flag. The rules live once (PipelineOptions in megatron/hook.py); this shows it.
TRAIN_MODEL = [  # TINY as train gives it: Megatron-LM's model flags over the tiny-llama config
    "--config", "tiny-llama", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "176", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "6",
    "--train-iters", "2", "--lr", "1e-3", "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip
P2, P4 = "--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 4"
SLICED2 = f"{P2} --pp-schedule seq1f1b --pp-seq-slices 2"
# (flags after the model, None if both accept them, else the flag both name)
BOTH: list[tuple[str, str | None]] = [
    (f"{P4} --pp-schedule zb-h1", None),
    (f"{P4} --pp-schedule v-zb", None),  # Megatron builds the 2 chunks
    (f"{P4} --pp-schedule v-zb --num-virtual-stages-per-pipeline-rank 2", None),
    (f"{P4} --pp-schedule dualpipev --pp-chunks 3", "--pp-chunks"),
    (
        f"{P4} --pp-schedule v-zb --num-virtual-stages-per-pipeline-rank 3",
        "--num-virtual-stages-per-pipeline-rank",
    ),
    (f"{P4} --pp-schedule v-half --pp-chunks 2", None),
    (f"{P2} --pp-schedule interleaved-1f1b --pp-chunks 2", None),
    (
        f"{P2} --pp-schedule interleaved-1f1b --pp-chunks 2 --num-virtual-stages-per-pipeline-rank 4",
        "--num-virtual-stages-per-pipeline-rank",
    ),
    (f"{P2} --pp-chunks 0", "--pp-chunks"),
    (f"{P4} --pp-schedule no-such", "--pp-schedule"),
    (SLICED2, None),
    (f"{P2} --pp-schedule seq1f1b --pp-seq-slices 5", "--pp-seq-slices"),
    (f"{P2} --pp-schedule slimpipe-interleaved --pp-chunks 2", "--pp-seq-slices"),
    (f"{P2} --pp-seq-slices 0", "--pp-seq-slices"),
    (f"{SLICED2} --pp-vocab-parallel vocab-1", "--pp-vocab-parallel"),
    (f"{SLICED2} --pp-vocab-parallel vocab-1 --calculate-per-token-loss", None),
    (f"{P2} --pp-vocab-parallel vocab-2", None),
    (f"{P2} --context-parallel-size 2 --pp-vocab-parallel vocab-2", None),
    (f"{SLICED2} --context-parallel-size 2", None),
    (f"{SLICED2} --tensor-model-parallel-size 2 --sequence-parallel", None),
    (f"{P2} --pp-attn-redistribution 0.5", "--pp-attn-redistribution"),
    (
        f"{P2} --pp-schedule slimpipe --pp-seq-slices 4 --pp-attn-redistribution 2",
        "--pp-attn-redistribution",
    ),
    (f"{P2} --pp-schedule slimpipe --pp-seq-slices 4 --pp-attn-redistribution 0.5", None),
    (f"{P2} --pp-zb-costs 1,x", "--pp-zb-costs"),
    (f"{P2} --pp-schedule zb-auto --pp-memory-limit 0", "--pp-memory-limit"),
    (f"{P4} --pp-offload full", None),
    (f"{P4} --pp-offload selective --pp-offload-chunks 3", "--pp-offload-chunks"),
    (f"{P4} --pp-offload full --pp-offload-lookahead -1", "--pp-offload-lookahead"),
    (f"{P2} --pp-schedule slimpipe --pp-seq-slices 4 --pp-emulate-nccl", None),
    # Megatron's layer-split flags; a layout sets the model chunks per rank
    (f"{P4} --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1", None),
    (f"{P2} --pp-schedule interleaved-1f1b --pipeline-model-parallel-layout Ettt|t|tt|ttL", None),
    (f"{P4} --pp-schedule interleaved-1f1b --pipeline-model-parallel-layout Et|t*2|t|t|t|t|t|L", None),
    # splits megatron-core refuses only when it builds the model: refused before any process starts
    (f"{P2} --pipeline-model-parallel-layout Ettt|ttL", "--pipeline-model-parallel-layout"),
    (f"{P4} --decoder-first-pipeline-num-layers 3", "--decoder-first-pipeline-num-layers"),
]


def train_outcome(flags: str, capsys: pytest.CaptureFixture) -> tuple[str | None, int]:
    """``megatron-pp-ext train`` with ``flags`` after :data:`TRAIN_MODEL` (as under a launcher of
    4 processes): (None, the model chunks per rank it runs), or (its error line, 0)."""
    from megatron_pp_ext.commands.train import UsageError, settings_from_argv

    try:
        settings = settings_from_argv([*TRAIN_MODEL, *flags.split()], world_size=WORLD_SIZE)
    except UsageError as error:
        return str(error), 0
    except SystemExit:  # argparse's own refusal (a choice, a type): its last line
        return last_line(capsys.readouterr().err), 0
    schedule = settings.pipeline.schedule_for(settings.pp, settings.microbatches)
    return None, schedule.num_stages // settings.pp


@pytest.mark.parametrize("case", range(len(BOTH)), ids=[flags for flags, _ in BOTH])
def test_train_and_pretrain_gpt_agree_on_every_row(
    parsed: list[dict], case: int, capsys: pytest.CaptureFixture
) -> None:
    """Both accept (and Megatron builds the model chunks train runs), or both refuse naming the flag."""
    flags, flag = BOTH[case]
    megatron = parsed[len(CASES) + case]
    error, chunks = train_outcome(flags, capsys)
    if flag is None:
        assert megatron["ok"] and error is None, (megatron, error)
        assert (megatron["vp"] or 1) == chunks, (megatron, chunks)
    else:
        assert not megatron["ok"] and flag in megatron["error"], megatron
        assert error is not None and flag in error, error


def test_train_takes_the_model_flags_as_megatron_lm_reads_them() -> None:
    """Megatron-LM's model flags mean the same model in train: the shape, GQA's groups (none
    without --group-query-attention, one with it and no count), and the learning-rate schedule."""
    from megatron_pp_ext.commands.train import UsageError, settings_from_argv

    settings = settings_from_argv([*TRAIN_MODEL, "--min-lr", "1e-5", "--lr-warmup-iters", "1"], world_size=4)
    shape = ("num_layers", "hidden_size", "num_kv_heads", "seq_length")
    assert [settings.model[key] for key in shape] == [8, 64, 2, 32]
    assert (settings.min_lr, settings.warmup, settings.microbatches) == (1e-5, 1, 6)
    at = TRAIN_MODEL.index("--group-query-attention")
    assert TRAIN_MODEL[at : at + 3] == ["--group-query-attention", "--num-query-groups", "2"]
    plain, grouped = TRAIN_MODEL[:at] + TRAIN_MODEL[at + 3 :], TRAIN_MODEL[: at + 1] + TRAIN_MODEL[at + 3 :]
    assert settings_from_argv(plain, world_size=4).model["num_kv_heads"] == 4
    assert settings_from_argv(grouped, world_size=4).model["num_kv_heads"] == 1
    for bad, flag in (
        (["--num-query-groups", "2"], "--num-query-groups"),
        (["--normalization", "LayerNorm"], "--normalization"),
        (["--position-embedding-type", "learned_absolute"], "--position-embedding-type"),
        (["--hidden-dropout", "0.1"], "--hidden-dropout"),
    ):
        with pytest.raises(UsageError) as error:
            settings_from_argv(["--num-attention-heads", "4", *bad])
        assert error.value.flag == flag and flag in str(error.value), error.value


@pytest.fixture(scope="module")
def parsed(patched_tree: Path) -> list[dict]:
    """Megatron-LM's parse_args + validate_args with our flags, then our checks, for every case
    (:data:`CASES`, then :data:`BOTH` after TINY) in one fresh process (importing Megatron-LM's
    training package takes seconds)."""
    lines = [argv for argv, _ in CASES] + [[*TINY, *flags.split()] for flags, _ in BOTH]
    code = PARSE.format(tree=str(patched_tree), cases=json.dumps(lines))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_megatron_parser_takes_our_flags(parsed: list[dict], case: int) -> None:
    outcome, expect = parsed[case], CASES[case][1]
    if expect is None:
        assert outcome["ok"], outcome
    else:
        assert not outcome["ok"] and expect in outcome["error"], outcome


# -- a bad pretrain_gpt.py command line: exit status 2 and one last line naming the flag -------------

# What each command line runs: pretrain_gpt.py's own module (the patched script, imported: its
# extra_args_provider expression) and Megatron-LM's parse_args, as pretrain() does first, in a
# process of its own with WORLD_SIZE set as torchrun sets it (forked from one that imported
# Megatron-LM's training package once: seconds); then validate_args and, for a line the parser
# passes, our checks, or with ``late`` set (attributes the parser did not see, as
# --use-checkpoint-args or --yaml-cfg bring them) the patched model provider's first call.
RUN_LINES = """
import json, os, sys, tempfile, traceback
sys.path[:0] = [{tree!r}]
import pretrain_gpt
from megatron.training import arguments, global_vars
results = []
for argv, late in json.loads({cases!r}):
    with tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                os.dup2(err.fileno(), 2)
                os.environ["WORLD_SIZE"] = "{world}"
                sys.argv = ["pretrain_gpt.py", *argv]
                modelopt = pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None
                args = arguments.parse_args(pretrain_gpt.pp_ext.extra_args_provider(modelopt))
                arguments.validate_args(args, {{}})
                if late is None:
                    pretrain_gpt.pp_ext.check_args(args)
                else:
                    vars(args).update(late)
                    global_vars.set_args(args)
                    pretrain_gpt.pp_ext.placed_model_provider(None)()
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        results.append([os.waitstatus_to_exitcode(status), err.read()])
print(json.dumps(results))
"""
WORLD_SIZE = 4  # torchrun --nproc-per-node 4

# (pretrain_gpt.py flags after TIED, shown as <tiny>; the flag the last stderr line must name)
BAD_LINES: list[tuple[str, str]] = [
    ("--pipeline-model-parallel-size 4 --pp-schedule no-such", "--pp-schedule"),
    ("--pipeline-model-parallel-size 2 --pp-seq-slices 0", "--pp-seq-slices"),
    ("--pipeline-model-parallel-size 2 --pp-schedule seq1f1b --pp-seq-slices 5", "--pp-seq-slices"),
    (
        "--pipeline-model-parallel-size 2 --pp-schedule slimpipe-interleaved "
        "--num-virtual-stages-per-pipeline-rank 2",
        "--pp-seq-slices",
    ),
    (
        "--pipeline-model-parallel-size 4 --pp-schedule v-zb --num-virtual-stages-per-pipeline-rank 3",
        "--num-virtual-stages-per-pipeline-rank",
    ),
    (
        "--pipeline-model-parallel-size 4 --pp-schedule v-zb --num-virtual-stages-per-pipeline-rank 2",
        "--untie-embeddings-and-output-weights",
    ),
    (
        "--pipeline-model-parallel-size 2 --pp-schedule interleaved-1f1b --pp-chunks 2 "
        "--num-virtual-stages-per-pipeline-rank 4",
        "--num-virtual-stages-per-pipeline-rank",
    ),
    ("--pipeline-model-parallel-size 2 --pp-chunks 0", "--pp-chunks"),
    ("--pipeline-model-parallel-size 2 --pp-vocab-parallel vocab-1", "--pp-vocab-parallel"),
    (
        "--pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights --pp-schedule seq1f1b "
        "--pp-seq-slices 2 --pp-vocab-parallel vocab-1",
        "--pp-vocab-parallel",
    ),
    ("--pipeline-model-parallel-size 2 --pp-offload bogus", "--pp-offload"),
    ("--pipeline-model-parallel-size 2 --pp-attn-redistribution 0.5", "--pp-attn-redistribution"),
    (
        "--pipeline-model-parallel-size 2 --pp-schedule slimpipe --pp-seq-slices 4 "
        "--pp-attn-redistribution 2",
        "--pp-attn-redistribution",
    ),
    ("--pipeline-model-parallel-size 2 --pp-zb-costs 1,x", "--pp-zb-costs"),
    ("--pipeline-model-parallel-size 2 --cpu-offloading-num-layers 1", "--cpu-offloading"),
    ("--pipeline-model-parallel-size 2 --pp-timeline t.json --profile-step-end 2", "--profile-step-end"),
    (
        "--pipeline-model-parallel-size 2 --pp-schedule interleaved-1f1b --pp-chunks 2 "
        "--num-experts 4 --overlap-moe-expert-parallel-comm",
        "--overlap-moe-expert-parallel-comm",
    ),
]
GOOD_LINE = "--pipeline-model-parallel-size 4 --pp-schedule zb-h1"
# Passes the parser; attributes that come later (a checkpoint's, say) make the schedule impossible.
LATE = ("--pipeline-model-parallel-size 2", {"pp_schedule": "seq1f1b", "pp_seq_slices": 5})


def run_pretrain_lines(tree: Path, lines: list[tuple[str, dict | None]]) -> list[tuple[int, str]]:
    """(exit status, stderr) of each ``(flags after <tiny>, late)`` line: see :data:`RUN_LINES`."""
    cases = json.dumps([([*TIED, *flags.split()], late) for flags, late in lines])
    code = RUN_LINES.format(tree=str(tree), cases=cases, world=WORLD_SIZE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [(status, stderr) for status, stderr in json.loads(result.stdout.strip().splitlines()[-1])]


def last_line(stderr: str) -> str:
    return (stderr.strip().splitlines() or [""])[-1]


@pytest.fixture(scope="module")
def pretrain_lines(patched_tree: Path) -> list[tuple[int, str]]:
    """:data:`BAD_LINES`, then :data:`GOOD_LINE`, then :data:`LATE`."""
    lines = [(flags, None) for flags, _ in BAD_LINES] + [(GOOD_LINE, None), LATE]
    return run_pretrain_lines(patched_tree, lines)


@pytest.mark.parametrize("case", range(len(BAD_LINES)), ids=[flags for flags, _ in BAD_LINES])
def test_bad_pretrain_gpt_line_exits_2_with_one_line_naming_the_flag(
    pretrain_lines: list[tuple[int, str]], case: int
) -> None:
    """Refused by Megatron-LM's parser (our checks run there) before torch.distributed starts:
    argparse's usage, then ``pretrain_gpt.py: error: --flag: ...``; no traceback."""
    status, stderr = pretrain_lines[case]
    flag = BAD_LINES[case][1]
    last = last_line(stderr)
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert last.startswith("pretrain_gpt.py: error: ") and flag in last, last
    assert "usage: pretrain_gpt.py" in stderr


def test_megatron_parser_passes_a_good_pretrain_gpt_line(pretrain_lines: list[tuple[int, str]]) -> None:
    status, stderr = pretrain_lines[len(BAD_LINES)]
    assert status == 0, stderr[-3000:]


def test_bad_arguments_the_parser_did_not_see_end_in_one_line_at_model_build(
    pretrain_lines: list[tuple[int, str]],
) -> None:
    """What only the model provider sees (arguments changed after parsing) ends there: one line,
    exit status 2, no traceback (torch.distributed is up: ``os._exit``, no teardown noise)."""
    status, stderr = pretrain_lines[-1]
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert last_line(stderr).startswith("pretrain_gpt.py: error: --pp-seq-slices: "), stderr[-3000:]
    assert "usage:" not in stderr


def test_get_model_builds_the_schedules_stages(patched_tree: Path, tmp_path: Path) -> None:
    """V-shape: rank 0 holds stage 0 (embedding) and stage 3 (output layer), rank 1 stages 1, 2,
    with Megatron's global layer numbers (so checkpoints store layers in model order)."""
    flags = [
        "--pipeline-model-parallel-size",
        "2",
        "--pp-schedule",
        "v-zb",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
    ]
    ranks = run_driver(patched_tree, tmp_path, "chunks", 2, flags)
    chunks = [
        [(c["pre"], c["post"], c["embedding"], c["output_layer"], c["layers"]) for c in r["chunks"]]
        for r in ranks
    ]
    assert chunks == [
        [(True, False, True, False, [1, 2]), (False, True, False, True, [7, 8])],
        [(False, False, False, False, [3, 4]), (False, False, False, False, [5, 6])],
    ]
    # What Megatron-LM's save_checkpoint writes (each chunk's sharded_state_dict): the same global
    # tensors, offsets and shapes as under 1F1B's placement, so checkpoints move between schedules.
    one_f_one_b = run_driver(patched_tree, tmp_path, "chunks", 2, PP2)

    def saved(run: list[dict]) -> list[tuple]:
        found = [
            (key, tuple(offset), tuple(shape))
            for r in run
            for c in r["chunks"]
            for key, offset, shape in c["sharded"]
        ]
        assert len(found) == len(set(found)), "a tensor is saved twice"
        return sorted(found)

    v_saved = saved(ranks)
    assert ("output_layer.weight", (0, 0), (384, 64)) in v_saved
    assert ("decoder.layers.self_attention.linear_qkv.weight", (7, 0, 0), (8, 128, 64)) in v_saved
    assert v_saved == saved(one_f_one_b)


@pytest.fixture(scope="module")
def one_f_one_b(patched_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Megatron-LM's train_step with 1F1B on 2 pipeline ranks: the run the others must equal."""
    return run_driver(patched_tree, tmp_path_factory.mktemp("one_f_one_b"), "train", 2, PP2)


def assert_same_training(
    run: list[dict], reference: list[dict], tolerance: float | None = None, same_sums: bool = True
) -> None:
    """The losses Megatron's train_step reports on the last pipeline rank, and every final weight by
    global name, gathered over all ranks.

    ``same_sums``: both runs add the same numbers in the same order (only the schedule differs),
    so losses and every weight element agree within ``tolerance`` (of the largest weight).
    Otherwise (attention over CP ranks, slices, TP shards) float32 rounding differs: then the
    losses and every weight tensor, relative to its norm, agree within the suite's rule for TINY's
    two steps (``exactness.py``). An element-wise check would not hold there: Adam turns the
    rounding of a gradient element near zero into a visible fraction of its step."""
    ours = [item["lm loss"] for item in run[-1]["losses"]]
    theirs = [item["lm loss"] for item in reference[-1]["losses"]]
    assert len(ours) == 2 and ours[0] != ours[1], "the first step changed nothing"
    weights = {k: v for rank in run for k, v in rank["weights"].items()}
    expected = {k: v for rank in reference for k, v in rank["weights"].items()}
    assert weights.keys() == expected.keys() and len(weights) > 20
    import torch

    if same_sums:
        assert tolerance is not None
        assert ours == pytest.approx(theirs, rel=tolerance, abs=0)
        errors = torch.cat(
            [(torch.tensor(weights[k]) - torch.tensor(expected[k])).abs().flatten() for k in weights]
        )
        moved = max(float(torch.tensor(v).abs().max()) for v in weights.values())
        assert float(errors.max()) <= tolerance * moved, float(errors.max())
        return
    for step, (got, want) in enumerate(zip(ours, theirs)):
        check(abs(got - want) / abs(want), TINY_TOLERANCE, f"step {step + 1} loss")
    errors = {k: rel_error(torch.tensor(weights[k]), torch.tensor(expected[k])) for k in weights}
    check_worst(errors, TINY_TOLERANCE, "after 2 steps, weight")


@pytest.mark.slow
def test_train_step_v_shape_equals_1f1b(patched_tree: Path, tmp_path: Path, one_f_one_b: list[dict]) -> None:
    """Megatron-LM's train_step over the patched pretrain_gpt.py: v-zb (V placement, B/W split,
    losses computed on rank 0 and handed to rank 1 where Megatron reads them) gives 1F1B's losses
    and final weights, two optimizer steps, same initial weights by global name. No
    --num-virtual-stages-per-pipeline-rank: Megatron builds the two chunks v-zb runs, as train."""
    timeline = tmp_path / "timeline.json"  # and --pp-timeline over its first step, through the hook
    window = ["--pp-timeline", str(timeline), "--profile-step-start", "0", "--profile-step-end", "1"]
    v_shape = run_driver(patched_tree, tmp_path, "train", 2, [*PP2, *V_ZB, *window])
    assert v_shape[0]["losses"] == [{}, {}], "rank 0 is not Megatron's last pipeline rank: no losses there"
    assert_same_training(v_shape, one_f_one_b, 1e-6)
    tracks = {
        e["args"]["name"]
        for e in json.loads(timeline.read_text())["traceEvents"]
        if e.get("name") == "process_name"
    }
    assert tracks == {f"{what} rank {r}" for what in ("measured", "predicted") for r in (0, 1)}
    assert timeline.with_suffix(".png").is_file()


@pytest.mark.slow
@pytest.mark.heavy
def test_train_step_context_parallel_slices_equal_1f1b(
    patched_tree: Path, tmp_path: Path, one_f_one_b: list[dict]
) -> None:
    """CP2 x PP2 with Seq1F1B (2 slices): Megatron-LM's get_batch cuts each slice the runtime
    hands it into Megatron's two load-balanced pieces per CP rank, our sliced attention gathers
    K/V over CP, Megatron's DDP averages over DP x CP: 1F1B's losses and weights at CP 1."""
    flags = [*PP2, *CP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "2"]
    run = run_driver(patched_tree, tmp_path, "train", 4, flags)
    assert [rank["losses"] == [{}, {}] for rank in run] == [True, True, False, False]  # pp rank 1 reports
    assert run[2]["losses"] == run[3]["losses"], "the CP ranks of the last stage report one loss"
    assert_same_training(run, one_f_one_b, same_sums=False)  # CP ranks hold the same weights


@pytest.mark.slow
def test_train_step_vocab_parallel_with_context_parallelism_equals_1f1b(
    patched_tree: Path, tmp_path: Path, one_f_one_b: list[dict]
) -> None:
    """CP2 x PP2, V-Half with --pp-vocab-parallel vocab-2, through Megatron-LM's get_model and
    train_step: each CP rank embeds, and runs S and T on, its two pieces of every sequence, as
    ``train`` does (tests/test_vocab_parallel_exact.py); 1F1B's losses and weights at CP 1."""
    flags = [*PP2, *CP2, *VP2, "--pp-schedule", "v-half", "--pp-vocab-parallel", "vocab-2"]
    run = run_driver(patched_tree, tmp_path, "train", 4, flags)
    assert_same_training(run, one_f_one_b, same_sums=False)


# Mixture of experts: 4 experts, top-2, load-balancing loss, split over 2 ranks of each stage
# (EP 2 x DP 2 x PP 2 on 4 processes); 4 microbatches per data-parallel rank
MOE_EP2 = [
    *PP2, "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
    "--expert-model-parallel-size", "2", "--global-batch-size", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def moe_one_f_one_b(patched_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Megatron-LM's train_step with megatron-core's own 1F1B on the MoE model (no --pp-schedule)."""
    return run_driver(patched_tree, tmp_path_factory.mktemp("moe_one_f_one_b"), "train", 4, MOE_EP2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipev", pytest.param("zb-h1", marks=pytest.mark.heavy)])
def test_train_step_moe_with_expert_parallelism_equals_megatron_s_1f1b(
    patched_tree: Path, tmp_path: Path, moe_one_f_one_b: list[dict], schedule: str
) -> None:
    """Our schedule through pretrain_gpt.py on an MoE model with expert parallelism gives
    megatron-core's own 1F1B losses and final weights, routers included (the MoE loss scale is
    set as megatron-core's schedules set it; before, the routers' auxiliary-loss gradients were
    m times theirs)."""
    run = run_driver(patched_tree, tmp_path, "train", 4, [*MOE_EP2, "--pp-schedule", schedule])
    assert any(".router." in name for rank in run for name in rank["weights"])
    assert_same_training(run, moe_one_f_one_b, 1e-6)


@pytest.mark.slow
def test_train_step_moe_overlapped_pairs_equal_unpaired(patched_tree: Path, tmp_path: Path) -> None:
    """Megatron's ``--overlap-moe-expert-parallel-comm`` with our DualPipeV through pretrain_gpt.py
    (alltoall dispatcher, EP 2; bf16, as megatron-core's config requires for the flag): its F&B
    pairs run through megatron-core's schedule plan and Megatron-LM's forward_step with
    ``return_schedule_plan``; the losses and final weights are the unpaired run's."""
    flags = [*MOE_EP2, "--moe-token-dispatcher-type", "alltoall", "--pp-schedule", "dualpipev", "--bf16"]
    unpaired = run_driver(patched_tree, tmp_path / "unpaired", "train", 4, flags)
    paired = run_driver(
        patched_tree, tmp_path / "paired", "train", 4, [*flags, "--overlap-moe-expert-parallel-comm"]
    )
    assert_same_training(paired, unpaired, 1e-6)


@pytest.fixture(scope="module")
def tp2_one_f_one_b(patched_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Megatron-LM's train_step with 1F1B on TP2 (sequence parallel) x PP2."""
    return run_driver(patched_tree, tmp_path_factory.mktemp("tp2_one_f_one_b"), "train", 4, TP2_PP2)


@pytest.mark.slow
@pytest.mark.heavy
def test_train_step_tensor_parallel_slices_equal_1f1b(
    patched_tree: Path, tmp_path: Path, tp2_one_f_one_b: list[dict]
) -> None:
    """TP2 (sequence parallel) x PP2 with Seq1F1B (2 slices): Megatron's get_batch broadcasts
    each slice over TP into buffers sized to the running slice; the losses and weights of 1F1B
    with the same TP2 shards."""
    sliced = run_driver(
        patched_tree, tmp_path, "train", 4, [*TP2_PP2, "--pp-schedule", "seq1f1b", "--pp-seq-slices", "2"]
    )
    whole = tp2_one_f_one_b
    assert any(name.endswith("@tp1") for name in sliced[-1]["weights"]), "no tensor-parallel shards"
    assert_same_training(sliced, whole, same_sums=False)


@pytest.fixture(scope="module")
def v_half_vocab_saved(
    patched_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict], Path]:
    """2 train steps of V-Half with --pp-vocab-parallel vocab-2 on PP2, then Megatron-LM's own
    save_checkpoint (model only: the optimizer is the driver's shim): the run and its checkpoint."""
    root = tmp_path_factory.mktemp("v_half_vocab")
    checkpoint = root / "checkpoint"
    run = run_driver(
        patched_tree,
        root,
        "save",
        2,
        [
            *PP2, *VP2, "--pp-schedule", "v-half", "--pp-vocab-parallel", "vocab-2",
            "--save", str(checkpoint), "--save-interval", "100",
            "--no-save-optim", "--no-save-rng", "--no-ckpt-fully-parallel-save",
        ],
    )  # fmt: skip
    return run, checkpoint


@pytest.mark.slow
def test_train_step_vocab_parallel_equals_1f1b(
    v_half_vocab_saved: tuple[list[dict], Path], one_f_one_b: list[dict]
) -> None:
    """--pp-vocab-parallel vocab-2 under V-Half through Megatron-LM's get_model and train_step:
    the model provider puts each rank's shard of Megatron's padded vocabulary (384 rows, 192 per
    rank) on chunk 0 before DDP, the runtime runs S/T and their collectives; 1F1B's losses and
    weights (the shards gathered into the embedding and output tables)."""
    run, _ = v_half_vocab_saved

    def saved(ranks: list[dict]) -> dict[str, set]:
        """What Megatron-LM's save_checkpoint writes: key -> {(global offset, global shape)}."""
        found: dict[str, set] = {}
        for rank in ranks:
            for chunk in rank["chunks"]:
                for key, offset, shape in chunk["sharded"]:
                    found.setdefault(key, set()).add((tuple(offset), tuple(shape)))
        return found

    ours, theirs = saved(run), saved(one_f_one_b)
    assert ours.keys() == theirs.keys()  # the shards write Megatron's own tables
    for table in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert theirs[table] == {((0, 0), (384, 64))}
        assert ours[table] == {((0, 0), (384, 64)), ((192, 0), (384, 64))}  # rank r: rows from 192 r
    # the cross-entropy is computed in pieces: float rounding differs from the unsplit run
    assert_same_training(run, one_f_one_b, same_sums=False)


@pytest.mark.slow
@pytest.mark.heavy
def test_train_step_vocab_parallel_with_tensor_parallelism(
    patched_tree: Path, tmp_path: Path, tp2_one_f_one_b: list[dict]
) -> None:
    """TP2 (sequence parallel) x PP2, vocab-1 under 1F1B through Megatron-LM's train_step: each
    (pipeline, tensor) rank holds 96 of the 384 rows, the embedding output is reduce-scattered
    over TP as Megatron's embedding does under SP, and TP ranks > 0 read the tokens BCAST_IDS
    needs from their own data iterator (Megatron's get_batch broadcasts from TP rank 0); the
    losses and weights of the same TP2 layout without vocabulary parallelism."""
    flags = [*TP2_PP2, "--pp-schedule", "1f1b", "--pp-vocab-parallel", "vocab-1"]
    split = run_driver(patched_tree, tmp_path, "train", 4, flags)
    assert any(name.endswith("@tp1") for name in split[-1]["weights"]), "no tensor-parallel shards"
    assert_same_training(split, tp2_one_f_one_b, same_sums=False)


@pytest.mark.slow
def test_megatron_save_checkpoint_loads_under_another_schedule(
    patched_tree: Path, tmp_path: Path, v_half_vocab_saved: tuple[list[dict], Path]
) -> None:
    """Megatron-LM's own save_checkpoint and load_checkpoint (torch_dist) with our placement:
    saved after 2 train steps under V-Half with vocabulary parallelism (V placement, chunk 1 of
    rank r holding stage 2p-1-r; the shards writing rows of Megatron's tables), loaded under 1F1B
    without vocabulary parallelism: every weight bitwise the saved one (the loading run starts
    from Megatron's own initialisation, so nothing matches unless it was loaded)."""
    saved, checkpoint = v_half_vocab_saved
    assert (checkpoint / "iter_0000002").is_dir()
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    loaded = run_driver(
        patched_tree,
        tmp_path,
        "load",
        2,
        [*PP2, "--pp-schedule", "1f1b", "--load", str(checkpoint), "--ckpt-step", "2"]
        + ["--no-load-optim", "--no-load-rng"],
    )
    weights = {k: v for rank in saved for k, v in rank["weights"].items()}
    again = {k: v for rank in loaded for k, v in rank["weights"].items()}
    assert weights.keys() == again.keys() and "output_layer.weight@tp0" in weights
    for name, value in weights.items():
        assert again[name] == value, name
