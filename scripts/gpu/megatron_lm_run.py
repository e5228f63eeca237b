"""Megatron-LM's pretrain_gpt.py, patched with this project, on this machine's GPU (world size 1).

    python3 scripts/gpu/megatron_lm_run.py MEGATRON_LM -- EXTRA_FLAGS...

MEGATRON_LM is a Megatron-LM checkout at tag core_v0.16.1 (scripts/setup_megatron_lm.sh fetches
one). As tests/test_pretrain_gpt.py does, it is copied (to $TMPDIR/gpu_validate-megatron-lm, kept
for later calls), patches/megatron-lm-core_v0.16.1.patch is applied to the copy, and the installed
megatron-core's built dataset helpers (same release) are copied in. Then pretrain_gpt.py runs in
this process as rank 0 of 1 for 4 iterations with --mock-data, on a small Llama-style model in
bf16 (``--transformer-impl local``, which runs without Transformer Engine and apex; Megatron's
fusions off, as ``megatron-pp-ext train`` configures its model), plus EXTRA_FLAGS (e.g.
``--pp-schedule zb-h1``). It passes when pretrain returns and Megatron reported a finite loss for
every iteration.

Two steps of Megatron-LM's initialisation need tools a torch wheel does not bring; each is
replaced only when they are missing, and the log says so: ``compile_helpers`` runs ``make`` in
the datasets folder (make, python3-config, and g++ with pybind11 unless the target is up to date),
skipped when the copied helpers import; ``fused_kernels.load`` runs ``$CUDA_HOME/bin/nvcc -V`` (at
this tag it builds nothing), a no-op when there is no nvcc. SKIP when the checkout or Megatron-LM's
training dependencies (six, regex, pydantic, triton) are missing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import common

PATCH = common.REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
FLAGS = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 704 --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 4 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 1024 --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--normalization RMSNorm --swiglu --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm "
    "--no-masked-softmax-fusion --rerun-mode disabled --eval-interval 100 --eval-iters 1 "
    "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-create-attention-mask-in-dataloader --bf16 "
    "--log-interval 1 --pipeline-model-parallel-size 1"
).split()
ITERATIONS = 4
TRAINING_DEPS = ("six", "regex", "pydantic", "triton")


def installed_helpers(tree: Path) -> list[Path]:
    """The installed megatron-core's built ``helpers_cpp`` modules (found on sys.path, without
    importing megatron, which must come from the tree later)."""
    for entry in sys.path:
        folder = Path(entry or ".") / "megatron" / "core" / "datasets"
        if folder.is_dir() and tree not in folder.parents:
            built = sorted(folder.glob("helpers_cpp*.so"))
            if built:
                return built
    return []


def prepare(tree: Path) -> Path:
    """A patched copy of ``tree`` with the built helpers, reused while the patch is the same."""
    stamp = hashlib.sha256(PATCH.read_bytes() + str(tree.resolve()).encode()).hexdigest()[:16]
    copy = Path(tempfile.gettempdir()) / "gpu_validate-megatron-lm"
    marker = copy / ".gpu_validate_prepared"
    if marker.exists() and marker.read_text() == stamp:
        print(f"using the patched copy in {copy}")
        return copy
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns(".git"))
    if shutil.which("git"):
        command = ["git", "apply", "--verbose", str(PATCH)]
    elif shutil.which("patch"):
        command = ["patch", "-p1", "-i", str(PATCH)]
    else:
        common.fail("neither git nor patch is installed: cannot apply the patch")
    done = subprocess.run(command, cwd=copy, capture_output=True, text=True, check=False)
    print(done.stdout + done.stderr, end="")
    if done.returncode != 0:
        common.fail(f"{PATCH.name} does not apply to {tree}")
    helpers = installed_helpers(tree)
    datasets = copy / "megatron" / "core" / "datasets"  # absent from a carried copy (.whl/megatron-lm)
    datasets.mkdir(parents=True, exist_ok=True)
    for built in helpers:
        shutil.copy(built, datasets / built.name)
    print(f"patched copy in {copy}; dataset helpers copied: {[p.name for p in helpers] or 'none found'}")
    marker.write_text(stamp)
    return copy


def shim_missing_tools() -> None:
    """Replace the two build steps whose tools are missing (module docstring)."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron.legacy import fused_kernels
    from torch.utils import cpp_extension

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401

        dataset_utils.compile_helpers = lambda: print("compile_helpers: skipped, the built helpers import")
    except ImportError:
        print("compile_helpers: the helpers do not import; Megatron compiles them (make, g++, pybind11)")
    nvcc = cpp_extension.CUDA_HOME and Path(cpp_extension.CUDA_HOME, "bin", "nvcc")
    if not (nvcc and nvcc.exists()):
        fused_kernels.load = lambda args: print("fused_kernels.load: no-op, no nvcc (it only runs nvcc -V)")


class Tee:
    """Our stdout, also kept (Megatron prints its losses there)."""

    def __init__(self, stream) -> None:
        self.stream, self.lines = stream, []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path, help="the Megatron-LM checkout (core_v0.16.1)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for pretrain_gpt.py")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if not (args.tree / "pretrain_gpt.py").is_file():
        common.skip(f"no Megatron-LM checkout: {args.tree}/pretrain_gpt.py is absent (set MEGATRON_LM)")
    missing = [name for name in TRAINING_DEPS if importlib.util.find_spec(name) is None]
    if missing:
        common.skip(f"Megatron-LM's training package needs {', '.join(missing)} (bring their wheels)")
    common.need_cuda()
    copy = prepare(args.tree.resolve())
    script = copy / "pretrain_gpt.py"
    sys.path.insert(0, str(copy))
    shim_missing_tools()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    sys.argv = [str(script), *FLAGS, *extra]
    print("$ " + " ".join(sys.argv), flush=True)
    tee = sys.stdout = Tee(sys.stdout)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            sys.stdout = tee.stream
            common.fail(f"pretrain_gpt.py exited with {stop.code}")
    finally:
        sys.stdout = tee.stream
    losses = [float(x) for x in re.findall(r"lm loss: ([-+.\dEe]+)", "".join(tee.lines))]
    if len(losses) < ITERATIONS or not all(math.isfinite(x) for x in losses):
        common.fail(f"expected {ITERATIONS} finite losses in Megatron's log, found {losses}")
    common.passed(f"{' '.join(extra) or 'default schedule'}: lm loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
