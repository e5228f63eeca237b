"""Ranks that share a GPU talk gloo; gloo moves host memory only: every call staged through it.

``--distributed-backend gloo`` on a CUDA machine runs p ranks on fewer GPUs (``bench`` and the
GPU rounds put a whole pipeline on one H100). The ranks compute on CUDA, but ProcessGroupGloo
takes host tensors for point-to-point messages and for the coalesced all-reduce that megatron-
core's DDP wraps its bucket reductions in (``_coalescing_manager`` calls ``allreduce_coalesced``:
"unsupported device type"). Our runtime stages its own messages (``runtime/p2p.py``); this module
stages what megatron-core sends:

- :func:`install_for_ddp` gives megatron-core's ``param_and_grad_buffer`` (DDP's gradient
  reduction and the distributed optimizer's parameter gather) and ``finalize_model_grads`` (the
  embedding, layer-norm and token-count all-reduces) collectives that copy a device
  tensor to host memory, run gloo's blocking collective there and copy the result back, and a
  coalescing manager that only groups them (each call is complete when it returns);
- :func:`install_for_p2p` gives ``p2p_communication`` (megatron-core's own pipeline schedules,
  run by ``bench --against megatron``) an ``isend`` of a host copy and an ``irecv`` into a host
  buffer that the request's ``wait()`` copies into Megatron's device tensor.

Each gives that one module a view of ``torch`` (``cpu_shim.module_view``); nothing outside it
sees a change. A host tensor, and any call over an NCCL group, passes straight through
(:func:`on_device` and the group's backend decide): under gloo on CPU the calls are gloo's own,
and our own code calls these functions wherever it talks over a group that may be gloo (the
optimizer's norm and shard gather). Installed only where ranks run gloo on CUDA
(:func:`install_where_needed`); NCCL runs megatron-core unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_installed: set[str] = set()


def on_device(tensor: Tensor) -> bool:
    """Whether gloo cannot take ``tensor`` as it is (it lives outside host memory)."""
    return tensor.device.type != "cpu"


def _staged(group: Any, *tensors: Tensor) -> bool:
    """Whether a call over ``group`` with ``tensors`` goes through host memory: gloo, and a
    tensor gloo cannot take (NCCL's calls pass unchanged, so these functions serve both)."""
    return any(on_device(t) for t in tensors) and dist.get_backend(group) == "gloo"


def needed() -> bool:
    """Ranks compute on CUDA and talk gloo: the staging is needed."""
    return torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def install_where_needed() -> bool:
    """Stage megatron-core's DDP and p2p calls when :func:`needed`; return whether installed."""
    if not needed():
        return False
    install_for_ddp()
    install_for_p2p()
    return True


class StagedWork:
    """A gloo request on a host copy: ``wait()`` waits, then fills the device tensor (receives).
    It holds the host copy until then (sends)."""

    def __init__(self, work: Any, host: Tensor, target: Tensor | None = None) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self.work.wait(*args, **kwargs)
        if self.target is not None:
            with torch.no_grad():  # Megatron's receive buffers require grad (a leaf)
                self.target.copy_(self.host)
            self.target = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class DoneWork:
    """The handle of a staged collective: it completed before the call returned."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def staged_isend(
    tensor: Tensor, dst: int | None = None, group: Any = None, tag: int = 0, **kwargs: Any
) -> Any:
    """``dist.isend`` of a host copy of ``tensor`` (``tensor`` itself when it is on the host)."""
    if not _staged(group, tensor):
        return dist.isend(tensor, dst, group, tag, **kwargs)
    host = tensor.detach().to("cpu", copy=True)
    return StagedWork(dist.isend(host, dst, group, tag, **kwargs), host)


def staged_irecv(
    tensor: Tensor, src: int | None = None, group: Any = None, tag: int = 0, **kwargs: Any
) -> Any:
    """``dist.irecv`` into a host buffer that ``wait()`` copies into ``tensor`` (directly into
    ``tensor`` when it is on the host)."""
    if not _staged(group, tensor):
        return dist.irecv(tensor, src, group, tag, **kwargs)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    return StagedWork(dist.irecv(host, src, group, tag, **kwargs), host, tensor)


def staged_all_reduce(
    tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """``dist.all_reduce`` on a host copy, copied back; complete when it returns."""
    if not _staged(group, tensor):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    host = tensor.detach().to("cpu", copy=True)
    dist.all_reduce(host, op=op, group=group)
    with torch.no_grad():
        tensor.copy_(host)
    return DoneWork() if async_op else None


def staged_reduce_scatter_tensor(
    output: Tensor, input: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """``dist.reduce_scatter_tensor`` through host memory (the distributed optimizer's shards)."""
    if not _staged(group, output, input):
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    host_out = torch.empty(output.shape, dtype=output.dtype)
    dist.reduce_scatter_tensor(host_out, input.detach().to("cpu", copy=True), op=op, group=group)
    with torch.no_grad():
        output.copy_(host_out)
    return DoneWork() if async_op else None


def staged_all_gather_into_tensor(
    output: Tensor, input: Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """``dist.all_gather_into_tensor`` through host memory (the distributed optimizer's gather)."""
    if not _staged(group, output, input):
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    host_out = torch.empty(output.shape, dtype=output.dtype)
    dist.all_gather_into_tensor(host_out, input.detach().to("cpu", copy=True), group=group)
    with torch.no_grad():
        output.copy_(host_out)
    return DoneWork() if async_op else None


class _Grouped:
    """What ``_coalescing_manager`` yields: the staged calls inside completed as they ran."""

    def wait(self) -> None:
        return None


@contextmanager
def grouping_only(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[_Grouped]:
    """In place of ``torch.distributed._coalescing_manager``: the calls inside run one by one
    (gloo has no coalesced form for device tensors, and each staged call is blocking)."""
    yield _Grouped()


def install_for_ddp() -> None:
    """Stage megatron-core's ``param_and_grad_buffer`` collectives (idempotent)."""
    if "ddp" in _installed:
        return
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from .cpu_shim import module_view

    distributed = module_view(
        dist,
        all_reduce=staged_all_reduce,
        reduce_scatter_tensor=staged_reduce_scatter_tensor,
        _reduce_scatter_base=staged_reduce_scatter_tensor,
        all_gather_into_tensor=staged_all_gather_into_tensor,
        _all_gather_base=staged_all_gather_into_tensor,
    )
    buffers.torch = module_view(torch, distributed=distributed)  # type: ignore[attr-defined]
    buffers._coalescing_manager = grouping_only  # type: ignore[attr-defined]
    buffers.dist_reduce_scatter_func = staged_reduce_scatter_tensor  # type: ignore[attr-defined]
    buffers.dist_all_gather_func = staged_all_gather_into_tensor  # type: ignore[attr-defined]
    # finalize_model_grads: the embedding, layer-norm and token-count all-reduces
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    finalize.torch = buffers.torch  # type: ignore[attr-defined]
    _installed.add("ddp")


def install_for_p2p() -> None:
    """Stage megatron-core's ``p2p_communication`` sends and receives (idempotent)."""
    if "p2p" in _installed:
        return
    from megatron.core.pipeline_parallel import p2p_communication

    from .cpu_shim import module_view

    distributed = module_view(dist, isend=staged_isend, irecv=staged_irecv)
    p2p_communication.torch = module_view(torch, distributed=distributed)  # type: ignore[attr-defined]
    _installed.add("p2p")
