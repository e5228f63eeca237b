"""Ours against megatron-core's own schedules on this GPU, and our activation offload against
Megatron's fine-grained offloading (issue 25's GPU figures).

    python scripts/gpu/bench_megatron.py schedules   # bench --against megatron, ranks sharing the GPU
    python scripts/gpu/bench_megatron.py offload     # --pp-offload full,selective,auto beside Megatron's

Both run ``megatron-pp-ext bench --against megatron`` on the ``medium`` bench model at pipeline
size 2, each rank on its own GPU when the machine has two or more, else sharing the one
(``--distributed-backend gloo``: ours and Megatron's messages staged through host memory alike).
``offload`` adds Megatron's fine-grained activation offloading of the attention and norm inputs
where Transformer Engine imports (megatron-core needs its cpu_offload), and says so where not.
The step passes when every job ran and every first-step loss and gradient norm matched
Megatron's (and each offloaded step its own run without offload); the tables are printed whole.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import common

from megatron_pp_ext.bench.report import label_of

PP = 2
MODULES = ["core_attn", "attn_proj", "qkv_linear", "attn_norm", "mlp_norm"]
SCHEDULES = "1f1b,interleaved-1f1b,zb-h1,zb-h2,v-half,v-zb,dualpipev,seq1f1b,slimpipe"


def bench(extra: list[str]) -> dict:
    import torch

    shared = [] if torch.cuda.device_count() >= PP else ["--distributed-backend", "gloo"]
    with tempfile.TemporaryDirectory(prefix="gpu_validate_bench_") as scratch:
        saved = Path(scratch) / "bench.json"
        command = [sys.executable, "-m", "megatron_pp_ext", "bench", "--against", "megatron", "--pp", str(PP)]
        command += ["--model-size", "medium", "--microbatches", "8", "--iterations", "10", "--warmup", "2"]
        # a stuck transfer fails within 60 s (process groups in 2 x 60 + 60 s), inside the step's limit
        command += ["--timeout", "60"]
        command += [*shared, *extra, "--save", str(saved)]
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, text=True)
        if done.returncode != 0:
            common.fail(f"bench exited with {done.returncode}")
        return json.loads(saved.read_text())


def problems(results: dict) -> list[str]:
    found = []
    for row in results["rows"]:
        name = label_of(row)
        for side in ("ours", "megatron"):
            if row.get(f"{side}_skip"):
                found.append(f"{name}: {side} skipped ({row[f'{side}_skip']})")
        if row.get("check") and not row["check"]["match"]:
            found.append(f"{name}: first-step loss or gradient norm differs from Megatron's")
        for side in ("ours", "megatron"):
            if (row.get(side) or {}).get("same_step_as_plain") is False:
                found.append(f"{name}: {side} offloaded step differs from its run without offload")
    return found


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "schedules"
    common.need_cuda()
    if what == "schedules":
        results = bench(["--schedules", SCHEDULES])
    elif what == "offload":
        extra = ["--schedules", "1f1b", "--pp-offload", "full,selective,auto"]
        fine_grained = importlib.util.find_spec("transformer_engine") is not None
        if fine_grained:
            extra += ["--fine-grained-activation-offloading", "--offload-modules", *MODULES]
        else:
            print("Transformer Engine does not import: no Megatron fine-grained offloading", flush=True)
        results = bench(extra)
    else:
        common.fail(f"unknown part {what!r}: schedules or offload")
    found = problems(results)
    if found:
        common.fail("; ".join(found)[:300])
    ratios = [
        f"{label_of(row)} {row['ours_over_megatron']['median']:.2f}"
        for row in results["rows"]
        if row.get("ours_over_megatron")
    ]
    shared = " (ranks sharing the GPU)" if results.get("shared_gpu") else ""
    common.passed(f"ours/Megatron median{shared}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
