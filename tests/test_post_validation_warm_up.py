"""Optimizer post-validation creates its communicators where every rank sets its chain (the
optimizer's construction, and each later chain), not inside a step: NCCL creates a communicator
at its first use and blocks its members there (docs/nccl.md). Three gloo ranks, a tiny model."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from dist_utils import check_ok, run_ranks  # noqa: E402


def warm_up_worker(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.megatron import post_validation
    from megatron_pp_ext.megatron.model import init_parallel_state
    from megatron_pp_ext.megatron.optimizer import MainGradOptimizer, OptimizerSettings

    init_parallel_state(world)
    calls: dict[str, int] = {"all_reduce": 0, "irecv": 0, "isend": 0}

    class Counted:
        """torch.distributed as post_validation.py sees it, counting the calls it makes."""

        def __getattr__(self, name: str) -> Any:
            real = getattr(dist, name)
            if name not in calls:
                return real

            def call(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return real(*args, **kwargs)

            return call

    post_validation.dist = Counted()
    optimizer = MainGradOptimizer([torch.nn.Linear(2, 2)], OptimizerSettings(lr=0.1), post_validation=True)
    at_construction = dict(calls)
    optimizer.validation.set_chain([0, 1, 2])  # a measured chain, set between steps
    after_new_chain = {name: calls[name] - at_construction[name] for name in calls}
    # a step's state after the warm-ups: the sum of every rank's, the chain's partial ones in order
    pending = optimizer.validation.begin(torch.tensor(float(rank + 1), dtype=torch.float64))
    return {
        "construction": at_construction,
        "new_chain": after_new_chain,
        "partial": pending.partial,
        "norm": pending.wait(),
    }


def test_post_validation_creates_its_communicators_where_the_chain_is_set() -> None:
    reports = check_ok(run_ranks(warm_up_worker, 3, timeout=120))
    # default chain 2 > 1 > 0, then 0 > 1 > 2: one all-reduce each time; a receive on every rank
    # but the chain's first, a send on every rank but its last
    assert [r["construction"] for r in reports] == [
        {"all_reduce": 1, "irecv": 1, "isend": 0},
        {"all_reduce": 1, "irecv": 1, "isend": 1},
        {"all_reduce": 1, "irecv": 0, "isend": 1},
    ]
    assert [r["new_chain"] for r in reports] == [
        {"all_reduce": 1, "irecv": 0, "isend": 1},
        {"all_reduce": 1, "irecv": 1, "isend": 1},
        {"all_reduce": 1, "irecv": 1, "isend": 0},
    ]
    assert [r["partial"] for r in reports] == [1.0, 3.0, 6.0]  # ranks 0, 1, 2 along 0 > 1 > 2
    assert all(r["norm"] == pytest.approx(math.sqrt(6.0)) for r in reports)


def queued_worker(rank: int, world: int) -> dict[str, Any]:
    """A step's global check launched through the rank's launch queue under NCCL emulation
    (in-order completion), behind a pipeline message posted before it, as at a step's end."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.megatron.model import init_parallel_state
    from megatron_pp_ext.megatron.optimizer import MainGradOptimizer, OptimizerSettings
    from megatron_pp_ext.runtime.launch_order import Launcher

    init_parallel_state(world)
    optimizer = MainGradOptimizer([torch.nn.Linear(2, 2)], OptimizerSettings(lr=0.1), post_validation=True)
    launcher = Launcher(rank, timeout_s=30.0, in_order=True)
    optimizer.validation.launch_queue = lambda: launcher
    # a message of the step still in the queue: rank 0 sends to rank 1 first
    message = torch.full((1,), float(rank))
    first = (
        launcher(
            lambda: dist.isend(message, dst=1) if rank == 0 else dist.irecv(message, src=0),
            "the step's last message",
        )
        if rank < 2
        else None
    )
    pending = optimizer.validation.begin(torch.tensor(float(rank + 1), dtype=torch.float64))
    norm = pending.wait()
    if first is not None:
        first.wait()
    launched = launcher.launched
    launcher.close()
    return {"partial": pending.partial, "norm": norm, "launched": launched, "message": float(message[0])}


def test_the_global_check_launches_in_the_pipelines_order() -> None:
    """Under --pp-emulate-nccl the all-reduce and the chain's hops go through the rank's launch
    queue (after the step's messages, as a GPU completes them), and still add up."""
    reports = check_ok(run_ranks(queued_worker, 3, timeout=120))
    # default chain 2 > 1 > 0: all-reduce on every rank, a receive on 1 and 0, a send on 2 and 1
    assert [r["launched"] for r in reports] == [1 + 2, 1 + 3, 2]
    assert [r["partial"] for r in reports] == [6.0, 5.0, 3.0]
    assert all(r["norm"] == pytest.approx(math.sqrt(6.0)) for r in reports)
    assert reports[1]["message"] == 0.0  # rank 0's message arrived
