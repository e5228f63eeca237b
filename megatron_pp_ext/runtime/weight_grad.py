"""The B/W split: defer weight gradients from the input-gradient pass (B) to a later W op.

Zero-bubble schedules let the previous stage wait only on the input gradient, so a B op must not
spend time on weight-gradient GEMMs. Each model chunk owns a :class:`WeightGradStore`. While the
store is *collecting* (inside a B op), the linear layers of that chunk compute only their input
gradient and push the weight-gradient GEMM (with the tensors it needs) into the store; the W op
of the same unit replays them in order. Parameters that are not in such a linear (norm weights,
the embedding, any module we do not wrap) get their gradient computed at B time by autograd
without accumulation; the store keeps it and adds it at W.

Gradients land where Megatron expects them: ``param.main_grad`` when the parameter has one (DDP
wrapper, gradient-accumulation fusion), otherwise ``param.grad``.

Outside a B op the wrapped linears behave like Megatron's: they return the weight gradient to
autograd (BW ops, plain backward, the single-process reference).

Transformer Engine's linears have their own deferral (``delay_wgrad_compute``, ``backward_dw``);
the store drives it through :class:`~.te_wgrad.TELinears`, so a TE chunk splits B and W too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import Tensor

from .te_wgrad import TELinears

Key = Any  # what one B op defers: the executor uses (microbatch, slice)


def accumulate_grad(param: Tensor, grad: Tensor) -> None:
    """Add ``grad`` where Megatron's optimizer will look for it."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad.to(main_grad.dtype))
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad.to(param.grad.dtype))


def run_backward(
    output: Tensor, grad: Tensor | None, inputs: Sequence[Tensor] = (), accumulate: bool = False
) -> tuple[Tensor | None, ...]:
    """Backward from ``output`` through the C++ engine, like Megatron's ``custom_backward``:
    the output may have been pseudo-freed (``.data`` replaced), so shapes are not checked.

    With ``accumulate`` the gradients go into ``.grad`` of every leaf (a classic backward);
    without, the gradients of ``inputs`` are returned and nothing is accumulated."""
    if grad is None:
        grad = torch.ones_like(output)
    return torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=accumulate,
    )


@dataclass
class DeferredGrad:
    """One weight-gradient contribution: ``compute()`` returns the gradient of ``param``.

    ``tensors`` are what the closure keeps alive (for activation accounting)."""

    param: Tensor
    compute: Callable[[], Tensor]
    tensors: tuple[Tensor, ...]


class WeightGradStore:
    """Per-chunk store of deferred weight gradients, grouped by the B op that deferred them.

    ``on_hold``/``on_release`` let an activation meter see what the store keeps alive."""

    def __init__(self) -> None:
        self._collecting: list[DeferredGrad] | None = None
        self._pending: OrderedDict[Key, list[DeferredGrad]] = OrderedDict()
        self.on_hold: Callable[[Key, Sequence[Tensor]], None] | None = None
        self.on_release: Callable[[Key], None] | None = None
        self.te: TELinears | None = None  # the chunk's deferring TE linears (attach_store)

    @property
    def deferring(self) -> bool:
        return self._collecting is not None

    @contextmanager
    def collect(self, key: Key) -> Iterator[list[DeferredGrad]]:
        """Everything deferred inside the block belongs to ``key`` (one B op)."""
        if self._collecting is not None:
            raise RuntimeError("WeightGradStore.collect is not reentrant")
        if key in self._pending:
            raise RuntimeError(f"weight gradients for {key} were already deferred and not yet applied")
        te = self.te
        queued = te.queued() if te else []
        collected: list[DeferredGrad] = []
        self._collecting = collected
        try:
            with te.deferring() if te else nullcontext():
                yield collected
        finally:
            self._collecting = None
        held = te.deferred(key, queued) if te else []
        self._pending[key] = collected
        if self.on_hold is not None:
            self.on_hold(key, [t for item in collected for t in item.tensors] + held)

    def forwarding(self) -> AbstractContextManager[None]:
        """Around a forward whose backward may be a B: TE's linears decide at the forward already
        whether a backward may defer (our own linears decide at the backward)."""
        return self.te.deferring() if self.te else nullcontext()

    def defer(self, item: DeferredGrad) -> None:
        if self._collecting is None:
            raise RuntimeError("defer() called outside collect()")
        self._collecting.append(item)

    def add(self, key: Key, param: Tensor, grad: Tensor) -> None:
        """Keep an already computed gradient of ``key``'s B until its W (norms, embedding)."""
        self._pending[key].append(DeferredGrad(param, lambda: grad, (grad,)))
        if self.on_hold is not None:
            self.on_hold(key, (grad,))

    def apply(self, key: Key) -> None:
        """The W op: compute and accumulate every weight gradient ``key``'s B deferred, in order."""
        items = self._pending.pop(key, None)
        if items is None:
            raise RuntimeError(f"W for {key}: no deferred weight gradients (did its B run as BW?)")
        with torch.no_grad():  # gradients are values, not graph: keep no GEMM input alive
            for item in items:
                accumulate_grad(item.param, item.compute())
            if self.te:
                self.te.apply(key, accumulate_grad)
        if self.on_release is not None:
            self.on_release(key)

    def pending(self) -> list[Key]:
        return list(self._pending)

    def clear(self) -> None:
        if self.te:
            self.te.drop()
        for key in list(self._pending):
            self._pending.pop(key)
            if self.on_release is not None:
                self.on_release(key)


class _DeferrableLinearFunction(torch.autograd.Function):
    """``y = x W^T (+ b)`` whose backward defers dW (and db) when the store is collecting.

    Tensor parallel like Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``: with
    ``sequence_parallel`` the input is all-gathered along the sequence (dim 0) over the TP group
    in the forward and again in the backward (only this rank's share is saved), and the input
    gradient is reduce-scattered; with ``allreduce_dgrad`` (TP without SP) the input gradient is
    all-reduced. A deferred weight gradient keeps only this rank's share of the input and gathers
    it again in W (as Megatron's own backward re-gathers it), so the B/W split costs no more
    memory under SP than Megatron's schedules do. Every TP rank of a stage runs the same op list,
    so these collectives come in the same order on all of them, in B as in W."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # like Megatron's linear: no-op without CUDA autocast
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        store: WeightGradStore,
        tp: _TensorParallel,
    ) -> Tensor:
        # The parameter itself goes on ctx, not through save_for_backward: saved-tensor hooks
        # (activation accounting) would hand back an alias, and W must accumulate into the
        # parameter object. Parameters are not activations and do not change before W.
        ctx.save_for_backward(x)
        ctx.weight = weight
        ctx.bias = bias
        ctx.store = store
        ctx.tp = tp
        total = _gather_sequence(x, tp.group) if tp.sequence_parallel else x
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        tp: _TensorParallel = ctx.tp
        grad_in = grad_out.matmul(weight)
        if tp.sequence_parallel:
            grad_in = _reduce_scatter_sequence(grad_in, tp.group)
        elif tp.allreduce_dgrad:
            torch.distributed.all_reduce(grad_in, group=tp.group)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        store: WeightGradStore = ctx.store
        bias = ctx.bias
        if store.deferring:  # W gathers again: only this rank's sequence share waits for it
            if tp.output_sequence_parallel:
                # A row-parallel linear under SP: its output gradient is the all-gather of the
                # next op's, the same on every TP rank; keep one share, W gathers it back.
                share = grad_out.chunk(tp.group.size(), dim=0)[tp.group.rank()].clone()  # own storage
                store.defer(DeferredGrad(weight, lambda: _weight_grad_gathered(share, x, tp), (share, x)))
            else:
                store.defer(DeferredGrad(weight, lambda: _weight_grad(g2, x, tp), (g2, x)))
            if bias is not None:
                store.defer(DeferredGrad(bias, lambda: g2.sum(dim=0), (g2,)))
            return grad_in, None, None, None, None
        grad_w = _weight_grad(g2, x, tp)
        grad_b = g2.sum(dim=0) if bias is not None else None
        return grad_in, grad_w, grad_b, None, None


@dataclass(frozen=True)
class _TensorParallel:
    """What Megatron's linear passes to its ``_forward_impl`` about tensor parallelism."""

    sequence_parallel: bool = False  # gather the input along the sequence (column-parallel)
    allreduce_dgrad: bool = False
    group: Any = None
    output_sequence_parallel: bool = False  # the output is reduce-scattered (row-parallel under SP)


def _weight_grad(grad_out_2d: Tensor, x: Tensor, tp: _TensorParallel) -> Tensor:
    """dW = dY^T X, with X gathered over the sequence first under SP."""
    total = _gather_sequence(x, tp.group) if tp.sequence_parallel else x
    return grad_out_2d.t().matmul(total.reshape(-1, total.shape[-1]))


def _weight_grad_gathered(grad_out_share: Tensor, x: Tensor, tp: _TensorParallel) -> Tensor:
    """dW = dY^T X of a row-parallel linear under SP, dY gathered over the sequence first."""
    grad_out = _gather_sequence(grad_out_share, tp.group)
    return _weight_grad(grad_out.reshape(-1, grad_out.shape[-1]), x, tp)


def _gather_sequence(x: Tensor, group: Any) -> Tensor:
    """All-gather along dim 0 (the sequence) over the TP group, on ``x``'s device."""
    size = group.size()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_sequence(x: Tensor, group: Any) -> Tensor:
    """Sum over the TP group and keep this rank's share of dim 0 (the sequence)."""
    size = group.size()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    torch.distributed.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _tensor_parallel(module: torch.nn.Module, kwargs: dict[str, Any]) -> _TensorParallel:
    """How the linear's forward talks over its tensor-parallel group, as megatron-core's forward
    decides: a row-parallel output is reduce-scattered under sequence parallelism unless the
    linear is an expert's whose dispatcher moves the tokens (``explicit_expert_comm``); the
    group is the linear's own (an expert's is the expert-TP group)."""
    sequence_parallel = bool(kwargs.get("sequence_parallel"))
    allreduce_dgrad = bool(kwargs.get("allreduce_dgrad"))
    output_sequence_parallel = (
        isinstance(module, RowParallelLinear)
        and bool(getattr(module, "sequence_parallel", False))
        and not getattr(module, "explicit_expert_comm", False)
    )
    group = kwargs.get("tp_group") or getattr(module, "tp_group", None)
    if (sequence_parallel or allreduce_dgrad or output_sequence_parallel) and group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return _TensorParallel(sequence_parallel, allreduce_dgrad, group, output_sequence_parallel)


def _check_local(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("gradient_accumulation_fusion") and not hasattr(module.weight, "main_grad"):
        raise ValueError("gradient_accumulation_fusion needs the DDP wrapper's main_grad buffers")


def _deferrable_forward_impl(
    module: torch.nn.Module,
    base_impl: Callable[..., Tensor],
    x: Tensor,
    weight: Tensor,
    *args: Any,
    **kwargs: Any,
) -> Tensor:
    store: WeightGradStore | None = getattr(module, "wgrad_store", None)
    if store is None or not weight.requires_grad:
        return base_impl(x, weight, *args, **kwargs)
    _check_local(module, kwargs)
    bias = kwargs.get("bias", args[0] if args else None)
    return _DeferrableLinearFunction.apply(x, weight, bias, store, _tensor_parallel(module, kwargs))


class DeferrableColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ColumnParallelLinear whose weight gradient can be deferred to a W op."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:  # noqa: A002
        return _deferrable_forward_impl(self, super()._forward_impl, input, weight, *args, **kwargs)


class DeferrableRowParallelLinear(RowParallelLinear):
    """Megatron's RowParallelLinear whose weight gradient can be deferred to a W op."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:  # noqa: A002
        return _deferrable_forward_impl(self, super()._forward_impl, input, weight, *args, **kwargs)


_DEFERRABLE = {
    ColumnParallelLinear: DeferrableColumnParallelLinear,
    RowParallelLinear: DeferrableRowParallelLinear,
}


def attach_store(chunk: torch.nn.Module, store: WeightGradStore | None) -> list[Tensor]:
    """Connect every Megatron linear of ``chunk`` to ``store``; return the parameters that are NOT
    covered (their gradients are computed at B and kept until W). ``store`` None disconnects
    them: the linears then run Megatron's own autograd function (no W op to defer to).

    GPTModel builds its output layer as a plain ColumnParallelLinear whatever the layer spec says,
    so plain Megatron linears are switched to the deferrable subclass here (it adds no state).
    Transformer Engine linears built with ``delay_wgrad_compute`` are covered through
    ``store.te``; without a store their deferral stays off, and with one a TE linear built
    without it is refused (its full weight gradient would be computed in B)."""
    te = TELinears(chunk, deferring=store is not None)
    covered: set[int] = {id(weight) for weight in te.covered()} if store is not None else set()
    for module in chunk.modules():
        if type(module) in _DEFERRABLE:
            module.__class__ = _DEFERRABLE[type(module)]
        if isinstance(module, (DeferrableColumnParallelLinear, DeferrableRowParallelLinear)):
            module.wgrad_store = store
            if module.weight is not None:
                covered.add(id(module.weight))
    if store is None:
        return []
    store.te = te if te else None
    # Biases stay "uncovered": a bias added inside the linear is deferred by the linear (autograd
    # then reports no gradient for it at B), one added outside it gets its gradient at B.
    return [p for p in chunk.parameters() if p.requires_grad and id(p) not in covered]
