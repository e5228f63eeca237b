"""One ``megatron-pp-ext train`` run on this machine's GPU in bf16, printing every iteration's loss.

    python3 scripts/gpu/train_step.py [--iterations N] [--microbatches M] -- TRAIN_FLAGS...

runs ``python3 -m megatron_pp_ext train`` (the project from the working tree) at pipeline size 1
(unless TRAIN_FLAGS give one) on the tiny-llama config with TRAIN_FLAGS added, reads its
``--metrics`` and prints the loss of each iteration. Every flag in TRAIN_FLAGS must be one that
``train --help`` lists: a missing flag fails the step, naming it; the command is never changed
into another. bf16: train's ``--bf16`` (Megatron's flag).

The step passes when train exits 0 and every loss is finite; it SKIPs when TRAIN_FLAGS ask for
``--transformer-impl transformer_engine`` and Transformer Engine does not import. With
``--pp-offload`` it also reports how many bytes were offloaded per iteration (0 means no unit was
picked for offload).
``post_validation.py`` reuses :func:`run_train`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import common

TRAIN = [sys.executable, "-m", "megatron_pp_ext", "train"]


def train_help() -> str:
    done = subprocess.run([*TRAIN, "--help"], capture_output=True, text=True, cwd=common.REPO, check=False)
    if done.returncode != 0:
        common.fail(f"train --help failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done.stdout


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def check_flags(flags: list[str], help_text: str) -> None:
    """FAIL naming the first flag ``train --help`` does not list."""
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name.startswith("--") and not has_flag(help_text, name):
            common.fail(f"train has no {name} flag (train --help does not list it): {shlex.join(flags)}")


# a line that names an error: "SomeError: ...", "Exception: ...", "... rank 0: error: ..."
ERROR_LINE = re.compile(r"\w(Error|Exception): |\berror: ")


def run_train(flags: list[str], metrics: Path) -> tuple[int, list[dict], str]:
    """Run train with ``flags`` and ``--metrics``, its output passed on to ours: (exit code, the
    metric rows, the last line of its output that names an error)."""
    command = [*TRAIN, *flags, "--metrics", str(metrics)]
    print(f"$ {shlex.join(command)}", flush=True)
    path = os.pathsep.join(filter(None, [str(common.REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    error = ""
    with subprocess.Popen(
        command, cwd=common.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            if ERROR_LINE.search(line):
                error = line.strip()[:300]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return process.returncode, rows, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then train's flags")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    common.need_cuda()
    if "transformer_engine" in flags:  # --transformer-impl transformer_engine asked for
        from megatron_pp_ext.megatron.layer_spec import te_available

        if not te_available():
            common.skip("Transformer Engine does not import here: the TE spec's step cannot run")
    help_text = train_help()
    check_flags(flags, help_text)
    with tempfile.TemporaryDirectory(prefix="gpu_validate_train_") as scratch:
        directory = Path(scratch)
        layout = [] if any(f in flags for f in ("--pp", "--pipeline-model-parallel-size")) else ["--pp", "1"]
        returncode, rows, error = run_train(
            [
                "--bf16",
                *layout,
                "--microbatches", str(args.microbatches),
                "--train-iters", str(args.iterations),
                *flags,
            ],
            directory / "metrics.jsonl",
        )  # fmt: skip
    for row in rows:
        offloaded = row.get("offloaded_bytes")
        moved = "" if offloaded is None else f"  offloaded {offloaded / 2**20:.2f} MiB"
        print(f"iteration {row['iteration']:3d}  loss {row['loss']:.4f}  {row['step_time']:.3f} s{moved}")
    if returncode != 0:
        common.fail(f"train exited with {returncode}: {error or 'see the log'}")
    losses = [row["loss"] for row in rows]
    if len(losses) != args.iterations or not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        common.fail(f"expected {args.iterations} finite losses, got {losses}")
    summary = f"losses {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} iterations"
    if any(f.startswith("--pp-offload") for f in flags):
        offloaded = max(row.get("offloaded_bytes") or 0 for row in rows)
        summary += f", offloaded {offloaded / 2**20:.2f} MiB per iteration"
        if not offloaded:
            summary += " (no unit was offloaded: this schedule at this size keeps none long enough)"
    common.passed(summary)


if __name__ == "__main__":
    main()
