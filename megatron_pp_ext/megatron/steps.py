"""Megatron's forward step and per-token loss for a GPT chunk, as Megatron-LM's pretrain_gpt.py
has them: ``train``, ``bench`` and the pretrain_gpt.py patch all run the same two functions."""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple[Any, Any]:
    """Megatron's forward_step_func contract, as in Megatron-LM's pretrain_gpt.py; with
    ``return_schedule_plan`` (overlapped pairs) the model's schedule plan instead of its output."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = on_this_cp_rank({key: value.to(device) for key, value in batch.items()}, model)
    inputs = (batch["tokens"], batch["position_ids"], None)
    if return_schedule_plan:
        output = model.build_schedule_plan(*inputs, labels=batch["labels"])
    else:
        output = model(*inputs, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def on_this_cp_rank(batch: dict[str, Any], model: Any) -> dict[str, Any]:
    """This context-parallel rank's two pieces of every [b, S] tensor, as Megatron-LM's
    ``get_batch`` cuts them (``get_batch_on_this_cp_rank``). A sliced schedule hands over one
    slice at a time, so each slice is cut this way: the layout the sliced attention expects. A
    model built without CP (``context_parallel_size`` 1 in its config) gets the whole batch."""
    if getattr(get_model_config(model), "context_parallel_size", 1) == 1:
        return batch
    return get_batch_on_this_cp_rank(batch, parallel_state.get_context_parallel_group())


def loss_func(loss_mask: Any, output: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Next-token cross-entropy summed over the unmasked tokens, their count, and a report of
    both, as Megatron-LM's pretrain_gpt: the schedule divides by the count, over the whole
    microbatch even when a sliced schedule runs it slice by slice."""
    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.to(loss.dtype)])}
