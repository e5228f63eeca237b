"""What megatron-core's schedules do around each call of the user's ``forward_step_func``.

A caller that swaps Megatron's schedule for ours expects nothing to change but the schedule, so
every F op calls ``forward_step_func`` the way megatron-core's ``forward_step``
(``pipeline_parallel/schedules.py``) does:

- ``set_is_first_microbatch()`` on the chunk before its first microbatch of the step (honouring
  ``first_val_step`` in forward-only steps, Megatron's ``check_first_val_step``): the one call
  that makes Transformer Engine's layers cast their weights to FP8/FP4 again after an optimizer
  step; without it they keep the stale casts;
- ``set_current_microbatch`` (Megatron's own function) with the microbatch index;
- ``set_input_tensor`` with a list, as Megatron passes it (custom chunks index ``[0]``);
- ``config.enable_autocast``: the call inside ``torch.autocast`` of the chunk's device type
  (Megatron hard-codes "cuda") with ``config.autocast_dtype``;
- the third argument ``checkpoint_activations_microbatch`` when
  ``config.num_microbatches_with_partial_activation_checkpoints`` is set (else two arguments,
  as Megatron calls it): Megatron's rule ``i % max_outstanding >= N`` with ``max_outstanding``
  the most microbatches the schedule keeps in flight at the stage (1F1B: ``p - rank``, as
  Megatron's own);
- after each forward, the loss scales of the mixture-of-experts auxiliary losses
  (``MoEAuxLossAutoScaler``: load balancing, z-loss) and of multi-token prediction
  (``MTPLossAutoScaler``), as ``forward_step_calc_loss`` sets them: their backward reads a class
  attribute, not the graph, so without the call the router's gradients are ``m`` times Megatron's
  (``grad_scale_func(1) x CP / m``, or ``grad_scale_func(1)`` with ``calculate_per_token_loss``);
- ``config.timers``: Megatron's names and log levels (``forward-backward`` 1, ``forward-compute``,
  ``backward-compute``, ``forward-recv``, ``backward-recv``, ``forward-send``, ``backward-send``
  2). W ops count as ``backward-compute``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.pipeline_parallel.schedules import check_first_val_step, set_current_microbatch
from megatron.core.utils import get_attr_wrapped_model

from ..schedule.ir import OpKind, Schedule

__all__ = [
    "ForwardCall",
    "call_forward_step",
    "check_first_val_step",
    "chunk_device",
    "in_flight_limits",
    "set_auxiliary_loss_scales",
    "timed",
]


@dataclass(frozen=True)
class ForwardCall:
    """How an F op calls ``forward_step_func``: the microbatch index Megatron's
    ``set_current_microbatch`` gets, whether it is the chunk's first of the step, and the third
    argument (None: called with two)."""

    microbatch: int
    is_first_microbatch: bool = False
    checkpoint_activations_microbatch: bool | None = None
    # overlapped pairs (expert_overlap.py): the call returns megatron-core's schedule plan, as
    # its combined 1F1B asks for it
    schedule_plan: bool = False


@contextmanager
def timed(config: Any, name: str, log_level: int = 2, barrier: bool | None = None) -> Iterator[None]:
    """Megatron's ``config.timers(name, log_level).start()`` ... ``.stop()`` around the block;
    nothing without timers. ``barrier``: passed to ``start`` as Megatron's forward-backward does."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)
    if barrier is None:
        timer.start()
    else:
        timer.start(barrier=barrier)
    try:
        yield
    finally:
        timers(name).stop()


def chunk_device(chunk: torch.nn.Module) -> torch.device:
    """Where ``chunk``'s parameters live (the CPU for a chunk without any)."""
    return next(chunk.parameters(), torch.empty(0)).device


def call_forward_step(
    forward_step_func: Callable[..., Any],
    data_iterator: Iterator[Any] | None,
    chunk: torch.nn.Module,
    config: Any,
    input_tensor: torch.Tensor | None,
    call: ForwardCall,
) -> tuple[Any, Callable[..., Any] | None]:
    """One call of ``forward_step_func`` on ``chunk`` as Megatron's ``forward_step`` makes it."""
    if call.is_first_microbatch and hasattr(chunk, "set_is_first_microbatch"):
        chunk.set_is_first_microbatch()
    set_current_microbatch(chunk, call.microbatch)
    get_attr_wrapped_model(chunk, "set_input_tensor")([input_tensor])
    if getattr(config, "enable_autocast", False):
        autocast: Any = torch.autocast(chunk_device(chunk).type, dtype=config.autocast_dtype)
    else:
        autocast = nullcontext()
    with autocast:
        if call.schedule_plan:
            model = get_attr_wrapped_model(chunk, "build_schedule_plan", return_model_obj=True)
            return forward_step_func(data_iterator, model, return_schedule_plan=True)
        if call.checkpoint_activations_microbatch is None:
            return forward_step_func(data_iterator, chunk)
        return forward_step_func(data_iterator, chunk, call.checkpoint_activations_microbatch)


def set_auxiliary_loss_scales(config: Any, num_microbatches: int, cp_size: int, device: torch.device) -> None:
    """The MoE auxiliary-loss and MTP loss scales, as megatron-core's ``forward_step_calc_loss``
    sets them after every forward (nothing for a model without experts or MTP layers)."""
    experts = getattr(config, "num_moe_experts", None) is not None
    mtp = getattr(config, "mtp_num_layers", None) is not None
    if not (experts or mtp):
        return
    one = torch.ones(1, device=device)
    grad_scale_func = getattr(config, "grad_scale_func", None)
    loss_scale = grad_scale_func(one) if grad_scale_func is not None else one
    per_token = getattr(config, "calculate_per_token_loss", False)
    if experts:
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        scale = loss_scale if per_token else loss_scale * cp_size / num_microbatches
        MoEAuxLossAutoScaler.set_loss_scale(scale)
    if mtp:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(loss_scale if per_token else loss_scale / num_microbatches)


def in_flight_limits(schedule: Schedule, rank: int) -> dict[int, int]:
    """For each stage of ``rank``: the most microbatches ``schedule`` keeps in flight there
    (forwarded, not yet through all of their backwards), Megatron's ``max_outstanding_backprops``
    of 1F1B (``warm-up + 1``) for any schedule. A schedule without backwards: its microbatches."""
    limits: dict[int, int] = {}
    started: dict[int, set[int]] = {}
    backwards: dict[tuple[int, int], int] = {}
    for op in schedule.ranks[rank]:
        if op.kind == OpKind.F:
            live = started.setdefault(op.stage, set())
            live.add(op.microbatch)
            limits[op.stage] = max(limits.get(op.stage, 0), len(live))
        elif op.kind in (OpKind.B, OpKind.BW):
            count = backwards[(op.stage, op.microbatch)] = backwards.get((op.stage, op.microbatch), 0) + 1
            if count == schedule.slices:
                started[op.stage].discard(op.microbatch)
    return limits


def checkpoint_argument(config: Any, limits: dict[int, int], stage: int, microbatch: int) -> bool | None:
    """Megatron's ``checkpoint_activations_microbatch`` for ``microbatch`` at ``stage`` (None
    without ``num_microbatches_with_partial_activation_checkpoints``)."""
    partial = getattr(config, "num_microbatches_with_partial_activation_checkpoints", None)
    if partial is None:
        return None
    return microbatch % limits[stage] >= partial
