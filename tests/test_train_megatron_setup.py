"""What `train` sets up as Megatron-LM does, checked on CPU: ``--bf16`` gives bfloat16 weights
with gradients reduced in fp32 (Megatron-LM turns ``--accumulate-allreduce-grads-in-fp32`` on for
bf16) and still the weights of the fp32 run's seeded model; seeds per pipeline stage as
Megatron-LM's ``_set_random_seed`` (on CUDA the same call seeds megatron-core's RNG tracker)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import check_ok, run_ranks

pytestmark = pytest.mark.slow

ARGS = ["--pp", "2", "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "1"]
ARGS += ["--microbatches", "2", "--train-iters", "2", "--seed", "7"]


def setup_worker(rank: int, world: int) -> dict:
    import numpy as np

    from megatron_pp_ext.commands.train import settings_from_argv
    from megatron_pp_ext.training.job import TrainJob

    report: dict = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        settings = settings_from_argv([*ARGS, *extra], world)
        job = TrainJob(rank, settings, torch.device("cpu"), None)
        try:
            params = [p for chunk in job.model for p in chunk.parameters()]
            entry = {
                "param_dtypes": sorted({str(p.dtype) for p in params}),
                "main_grad_dtypes": sorted({str(p.main_grad.dtype) for p in params}),
                "grad_reduce_in_fp32": job.model[0].ddp_config.grad_reduce_in_fp32,
                "first_weight": [float(x) for x in params[0].detach().float().flatten()[:8]],
                "numpy_key": int(np.random.get_state()[1][0]),
            }
            rows = job.run()
            entry["losses"] = [row["loss"] for row in rows if row["loss"] is not None]
        finally:
            job.close()
        report[name] = entry
    return report


def test_bf16_and_seeds_as_megatron_lm() -> None:
    import numpy as np

    reports = check_ok(run_ranks(setup_worker, 2, timeout=300))
    for rank, report in enumerate(reports):
        fp32, bf16 = report["fp32"], report["bf16"]
        assert fp32["param_dtypes"] == ["torch.float32"] and not fp32["grad_reduce_in_fp32"]
        assert bf16["param_dtypes"] == ["torch.bfloat16"], bf16
        assert bf16["main_grad_dtypes"] == ["torch.float32"] and bf16["grad_reduce_in_fp32"], bf16
        # the same seeded model, rounded to bf16
        rounded = torch.tensor(fp32["first_weight"]).to(torch.bfloat16).float().tolist()
        assert bf16["first_weight"] == rounded, rank
        # Megatron-LM's stage seed: seed + 100 x pipeline rank
        assert fp32["numpy_key"] == np.random.RandomState(7 + 100 * rank).get_state()[1][0], rank
    losses = [r for report in reports for r in (report["fp32"]["losses"], report["bf16"]["losses"]) if r]
    assert len(losses) == 2 and all(len(run) == 2 and all(map(math.isfinite, run)) for run in losses)
    fp32_losses, bf16_losses = losses
    assert abs(bf16_losses[0] - fp32_losses[0]) / fp32_losses[0] < 0.02, losses  # bf16 rounding only
