"""Which attention backends exist, which can run a given call, and which "auto" picks.

Kernels (explicit forward/backward with lse): ``math`` (pure torch, the reference),
``torch_flash`` (torch's flash-attention ops; CPU and CUDA), ``flash_attn`` (the flash-attn
package; CUDA). Autograd backends: ``sdpa`` (torch SDPA, no lse) and ``flex`` (FlexAttention).
"auto" takes the first of ``AUTO_ORDER`` that can run the call: explicit kernels first because
the sliced backward then needs no recomputation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attend import FlexAttend, SdpaAttend, flex_available
from .blocks import Kernel
from .flash_attn_kernel import FlashAttnKernel
from .math_kernel import MathKernel
from .torch_flash import TorchFlashKernel

Backend = Kernel | SdpaAttend | FlexAttend

_BACKENDS: dict[str, Backend] = {
    "math": MathKernel(),
    "torch_flash": TorchFlashKernel(),
    "flash_attn": FlashAttnKernel(),
    "sdpa": SdpaAttend(),
    "flex": FlexAttend(),
}
BACKEND_NAMES = ("auto", *_BACKENDS)
AUTO_ORDER = ("flash_attn", "torch_flash", "flex", "math")
KERNEL_NAMES = tuple(name for name, backend in _BACKENDS.items() if hasattr(backend, "backward"))


def is_kernel(backend: Backend) -> bool:
    """True for backends with explicit forward/backward (math, torch_flash, flash_attn)."""
    return hasattr(backend, "backward")


def kernel_named(name: str) -> Kernel:
    """The kernel backend called ``name`` (one of KERNEL_NAMES)."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"{name!r} is not an attention kernel; kernels: {', '.join(KERNEL_NAMES)}")
    return _BACKENDS[name]  # type: ignore[return-value]


def _can_run(
    backend: Backend, q: Tensor, k: Tensor, need_lse: bool, need_grad: bool, kernel_only: bool = False
) -> bool:
    if is_kernel(backend):
        return backend.supports(q, k)
    if kernel_only:
        return False
    if need_lse and not backend.gives_lse:
        return False
    return backend.supports(q, k, need_grad)


def available_backends(q: Tensor, k: Tensor, need_lse: bool = False, need_grad: bool = True) -> list[str]:
    """Names of the backends that can run attention of ``q`` to ``k`` (layout [b, heads, s, d])."""
    return [name for name, be in _BACKENDS.items() if _can_run(be, q, k, need_lse, need_grad)]


def choose_backend(
    name: str,
    q: Tensor,
    k: Tensor,
    need_lse: bool = False,
    need_grad: bool = True,
    kernel_only: bool = False,
) -> Backend:
    """The backend called ``name`` (or the first of AUTO_ORDER for "auto"); an error says why
    a named one cannot run this call. ``kernel_only``: explicit kernels only, as attention
    redistribution needs (a partner runs the kernel's backward on its block)."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if _can_run(_BACKENDS[candidate], q, k, need_lse, need_grad, kernel_only):
                return _BACKENDS[candidate]
        raise AssertionError("the math backend runs everything")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    backend = _BACKENDS[name]
    if kernel_only and not is_kernel(backend):
        raise ValueError(
            f"attention backend {name!r} has no explicit backward kernel, which "
            f"--pp-attn-redistribution needs; use one of {', '.join(KERNEL_NAMES)} or auto, or "
            "set --pp-attn-redistribution 0"
        )
    if not _can_run(backend, q, k, need_lse, need_grad):
        what = f"{q.dtype} on {q.device.type}, head dim {q.shape[-1]}"
        if need_lse and not is_kernel(backend) and not backend.gives_lse:
            why = "it gives no lse"
        elif name == "flex" and not flex_available():
            why = f"torch {torch.__version__} has no FlexAttention AuxRequest (torch >= 2.9 has)"
        elif need_grad and not is_kernel(backend):
            why = f"it cannot run {what} with gradients"
        else:
            why = f"it cannot run {what}"
        usable = ", ".join(available_backends(q, k, need_lse, need_grad))
        raise ValueError(f"attention backend {name!r} cannot be used here: {why} (usable: {usable})")
    return backend
