"""A test double of Transformer Engine's deferred weight gradient, for CPU tests of our W pass.

TE does not install without CUDA, so the runtime's TE path (``runtime/te_wgrad.py``) is tested
against this double of TE's contract, as read in TE 2.3 and 2.20 (``module/_common.py``'s
``WeightGradStore``, ``module/base.py``'s ``backward_dw``, ``module/linear.py``'s backward):

- the store has a queue only when built with ``delay_wgrad_compute``, and ``put``/``pop`` assert
  that it is enabled; ``enable_``/``disable_delay_wgrad_compute`` switch it;
- the forward hands the store to its backward only when deferral is enabled at the forward; the
  backward defers (queues ``[input, grad_output]`` and the GEMM) only when it is enabled then too,
  and then returns no weight gradient; under gradient-accumulation fusion it always returns a
  dummy one (uninitialised memory in TE, NaN here), the gradient being in ``main_grad``;
- ``backward_dw`` pops the oldest entry: it *sets* ``weight.grad`` (no accumulation) or, with
  fusion, adds into ``main_grad`` inside the GEMM.

It replaces nothing of megatron-core or TE at run time; the GPU phase ``bw-split`` of
``scripts/gpu_validate.sh`` runs the real TE linears.
"""

from __future__ import annotations

import queue
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class DoubleStore:
    """TE's ``WeightGradStore``: a first-in first-out queue of deferred weight-gradient GEMMs."""

    def __init__(self, delay_wgrad_compute: bool) -> None:
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = delay_wgrad_compute

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    def put(self, tensor_list: list[torch.Tensor], func: Any) -> None:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self) -> Any:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        tensor_list, func = self.context.get_nowait()  # queue.Empty: TE raises "Pop empty queue"
        return func(*tensor_list), tensor_list


class _DoubleLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: Any, store: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module = module
        ctx.store = store
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        module = ctx.module
        grad_in = grad_out.matmul(weight)

        def wgrad_gemm(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
            wgrad = dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
            if module.fuse_wgrad_accumulation:
                module.weight.main_grad.add_(wgrad)
            return wgrad, None

        if ctx.store is not None and ctx.store.delay_wgrad_compute():
            ctx.store.put([x, grad_out], wgrad_gemm)
            wgrad = None
        else:
            wgrad, _ = wgrad_gemm(x, grad_out)
        if module.fuse_wgrad_accumulation:  # TE's dummy (uninitialised memory): main_grad has it
            wgrad = torch.full_like(weight, float("nan"))
        return grad_in, wgrad, None, None


class DoubleTELinear:
    """Mixed into Megatron's Column/RowParallelLinear: a TE linear as far as our runtime sees."""

    weight_names = ("weight",)
    bias_names = ()
    fuse_wgrad_accumulation = False

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        assert kwargs.get("bias", args[0] if args else None) is None, "the double has no bias"
        store = self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None
        return _DoubleLinear.apply(input, weight, self, store)

    def backward_dw(self) -> None:
        if self.wgrad_store is None or not self.wgrad_store.delay_wgrad_compute():
            return
        (wgrad, _), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            self.weight.grad = wgrad.to(self.weight.dtype)


class DoubleTEColumn(DoubleTELinear, ColumnParallelLinear):
    pass


class DoubleTERow(DoubleTELinear, RowParallelLinear):
    pass


def make_te_doubles(chunk: torch.nn.Module, delay_wgrad_compute: bool = True, fused: bool = False) -> int:
    """Turn the linears of ``chunk``'s transformer layers into TE doubles (the output layer stays
    Megatron's, as in megatron-core's TE spec); return how many."""
    count = 0
    for name, module in chunk.named_modules():
        if not name.startswith("decoder.layers."):
            continue
        for plain, double in ((ColumnParallelLinear, DoubleTEColumn), (RowParallelLinear, DoubleTERow)):
            if isinstance(module, plain):
                module.__class__ = double
                module.wgrad_store = DoubleStore(delay_wgrad_compute)
                module.fuse_wgrad_accumulation = fused
                if fused:
                    module.weight.main_grad = torch.zeros_like(module.weight)
                count += 1
                break
    return count


def stand_in_te_version(monkeypatch: Any, version: str) -> None:
    """Have megatron-core's TE version lookup (``get_te_version``, ``is_te_min_version``) report
    an installed TE of ``version``, for the tests of the version refusal."""
    from megatron.core import utils
    from packaging.version import Version

    monkeypatch.setattr(utils, "get_te_version", lambda: Version(version))
    monkeypatch.setattr(utils, "is_te_min_version", lambda v, **_: Version(version) >= Version(v))
