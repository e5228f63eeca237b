"""Model chunks under megatron-core's ``DistributedDataParallel``, configured as Megatron-LM does.

:func:`wrap_chunks` wraps each chunk in megatron-core's DDP (grad buffers with ``main_grad``, the
bucket layout of the distributed optimizer when asked) and sets the model config's schedule
contract as Megatron-LM's ``training.py`` sets it: ``no_sync_func`` and ``grad_sync_func`` per
chunk with ``overlap_grad_reduce``, ``param_sync_func`` with ``overlap_param_gather`` and
``align_param_gather``, and ``finalize_model_grads_func``. The runtime honours all of them (see
``runtime/grad_sync.py``). On CPU the CUDA shim (``cpu_shim.py``) lets DDP allocate its buffers;
ranks sharing a GPU under gloo reduce through host memory (``gloo_on_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.utils import get_model_config

from . import cpu_shim, gloo_on_gpu


def wrap_chunks(
    chunks: Sequence[torch.nn.Module],
    ddp_config: DistributedDataParallelConfig | None = None,
    align_grad_reduce: bool = True,
    align_param_gather: bool = False,
) -> list[DistributedDataParallel]:
    """Each chunk in Megatron's DDP (bucketing on the first chunk only, as Megatron-LM's
    ``get_model``), and the config fields Megatron-LM's training loop sets."""
    cpu_shim.install()
    gloo_on_gpu.install_where_needed()  # ranks sharing a GPU: reductions through host memory
    ddp_config = ddp_config or DistributedDataParallelConfig()
    wrapped = [
        DistributedDataParallel(
            config=get_model_config(chunk), ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(chunks)
    ]
    configure_sync(wrapped, ddp_config, align_grad_reduce, align_param_gather)
    return wrapped


def configure_sync(
    model: Sequence[Any],
    ddp_config: DistributedDataParallelConfig,
    align_grad_reduce: bool = True,
    align_param_gather: bool = False,
) -> None:
    """Megatron-LM's ``training.py`` setup of the schedule contract, on chunk 0's config (the one
    the schedules read); ``align_*`` are Megatron-LM's flags of those names (defaults as there)."""
    config = get_model_config(model[0])

    def one_or_list(funcs: list[Any]) -> Any:
        return funcs[0] if len(funcs) == 1 else funcs

    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = one_or_list([chunk.no_sync for chunk in model])
        if align_grad_reduce:
            config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in model])
    if ddp_config.overlap_param_gather and align_param_gather:
        config.param_sync_func = one_or_list([chunk.start_param_sync for chunk in model])
    config.finalize_model_grads_func = finalize_model_grads


def zero_grad_buffers(model: Sequence[Any]) -> None:
    """What Megatron-LM's ``train_step`` does before each step: clear the grad buffers."""
    for chunk in model:
        chunk.zero_grad_buffer()
