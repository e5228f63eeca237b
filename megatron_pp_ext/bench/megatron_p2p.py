"""Megatron-core's pipeline messages staged through host memory, for ranks that share a GPU.

``bench --distributed-backend gloo`` runs p ranks on fewer GPUs (one H200 at ``--pp 2``): they
compute on CUDA and talk gloo, whose send and receive take host tensors only. Our runtime
stages its messages itself (``runtime/p2p.py``); megatron-core's ``p2p_communication`` hands
``torch.distributed.isend``/``irecv`` the CUDA tensors it computes. :func:`install` gives that
one module a view of ``torch`` whose ``distributed.isend`` copies a device tensor to host memory
and sends the copy, and whose ``distributed.irecv`` receives into a host buffer that the
request's ``wait()`` copies into the device tensor Megatron allocated (Megatron reads a received
tensor only after waiting for it, ``_communicate``). Host tensors pass straight through, so on
CPU nothing changes; every other name is torch's own object, and nothing outside
``p2p_communication`` sees a change. A bench-only shim: ``train`` never runs Megatron's p2p.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_installed = False


class StagedWork:
    """A gloo request on a host copy: ``wait()`` waits, then fills the device tensor (receives).
    It holds the host copy until then (sends)."""

    def __init__(self, work: Any, host: Tensor, target: Tensor | None = None) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self.work.wait(*args, **kwargs)
        if self.target is not None:
            self.target.copy_(self.host)
            self.target = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def staged_isend(
    tensor: Tensor, dst: int | None = None, group: Any = None, tag: int = 0, **kwargs: Any
) -> Any:
    """``dist.isend`` of a host copy of ``tensor`` (``tensor`` itself when it is on the host)."""
    if tensor.device.type == "cpu":
        return dist.isend(tensor, dst, group, tag, **kwargs)
    host = tensor.detach().to("cpu")
    return StagedWork(dist.isend(host, dst, group, tag, **kwargs), host)


def staged_irecv(
    tensor: Tensor, src: int | None = None, group: Any = None, tag: int = 0, **kwargs: Any
) -> Any:
    """``dist.irecv`` into a host buffer that ``wait()`` copies into ``tensor`` (directly into
    ``tensor`` when it is on the host)."""
    if tensor.device.type == "cpu":
        return dist.irecv(tensor, src, group, tag, **kwargs)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    return StagedWork(dist.irecv(host, src, group, tag, **kwargs), host, tensor)


def install() -> None:
    """Give megatron-core's ``p2p_communication`` the staging view of ``torch`` (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.pipeline_parallel import p2p_communication

    from ..megatron.cpu_shim import module_view

    distributed = module_view(dist, isend=staged_isend, irecv=staged_irecv)
    p2p_communication.torch = module_view(torch, distributed=distributed)  # type: ignore[attr-defined]
    _installed = True
