"""Ranks sharing a GPU talk gloo, which takes host tensors only (``megatron/gloo_on_gpu.py``):
megatron-core's DDP gradient reduction, its pipeline messages (bench) and post-validation stage
device tensors through host memory by construction.

A CPU has no device tensor, so the tests make one up: :func:`gloo_on_gpu.on_device` is told that
every tensor lives on a device, and a checking wrapper around gloo's calls records every tensor
handed to gloo that shares memory with a DDP gradient buffer (what a CUDA buffer would be: gloo
refuses it, "unsupported device type"). With the staging, none is handed over and the gradients
are bitwise those of megatron-core's own reduction; without it, the buffers are (the check can
fail)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import check_ok, run_ranks


def ddp_worker(rank: int, world: int, staged: bool, distributed_optimizer: bool) -> dict:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from runtime_case import forward_step, make_batches, tiny_model

    from megatron_pp_ext.megatron import gloo_on_gpu
    from megatron_pp_ext.megatron.ddp import wrap_chunks
    from megatron_pp_ext.megatron.model import build_reference, init_parallel_state

    init_parallel_state(1)  # DP 2
    model_cfg = tiny_model(num_layers=2)
    torch.manual_seed(7)
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, bucket_size=4000, grad_reduce_in_fp32=True
    )
    (chunk,) = wrap_chunks([build_reference(model_cfg)], config)
    storages = {b.grad_data.untyped_storage().data_ptr() for g in chunk.bucket_groups for b in g.buckets}
    handed: list[str] = []

    def checked(name: str, call):
        def wrapper(*args, **kwargs):
            for value in [*args, *kwargs.values()]:
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() in storages:
                    handed.append(name)
            return call(*args, **kwargs)

        return wrapper

    for name in ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor"):
        setattr(dist, name, checked(name, getattr(dist, name)))
    # megatron-core took its reduce-scatter at import
    buffers.dist_reduce_scatter_func = checked("reduce_scatter", buffers.dist_reduce_scatter_func)
    if staged:
        gloo_on_gpu.on_device = lambda tensor: True  # every tensor as if on a GPU
        gloo_on_gpu.install_for_ddp()
    (batch,) = make_batches(model_cfg, 1, seed=11 + rank)  # each data-parallel rank its own data
    output, loss_func = forward_step(iter([batch]), chunk)
    loss = loss_func(output)[0]
    loss.backward()
    chunk.finish_grad_sync()
    grads = [b.grad_data.tolist() for g in chunk.bucket_groups for b in g.buckets]
    return {"handed": sorted(set(handed)), "grads": grads}


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_ddp_gradient_reduction_hands_gloo_host_copies_only(distributed_optimizer: bool) -> None:
    plain = check_ok(run_ranks(ddp_worker, 2, False, distributed_optimizer, timeout=180))
    staged = check_ok(run_ranks(ddp_worker, 2, True, distributed_optimizer, timeout=180))
    assert all(r["handed"] for r in plain), "the check sees megatron-core hand gloo its buffers"
    for rank, (a, b) in enumerate(zip(plain, staged)):
        assert b["handed"] == [], f"rank {rank}: gloo was handed a gradient buffer by {b['handed']}"
        assert len(a["grads"]) == len(b["grads"]) > 0
        assert a["grads"] == b["grads"], f"rank {rank}: the staged reduction differs"


class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self, *args, **kwargs) -> bool:
        self.waited = True
        return True


def test_a_staged_receive_fills_megatron_s_buffer_that_requires_grad() -> None:
    """megatron-core allocates its receive buffers with ``requires_grad=True``: the copy into it
    at ``wait()`` must not be an in-place op autograd refuses (before: it raised on one rank and
    its peer waited out its timeout)."""
    from megatron_pp_ext.megatron.gloo_on_gpu import StagedWork

    target = torch.zeros(2, 3, requires_grad=True)
    host = torch.arange(6.0).reshape(2, 3)
    work = _Work()
    StagedWork(work, host, target).wait()
    assert work.waited and torch.equal(target.detach(), host) and target.requires_grad


def p2p_worker(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from megatron_pp_ext.megatron import gloo_on_gpu

    gloo_on_gpu.on_device = lambda tensor: True
    if rank == 0:
        gloo_on_gpu.staged_isend(torch.tensor([1.0, 2.0]), 1).wait()
        return []
    buffer = torch.zeros(2, requires_grad=True)
    request = gloo_on_gpu.staged_irecv(buffer, 0)
    assert not isinstance(request, dist.Work)  # staged: a host buffer in flight
    request.wait()
    return buffer.detach().tolist()


def test_staged_messages_arrive_in_a_buffer_that_requires_grad() -> None:
    assert check_ok(run_ranks(p2p_worker, 2, timeout=120))[1] == [1.0, 2.0]


def test_megatron_p2p_staging_view() -> None:
    """gloo_on_gpu.install_for_p2p: megatron-core's p2p module sees a torch whose isend/irecv stage
    through host memory; torch itself is unchanged, and a staged receive fills its device
    tensor only when waited for."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron_pp_ext.megatron import gloo_on_gpu

    before = p2p_communication.torch
    try:
        gloo_on_gpu.install_for_p2p()
        view = p2p_communication.torch
        assert view.distributed.isend is gloo_on_gpu.staged_isend
        assert view.distributed.irecv is gloo_on_gpu.staged_irecv
        assert view.distributed.get_backend is dist.get_backend and view.cuda is torch.cuda
        assert torch.distributed.isend is not gloo_on_gpu.staged_isend
    finally:
        p2p_communication.torch = before
        gloo_on_gpu._installed.discard("p2p")

    class Work:
        waited = 0

        def wait(self) -> bool:
            self.waited += 1
            return True

        def is_completed(self) -> bool:
            return self.waited > 0

    host, target, work = torch.arange(4.0), torch.zeros(4), Work()
    staged = gloo_on_gpu.StagedWork(work, host, target)
    assert not staged.is_completed() and target.sum() == 0  # nothing lands before the wait
    assert staged.wait() is True and torch.equal(target, host) and staged.waited == 1
    host.fill_(7)
    staged.wait()  # copied once
    assert torch.equal(target, torch.arange(4.0))


def post_validation_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_pp_ext.megatron.post_validation import PostValidation

    state = PostValidation(dist.group.WORLD, dist.group.WORLD)
    pending = state.begin(torch.tensor(float(rank + 1), dtype=torch.float64))
    return {"wire": str(state.wire_device(torch.device("cuda", 0))), "norm": pending.wait()}


def test_post_validation_state_travels_in_host_memory_under_gloo() -> None:
    """The partial and global gradient states go over gloo as host tensors whatever device the
    gradients are on (gloo has no CUDA point-to-point path)."""
    for report in check_ok(run_ranks(post_validation_worker, 2, timeout=120)):
        assert report["wire"] == "cpu"
        assert report["norm"] == pytest.approx(3.0**0.5, rel=1e-12)
