"""Compute ops of one model chunk (virtual stage): F, B, W and BW, through Megatron's contract.

A forward calls ``chunk.set_input_tensor([input])`` and then the user's
``forward_step_func(data_iterator, chunk) -> (output, loss_func)``, as Megatron's
``forward_step`` does (``forward_contract.py``: first-microbatch, autocast, ...); on the last stage
``loss_func(output)`` returns ``(loss, num_tokens, reduced)`` or ``(loss, reduced)`` and the loss
is normalised like Megatron's ``forward_step`` (by tokens unless ``calculate_per_token_loss``,
and by the number of microbatches). The runner keeps what each unit needs until its backward.
With sequence slices the loss of each slice is normalised at its backward over the whole
microbatch's tokens (see ``slicing.py``); under context parallelism over the tokens of all CP
ranks (see ``context_parallel.py``). With overlapped pairs (a ``lane``) the chunk runs through
megatron-core's schedule plan, and the F of a pair runs the B of its partner beside it
(``expert_overlap.py``: :meth:`StageRunner.begin_backward`, the F with ``partner``,
:meth:`StageRunner.end_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from .context_parallel import tokens_on_all_cp_ranks
from .expert_overlap import CommLane, run_plans
from .forward_contract import ForwardCall, call_forward_step, chunk_device, set_auxiliary_loss_scales
from .memory import ActivationMeter, Hold
from .offload import OffloadEngine, saving
from .slicing import SliceLosses, combine_reports, sliced_loss
from .weight_grad import WeightGradStore, attach_store, run_backward

Key = tuple[int, int]  # (microbatch, slice)
ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any] | None]]


def deallocate(tensor: Tensor) -> None:
    """Megatron's ``deallocate_output_tensor``: keep ``grad_fn``, drop the storage."""
    if tensor._base is None and tensor.numel() > 1:
        tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


@dataclass
class LossRecord:
    """What the loss stage collects over a step (Megatron's forward_data_store and token count)."""

    outputs: dict[int, Any] = field(default_factory=dict)  # microbatch -> loss_reduced
    num_tokens: int | Tensor = 0
    slices: dict[int, SliceLosses] = field(default_factory=dict)  # microbatch -> its slices so far


def _list_slice_output(
    microbatch: int, output: Any, loss_func: Callable[..., Any] | None, losses: LossRecord
) -> None:
    """Without a loss (or collecting non-loss data): a slice's output, or its non-loss data, listed."""
    value = output if loss_func is None else loss_func(output, non_loss_data=True)
    losses.outputs.setdefault(microbatch, []).append(value)


def _add_slice_report(microbatch: int, result: Any, losses: LossRecord) -> tuple[Any, SliceLosses]:
    """A slice's ``loss_func`` result added to its microbatch's: (the slice's raw loss, the parts)."""
    loss, num_tokens, report = sliced_loss(result)
    parts = losses.slices.setdefault(microbatch, SliceLosses())
    parts.add(num_tokens, report)
    losses.num_tokens = losses.num_tokens + num_tokens
    return loss, parts


def _close_slice_report(microbatch: int, parts: SliceLosses, losses: LossRecord) -> None:
    """All slices in: the microbatch's one report (their reports summed)."""
    losses.outputs[microbatch] = combine_reports(parts.reports)
    del losses.slices[microbatch]


@dataclass
class _Unit:
    input: Tensor | None
    output: Tensor
    holds: list[Hold]
    normalise: Callable[[Tensor], Tensor] | None = None  # a slice's loss, scaled at backward
    plan: Any = None  # megatron-core's schedule plan of the unit (overlapped pairs)
    plan_output: Tensor | None = None  # the last stage's: the plan's output, the loss's leaf


@dataclass
class PendingBackward:
    """A B (or BW) of a pair, begun: its plan and the gradient it starts from, run beside its
    partner's forward inside ``context`` (the weight-gradient store collecting for a B)."""

    key: Key
    unit: _Unit
    grad: Tensor | None
    context: AbstractContextManager[Any]


class StageRunner:
    """Runs F/B/W/BW of one chunk; holds the chunk's stashed units and its weight-gradient store."""

    def __init__(
        self,
        chunk: torch.nn.Module,
        stage: int,
        num_stages: int,
        config: Any,
        meter: ActivationMeter,
        store: WeightGradStore | None,
        num_slices: int = 1,
        offload: OffloadEngine | None = None,
        cp_group: Any = None,
        vocab_parallel: bool = False,
        lane: CommLane | None = None,
    ) -> None:
        """``lane``: overlapped pairs are on (``expert_overlap.py``): every F and B of the chunk
        runs through megatron-core's schedule plan, the all-to-alls on the lane.
        ``cp_group``: the context-parallel group (None: no CP), for the loss normalisation.
        ``vocab_parallel``: the output layer and loss run as the schedule's vocabulary ops, so a
        last stage's output is its final hidden state, its backward takes the output gradient
        like a middle stage, and its ``loss_func`` is kept (``loss_funcs``) for the report."""
        self.chunk = chunk
        self.lane = lane
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
        self.offload = offload
        self.num_slices = num_slices
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.computes_loss = self.is_last and not vocab_parallel
        self.loss_funcs: dict[Key, Callable[..., Any] | None] = {}  # vocabulary parallel: F -> report
        self.config = config
        self.meter = meter
        # None: no op of this stage defers W, and the chunk's linears run as Megatron's own
        self.store = store
        self.uncovered = attach_store(chunk, store)
        self._units: dict[Key, _Unit] = {}
        self._w_holds: dict[Key, list[Hold]] = {}
        if store is not None:
            store.on_hold = lambda key, tensors: self._w_holds.setdefault(key, []).extend(
                meter.hold_all(tensors)
            )
            store.on_release = lambda key: [h.release() for h in self._w_holds.pop(key, [])]

    # ---- F -----------------------------------------------------------------------------------

    def forward(
        self,
        key: Key,
        input_tensor: Tensor | None,
        forward_step_func: ForwardStepFunc,
        data_iterator: Iterator[Any] | None,
        num_microbatches: int,
        losses: LossRecord,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        fed_input: Tensor | None = None,
        call: ForwardCall | None = None,
        partner: PendingBackward | None = None,
    ) -> Tensor | None:
        """Run the forward of ``key``; return the output to hand to the next stage (None on the
        last stage, unless the loss is vocabulary parallel). ``fed_input``: a leaf the chunk
        reads by other means (the vocabulary-parallel word embedding), kept as the unit's input
        so that its backward returns the leaf's gradient. ``call``: how Megatron would call
        ``forward_step_func`` for it (``forward_contract.py``; default: the microbatch, not first).
        ``partner``: the begun backward of the pair this F belongs to, run beside it."""
        if fed_input is not None:
            input_tensor = fed_input
        elif input_tensor is not None and not forward_only:
            input_tensor = input_tensor.detach().requires_grad_(True)
        call = call or ForwardCall(key[0])
        by_plan = self.lane is not None and not forward_only
        if by_plan:
            call = replace(call, schedule_plan=True)
        given = None if fed_input is not None else input_tensor
        plan, plan_output = None, None
        if forward_only:
            with torch.no_grad():
                output, loss_func = call_forward_step(
                    forward_step_func, data_iterator, self.chunk, self.config, given, call
                )
        else:
            deferring = self.store.forwarding() if self.store is not None else nullcontext()
            with saving(self.offload, self.meter, (self.stage, *key), input_tensor) as input_hold, deferring:
                output, loss_func = call_forward_step(
                    forward_step_func, data_iterator, self.chunk, self.config, given, call
                )
                if by_plan:
                    plan, output = output, self._run_plan(output, partner)
        if by_plan and self.is_last:  # the loss gets a graph of its own, as megatron-core's loss node
            output = plan_output = output.detach().requires_grad_(True)
        set_auxiliary_loss_scales(self.config, num_microbatches, self.cp_size, chunk_device(self.chunk))
        normalise = None
        if self.is_last and not self.computes_loss:
            self.loss_funcs[key] = loss_func
        elif self.is_last and self.num_slices > 1:
            output, normalise = self._slice_loss(
                key, output, loss_func, num_microbatches, losses, collect_non_loss_data
            )
        elif self.is_last:
            output = self._loss(key[0], output, loss_func, num_microbatches, losses, collect_non_loss_data)
        if not forward_only:
            self._units[key] = _Unit(input_tensor, output, [input_hold], normalise, plan, plan_output)
        return None if self.computes_loss else output

    def _run_plan(self, plan: Any, partner: PendingBackward | None) -> Tensor:
        """The F's plan forward, with the partner's backward beside it."""
        assert self.lane is not None
        if partner is None:
            return run_plans(plan, None, None, self.lane)
        with partner.context:
            return run_plans(plan, partner.unit.plan, partner.grad, self.lane)

    def _normalise(self, result: Any, num_microbatches: int) -> tuple[Any, Any, Any]:
        """Megatron's normalisation of ``loss_func``'s result: (loss, token count or None, report)."""
        if len(result) == 3:
            loss, num_tokens, reduced = result
            if not getattr(self.config, "calculate_per_token_loss", False):
                if self.cp_group is None:
                    loss /= torch.clamp(num_tokens, min=1)
                else:
                    loss /= torch.clamp(tokens_on_all_cp_ranks(num_tokens, self.cp_group, loss.device), min=1)
                    loss *= self.cp_size  # DDP averages over DP x CP
                loss /= num_microbatches
            return loss, num_tokens, reduced
        loss, reduced = result
        loss *= self.cp_size  # Megatron's legacy form: a local average
        loss /= num_microbatches
        return loss, None, reduced

    def loss_gradient(
        self,
        loss_func: Callable[..., Any],
        batch_shape: Sequence[int],
        dtype: torch.dtype,
        device: Any,
        num_microbatches: int,
    ) -> Tensor:
        """g = dLoss/dloss_token [b, s], through ``loss_func``, Megatron's normalisation and the
        grad scale, for vocabulary parallelism (S and T need it before the loss exists). Megatron's
        loss is linear in the per-token losses, so the gradient at zero is the gradient."""
        probe = torch.zeros(tuple(batch_shape), dtype=dtype, device=device, requires_grad=True)
        with torch.enable_grad():
            loss, _, _ = self._normalise(loss_func(probe), num_microbatches)
            scale = getattr(self.config, "grad_scale_func", None)
            if scale is not None:
                loss = scale(loss)
            (grad,) = torch.autograd.grad(loss, probe, allow_unused=True)
        return torch.zeros_like(probe) if grad is None else grad.detach()

    def report_loss(
        self,
        key: Key,
        per_token: Tensor,
        num_microbatches: int,
        losses: LossRecord,
        collect_non_loss_data: bool = False,
    ) -> None:
        """Vocabulary parallel: the unit's loss report from the per-token losses that REDUCE_S
        gave, through the ``loss_func`` its forward returned (as :meth:`_loss` does)."""
        loss_func = self.loss_funcs.pop(key)
        if self.num_slices == 1:
            self._loss(key[0], per_token, loss_func, num_microbatches, losses, collect_non_loss_data)
            return
        microbatch = key[0]  # a slice (T runs them in any order): one report once all are in
        if loss_func is None or collect_non_loss_data:
            _list_slice_output(microbatch, per_token, loss_func, losses)
            return
        _, parts = _add_slice_report(microbatch, loss_func(per_token), losses)
        if len(parts.reports) == self.num_slices:
            _close_slice_report(microbatch, parts, losses)

    def _loss(
        self,
        microbatch: int,
        output: Any,
        loss_func: Callable[..., Any] | None,
        num_microbatches: int,
        losses: LossRecord,
        collect_non_loss_data: bool,
    ) -> Any:
        """Megatron's ``forward_step_calc_loss``; under CP the count is that of all CP ranks
        (exact where Megatron's local count is not, see ``context_parallel.py``)."""
        if loss_func is None:
            losses.outputs[microbatch] = output
            return output
        if collect_non_loss_data:
            losses.outputs[microbatch] = loss_func(output, non_loss_data=True)
            return output
        loss, num_tokens, reduced = self._normalise(loss_func(output), num_microbatches)
        if num_tokens is not None:
            losses.num_tokens = losses.num_tokens + num_tokens
        losses.outputs[microbatch] = reduced
        return loss

    def _slice_loss(
        self,
        key: Key,
        output: Any,
        loss_func: Callable[..., Any] | None,
        num_microbatches: int,
        losses: LossRecord,
        collect_non_loss_data: bool,
    ) -> tuple[Any, Callable[[Tensor], Tensor] | None]:
        """The loss of one slice: its raw sum now, normalised over the whole microbatch at
        backward; one report per microbatch (the slices' reports summed) after its last slice.
        Without a loss function the outputs (or non-loss data) of the slices are listed."""
        microbatch, index = key
        last = index == self.num_slices - 1
        if loss_func is None or collect_non_loss_data:
            _list_slice_output(microbatch, output, loss_func, losses)
            return output, None
        loss, parts = _add_slice_report(microbatch, loss_func(output), losses)
        if last:
            _close_slice_report(microbatch, parts, losses)
        per_token = getattr(self.config, "calculate_per_token_loss", False)
        if last and self.cp_group is not None and not per_token:
            parts.total = tokens_on_all_cp_ranks(parts.num_tokens, self.cp_group, loss.device)
        if per_token:
            return loss, None
        return loss, parts.normaliser(num_microbatches, self.cp_size)

    # ---- B, W, BW ----------------------------------------------------------------------------

    def _output_and_grad(self, unit: _Unit, output_grad: Tensor | None) -> tuple[Tensor, Tensor | None]:
        output = unit.output
        if self.computes_loss:
            if unit.normalise is not None:
                output = unit.normalise(output)
            scale = getattr(self.config, "grad_scale_func", None)
            if scale is not None:
                output = scale(output)
            return output, None
        if output_grad is None:
            raise RuntimeError(f"stage {self.stage}: backward needs the output gradient of the next stage")
        return output, output_grad

    def backward(self, key: Key, output_grad: Tensor | None, split: bool) -> Tensor | None:
        """BW (``split=False``): classic backward, weight gradients accumulated now. B
        (``split=True``): only the input gradient now; weight gradients are deferred to W.
        Returns the gradient of the stage input (None on the first stage)."""
        if self._units[key].plan is not None:
            pending = self.begin_backward(key, output_grad, split)
            assert self.lane is not None
            with pending.context:
                run_plans(None, pending.unit.plan, pending.grad, self.lane)
            return self.end_backward(pending)
        unit = self._units.pop(key)
        output, grad = self._output_and_grad(unit, output_grad)
        if not output.requires_grad:
            input_grad = None
        elif not split:
            run_backward(output, grad, accumulate=True)
            input_grad = None if unit.input is None else unit.input.grad
        else:
            inputs = ([unit.input] if unit.input is not None else []) + self.uncovered
            with self.store.collect(key):
                grads = run_backward(output, grad, inputs)
            first = 1 if unit.input is not None else 0
            input_grad = grads[0] if unit.input is not None else None
            for param, param_grad in zip(self.uncovered, grads[first:]):
                if param_grad is not None:
                    self.store.add(key, param, param_grad)
        for hold in unit.holds:
            hold.release()
        return input_grad

    def begin_backward(self, key: Key, output_grad: Tensor | None, split: bool) -> PendingBackward:
        """A backward through the unit's schedule plan, up to the plan: the gradient it starts
        from (on the last stage: the loss's, at the plan's output) and the context it runs in."""
        unit = self._units.pop(key)
        output, grad = self._output_and_grad(unit, output_grad)
        if unit.plan_output is not None:  # through the loss to the plan's output
            (grad,) = run_backward(output, grad, [unit.plan_output])
        context = self.store.collect(key) if split else nullcontext()
        return PendingBackward(key, unit, grad, context)

    def end_backward(self, pending: PendingBackward) -> Tensor | None:
        """After the plan's backward ran: the input gradient; the unit's holds released."""
        unit = pending.unit
        for hold in unit.holds:
            hold.release()
        return None if unit.input is None else unit.input.grad

    def weight(self, key: Key) -> None:
        """W: apply the weight gradients that B of ``key`` deferred."""
        self.store.apply(key)

    def leftover(self) -> list[str]:
        """Units still stashed or with pending weight gradients (should be none after a step)."""
        return (
            [f"stage {self.stage} unit {k} has no backward yet" for k in self._units]
            + [
                f"stage {self.stage} unit {k} has no W yet"
                for k in (self.store.pending() if self.store else [])
            ]
            + [f"stage {self.stage} unit {k} has no loss report yet" for k in self.loss_funcs]
        )

    def discard(self) -> None:
        """Drop everything held (after a failed step)."""
        for unit in self._units.values():
            for hold in unit.holds:
                hold.release()
        self._units.clear()
        self.loss_funcs.clear()
        if self.store is not None:
            self.store.clear()
