"""The same step without a pipeline: every microbatch through the whole model in one process.

This is the yardstick of the exactness tests, written independently of the executor: a plain
loop with Megatron's loss normalisation (``forward_step_calc_loss``) and ``loss.backward()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .stage import ForwardStepFunc


def reference_step(
    model: torch.nn.Module,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any],
    num_microbatches: int,
    forward_only: bool = False,
) -> list[Any]:
    """Run ``num_microbatches`` forward (and backward) passes; return the loss dicts."""
    per_token = getattr(getattr(model, "config", None), "calculate_per_token_loss", False)
    outputs: list[Any] = []
    for _ in range(num_microbatches):
        model.set_input_tensor(None)
        with torch.set_grad_enabled(not forward_only):
            output, loss_func = forward_step_func(data_iterator, model)
            result = loss_func(output)
            if len(result) == 3:
                loss, num_tokens, reduced = result
                if not per_token:
                    loss = loss / torch.clamp(num_tokens, min=1)
                    loss = loss / num_microbatches
            else:
                loss, reduced = result
                loss = loss / num_microbatches
        outputs.append(reduced)
        if not forward_only:
            loss.backward()
    return outputs
