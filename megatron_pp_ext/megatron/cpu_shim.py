"""The CPU shim: two places where megatron-core hard-codes CUDA, made to work without a GPU.

megatron-core 0.16 runs on CPU with gloo except for two things this project needs there:

1. ``torch.cuda.current_device()`` is the allocation device of the DDP grad and param buffers
   (``_ParamAndGradBuffer``) and of the tensor-parallel mappings' gather / reduce-scatter
   outputs (sequence parallelism). On a CPU-only torch it raises; the shim makes it return the
   CPU device.
2. The CUDA RNG tracker's ``fork()`` (entered by the embedding under sequence parallelism, around
   its dropout) swaps CUDA generator states. The shim selects megatron-core's own no-op tracker
   (``initialize_rng_tracker(inference_rng_tracker=True)``); our models have no dropout, so no
   random stream changes.

:func:`install` does nothing when CUDA is available: on a GPU megatron-core runs unchanged. It is
idempotent and process-wide (the tests' and ``train``'s worker processes call it once on CPU).
Nothing else of Megatron is replaced: its DDP, mappings and ``finalize_model_grads`` run as they
are.
"""

from __future__ import annotations

import torch

_installed = False


def cpu_device() -> torch.device:
    return torch.device("cpu")


def install() -> bool:
    """Apply the shim if there is no CUDA device; return whether it is in effect."""
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        from megatron.core.tensor_parallel import random as megatron_random

        torch.cuda.current_device = cpu_device  # type: ignore[assignment]
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        _installed = True
    return True
