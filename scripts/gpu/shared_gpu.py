"""Every schedule at pipeline size 2-4 with the ranks sharing the one GPU, against the model
without a pipeline, in bf16.

    python3 scripts/gpu/shared_gpu.py [--runs LIST] [--sizes 2,3,4] [--budget S] [--plan]

``train`` gives each rank its own GPU and talks NCCL, which refuses two ranks on one device; on a
machine with one GPU the pipelined runs share it and talk gloo: Megatron's ``--distributed-backend
gloo``, with which train's ranks compute on the GPU and stage their messages through host memory.
Each run is 3 iterations (``--iterations``) on the bf16 tiny-llama config (sequence-sliced
schedules with 4 slices) and its losses must stay within 2 % of the same run at pipeline size 1
(1F1B, no pipeline, run first); no run starts after ``--budget`` seconds (default 480), and the
runs still to go are reported as not run. A train without the flag (an older checkout) makes this
step SKIP.

``--runs``: a comma list, run in its order, of ``NAME@PP`` (one schedule at one pipeline size) and
of the words ``families`` (one run of each schedule family, where it differs most from 1F1B:
zb-h2, v-zb, dualpipev, seq1f1b and slimpipe at PP 4, interleaved-1f1b at PP 2), ``rest`` (every
schedule at every ``--sizes`` not listed before it: the variants, after ``families``) and ``all``
(every schedule at every size, schedule by schedule: the default). ``--plan`` prints the runs in
order and exits, without a GPU or torch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common
from train_step import has_flag, run_train, train_help

from megatron_pp_ext.schedule.generators import SCHEDULES

SIZES = (2, 3, 4)
FAMILIES = ("zb-h2@4", "v-zb@4", "dualpipev@4", "seq1f1b@4", "slimpipe@4", "interleaved-1f1b@2")
ITERATIONS, MICROBATCHES = 3, 8
TOLERANCE = 0.02  # relative loss difference allowed against pipeline size 1
BUDGET_S = 480


def parse_run(text: str) -> tuple[str, int]:
    name, _, size = text.partition("@")
    if name not in SCHEDULES or not size.isdigit() or int(size) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give NAME@PP with a schedule of {', '.join(SCHEDULES)} and PP >= 2"
        )
    return name, int(size)


def plan(runs: str, sizes: tuple[int, ...]) -> list[tuple[str, int]]:
    """The (schedule, pipeline size) pairs of ``--runs``, in order, each once."""
    chosen: list[tuple[str, int]] = []
    for item in filter(None, (part.strip() for part in runs.split(","))):
        if item == "families":
            found = [parse_run(run) for run in FAMILIES]
        elif item in ("rest", "all"):
            found = [(name, pp) for name in SCHEDULES for pp in sizes]
        else:
            found = [parse_run(item)]
        chosen += [run for run in found if run not in chosen]
    if not chosen:
        raise argparse.ArgumentTypeError(f"--runs {runs!r} names no run")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="all", help="NAME@PP, families, rest, all (comma list, in order)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="pipeline sizes of rest/all")
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which no run starts")
    parser.add_argument("--plan", action="store_true", help="print the runs in order and exit")
    args = parser.parse_args()
    try:
        sizes = tuple(int(size) for size in args.sizes.split(","))
        runs = plan(args.runs, sizes)
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(str(error))
    if args.plan:
        print(" ".join(f"{name}@{pp}" for name, pp in runs))
        return
    help_text = train_help()
    if not has_flag(help_text, "--distributed-backend"):
        common.skip("needs train --distributed-backend gloo (this checkout's train has none)")
    common.need_cuda()

    started, failures, results, not_run = time.monotonic(), [], [], []
    with tempfile.TemporaryDirectory(prefix="gpu_validate_shared_") as scratch:
        directory = Path(scratch)
        base = ["--bf16", "--microbatches", str(MICROBATCHES)]
        base += ["--train-iters", str(args.iterations)]
        code, rows, error = run_train([*base, "--pp", "1", "--pp-schedule", "1f1b"], directory / "ref.jsonl")
        if code != 0:
            common.fail(f"the run at pipeline size 1 exited with {code}: {error or 'see the log'}")
        reference = [row["loss"] for row in rows]
        for name, pp in runs:
            if time.monotonic() - started > args.budget:
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
        print(f"not run (time budget {args.budget:g} s): {', '.join(not_run)}")
    if failures:
        common.fail("; ".join(failures))
    common.passed(f"{len(results)} runs within {TOLERANCE:.0%} of pipeline size 1; not run: {len(not_run)}")


if __name__ == "__main__":
    main()
