"""The flash-attn package (Dao-AILab) as a kernel, when it is installed and a GPU is present.

Uses the package's ``_flash_attn_forward`` / ``_flash_attn_backward`` ops (flash-attn 2.6 and
later, where the window is given as two ints and the backward writes into given dq/dk/dv):
they return the lse and let the backward take any ``out`` and ``lse``. The package handles
grouped K/V natively. Its layout is [b, s, heads, d]; ours is [b, heads, s, d], so tensors are
transposed views. Causal is bottom-right aligned (flash-attn >= 2.1), so a slice attends to all
cached keys and its own in one call.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

import torch
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _interface() -> ModuleType | None:
    """flash_attn.flash_attn_interface when it is importable and has the API we call."""
    try:
        from flash_attn import flash_attn_interface
    except Exception:
        return None
    fwd = getattr(flash_attn_interface, "_flash_attn_forward", None)
    if fwd is None or "window_size_left" not in inspect.signature(fwd).parameters:
        return None
    return flash_attn_interface


def _bshd(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


class FlashAttnKernel:
    """Explicit forward/backward through the flash-attn package."""

    name = "flash_attn"
    general_causal = True  # bottom-right aligned causal for any query/key lengths

    def supports(self, q: Tensor, k: Tensor) -> bool:
        d = q.shape[-1]
        return q.is_cuda and q.dtype in _DTYPES and d % 8 == 0 and d <= 256 and _interface() is not None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        fa = _interface()
        out, lse, _, _ = fa._flash_attn_forward(
            _bshd(q), _bshd(k), _bshd(v), 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return _bshd(out), lse[..., : q.shape[2]]

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        fa = _interface()
        q_, k_, v_ = _bshd(q), _bshd(k), _bshd(v)
        dq = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k_.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v_.shape, dtype=v.dtype, device=v.device)
        fa._flash_attn_backward(
            _bshd(dout.to(q.dtype)).contiguous(), q_, k_, v_, _bshd(out.to(q.dtype)).contiguous(),
            lse.float().contiguous(), dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None,
            False, None,
        )  # fmt: skip
        return _bshd(dq), _bshd(dk), _bshd(dv)
