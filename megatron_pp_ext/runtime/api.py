"""Megatron's ``forward_backward_func`` contract on top of :class:`PipelineRuntime`.

``forward_backward(runtime, schedule, **kwargs)`` takes the keyword arguments Megatron's
``get_forward_backward_func()`` functions take and returns the same ``forward_data_store`` (the
loss dicts of the loss rank, an empty list elsewhere), so a hook can hand it to Megatron's
training loop in place of the built-in schedules. Like those schedules it calls
``config.finalize_model_grads_func`` at the end of a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from ..schedule.ir import Schedule
from .executor import PipelineRuntime, ShapeFn
from .forward_contract import timed


def forward_backward(
    runtime: PipelineRuntime,
    schedule: Schedule,
    *,
    forward_step_func: Callable[..., Any],
    data_iterator: Iterator[Any] | Sequence[Iterator[Any] | None] | None,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable[..., Any] | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    gate: Callable[[], bool] | None = None,
) -> list[Any]:
    """Run one step of ``schedule`` with Megatron's arguments; see the module docstring.
    ``gate``: optimizer post-validation's settle of the previous step (``PipelineRuntime.step``)."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(models) != len(runtime.chunks) or any(a is not b for a, b in zip(models, runtime.chunks)):
        raise ValueError("model must be the list of chunks the PipelineRuntime was built with, in order")
    if num_microbatches != schedule.microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} but schedule {schedule.name} was generated for "
            f"{schedule.microbatches}; regenerate it"
        )
    if adjust_tensor_shapes_fn is not None:
        raise ValueError(
            "adjust_tensor_shapes_fn is not supported by megatron_pp_ext's schedules (megatron-core's "
            "interleaved schedule refuses it too): pass None"
        )
    config = get_model_config(models[0])
    with timed(
        config, "forward-backward", log_level=1, barrier=getattr(config, "barrier_with_L1_time", False)
    ):
        shape = message_shape(seq_length, decoder_seq_length, micro_batch_size, config, len(models))
        result = runtime.step(
            schedule,
            forward_step_func,
            data_iterator,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            tensor_shape=shape,
            gate=gate,
            first_val_step=first_val_step,
        )
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is not None and not forward_only:
            num_tokens = None
            if config.calculate_per_token_loss:
                # Megatron broadcasts the count from the last pipeline rank, but a V-shape schedule
                # computes the loss on rank 0: sum it over the pipeline so every rank has it.
                num_tokens = torch.as_tensor(result.num_tokens, dtype=torch.int, device=runtime.device)
                pp_group = pg_collection.pp if pg_collection is not None else None
                if pp_group is None and parallel_state.model_parallel_is_initialized():
                    pp_group = parallel_state.get_pipeline_model_parallel_group()
                torch.distributed.all_reduce(num_tokens, group=pp_group)
            kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
            finalize(models, num_tokens, force_all_reduce=force_all_reduce, **kwargs)
    return result.losses


def message_shape(
    seq_length: int | None,
    decoder_seq_length: int | None,
    micro_batch_size: int | None,
    config: Any,
    chunks: int,
) -> tuple[int, int, int] | ShapeFn:
    """The activation shape between stages, as megatron-core's schedules take it: with one chunk
    per rank ``decoder_seq_length`` when given (its 1F1B's ``get_tensor_shapes``), with several
    ``seq_length`` (its interleaved schedule ignores ``decoder_seq_length``). Without the
    sizes (Megatron's no-pipelining path passes None) a step that sends nothing runs, and the
    first message names what is missing."""
    sequence = decoder_seq_length if chunks == 1 and decoder_seq_length is not None else seq_length
    hidden = getattr(config, "hidden_size", None)
    sizes = {"seq_length": sequence, "micro_batch_size": micro_batch_size, "config.hidden_size": hidden}
    missing = [name for name, value in sizes.items() if value is None]
    if not missing:
        return (int(sequence), int(micro_batch_size), int(hidden))

    def unknown(op: Any) -> tuple[int, int, int]:
        raise ValueError(f"{op} needs the message shape: pass {' and '.join(missing)}")

    return unknown
