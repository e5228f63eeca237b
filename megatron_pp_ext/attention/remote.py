"""Attention to the oldest K/V slices computed somewhere else (SlimPipe's workload redistribution).

A slice late in the sequence attends to many keys; its rank can hand the queries and its OLDEST
cached K/V slices to a lighter rank. Those keys are all visible to every query of the slice, so
the partner computes plain non-causal attention and returns ``(out, lse)``, which the heavy rank
merges by lse with its own blocks. The backward sends the merged ``out`` and ``lse`` with
``dout``; the partner runs the kernel's backward on the same block, which gives that block's
exact share of dq and the dk/dv of the oldest slices (see ``blocks.py``). The partner keeps
nothing in between, so forward and backward may go to different partners.

:class:`RemoteKeys` is what sliced attention sees (the runtime's channel to a partner rank
implements it); :func:`serve_forward` / :func:`serve_backward` are what a partner computes;
:class:`InProcessRemote` computes it in this process, for tests and single-process checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from .blocks import Kernel

T = TypeVar("T")


class Pending(Protocol[T]):
    """A request in flight; ``wait()`` gives its result."""

    def wait(self) -> T: ...


class PartnerService(Protocol):
    """The light op's side: serve the partner's next request (or take its DONE)."""

    def serve_one(self) -> None: ...


class RemoteKeys(Protocol):
    """The oldest ``oldest_slices`` K/V slices of the running op are attended elsewhere.
    Tensors are [b, heads, s, d]; ``kernel`` names the backend both sides use."""

    oldest_slices: int

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, kernel: str
    ) -> Pending[tuple[Tensor, Tensor]]: ...

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dout: Tensor,
        out: Tensor,
        lse: Tensor,
        scale: float,
        kernel: str,
    ) -> Pending[tuple[Tensor, Tensor, Tensor]]: ...


def serve_forward(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``q`` attending to all of ``k``/``v`` (they precede every query)."""
    with torch.no_grad():
        return kernel.forward(q, k, v, False, scale)


def serve_backward(
    kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq (this block's share), dk, dv of the block, given the MERGED ``out`` and ``lse``; all in
    q's dtype."""
    with torch.no_grad():
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, False, scale)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@dataclass
class Done(Generic[T]):
    """A result that is already there."""

    value: T

    def wait(self) -> T:
        return self.value


@dataclass
class InProcessRemote:
    """:class:`RemoteKeys` computed right here: same math as a partner rank, no transfer."""

    oldest_slices: int

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, kernel: str) -> Done:
        from .backends import kernel_named

        return Done(serve_forward(kernel_named(kernel), q, k, v, scale))

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        dout: Tensor,
        out: Tensor,
        lse: Tensor,
        scale: float,
        kernel: str,
    ) -> Done:
        from .backends import kernel_named

        return Done(serve_backward(kernel_named(kernel), q, k, v, dout, out, lse, scale))
