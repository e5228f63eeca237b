"""Every schedule at pipeline size 2-4 with the ranks sharing the one GPU, against the model
without a pipeline, in bf16.

``train`` gives each rank its own GPU and talks NCCL, which refuses two ranks on one device; on a
machine with one GPU the pipelined runs share it and talk gloo: Megatron's ``--distributed-backend
gloo``, with which train's ranks compute on the GPU and stage their messages through host memory.
Each schedule runs 3 iterations at each pipeline size on the bf16 tiny-llama config
(sequence-sliced schedules with 4 slices) and its losses must stay within 2 % of the same run at
pipeline size 1 (1F1B, no pipeline); runs still to go after 480 s are reported as not run. A train
without the flag (an older checkout) makes this step SKIP.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import common
from train_step import has_flag, run_train, train_help

SIZES = (2, 3, 4)
ITERATIONS, MICROBATCHES = 3, 8
TOLERANCE = 0.02  # relative loss difference allowed against pipeline size 1
BUDGET_S = 480


def main() -> None:
    help_text = train_help()
    if not has_flag(help_text, "--distributed-backend"):
        common.skip("needs train --distributed-backend gloo (this checkout's train has none)")
    common.need_cuda()
    from megatron_pp_ext.schedule.generators import SCHEDULES

    started, failures, results, not_run = time.monotonic(), [], [], []
    with tempfile.TemporaryDirectory(prefix="gpu_validate_shared_") as scratch:
        directory = Path(scratch)
        base = ["--bf16", "--microbatches", str(MICROBATCHES)]
        base += ["--train-iters", str(ITERATIONS)]
        code, rows, error = run_train([*base, "--pp", "1", "--pp-schedule", "1f1b"], directory / "ref.jsonl")
        if code != 0:
            common.fail(f"the run at pipeline size 1 exited with {code}: {error or 'see the log'}")
        reference = [row["loss"] for row in rows]
        for name in SCHEDULES:
            for pp in SIZES:
                if time.monotonic() - started > BUDGET_S:
                    not_run.append(f"{name}@{pp}")
                    continue
                sliced = ["--pp-seq-slices", "4"] if name.startswith(("seq1f1b", "slimpipe")) else []
                shared = ["--distributed-backend", "gloo"]  # the ranks share the one GPU
                flags = [*base, "--pp", str(pp), *shared, "--pp-schedule", name, *sliced]
                code, rows, error = run_train(flags, directory / f"{name}-{pp}.jsonl")
                losses = [row["loss"] for row in rows]
                if code != 0 or len(losses) != len(reference):
                    failures.append(f"{name}@{pp}: exit {code} {error}".strip())
                    continue
                worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
                results.append(f"{name}@{pp} {worst:.1e}")
                print(f"{name} pp={pp}: losses {losses}, max relative difference {worst:.2e}", flush=True)
                if worst > TOLERANCE:
                    failures.append(f"{name}@{pp}: {worst:.2e} > {TOLERANCE}")
    if not_run:
        print(f"not run (time budget {BUDGET_S} s): {', '.join(not_run)}")
    if failures:
        common.fail("; ".join(failures))
    common.passed(f"{len(results)} runs within {TOLERANCE:.0%} of pipeline size 1; not run: {len(not_run)}")


if __name__ == "__main__":
    main()
