"""The CPU shim: the places where megatron-core hard-codes CUDA, made to work without a GPU.

megatron-core 0.16 runs on CPU with gloo except for these things this project needs there:

1. ``torch.cuda.current_device()`` is the allocation device of the DDP grad and param buffers
   (``_ParamAndGradBuffer``) and of the tensor-parallel mappings' gather / reduce-scatter
   outputs (sequence parallelism). On a CPU-only torch it raises; the shim makes it return the
   CPU device.
2. The CUDA RNG tracker's ``fork()`` (entered by the embedding under sequence parallelism, around
   its dropout) swaps CUDA generator states. The shim selects megatron-core's own no-op tracker
   (``initialize_rng_tracker(inference_rng_tracker=True)``); our models have no dropout, so no
   random stream changes.
3. The alltoall token dispatcher of mixture-of-experts layers (``token_dispatcher.py``) copies
   its split sizes to the host on a side CUDA stream it creates at build
   (``torch.cuda.Stream()``), as numpy arrays for ``all_to_all_single``. The shim gives that one
   module a view of ``torch`` whose ``cuda`` has a host stream (work on the host is already in
   order: waits and events are no-ops) and a ``maybe_move_tensor_to_cpu`` that hands host split
   sizes over as numpy, as it does device ones.

:func:`install` does nothing when CUDA is available: on a GPU megatron-core runs unchanged. It is
idempotent and process-wide (the tests' and ``train``'s worker processes call it once on CPU).
Nothing else of Megatron is replaced: its DDP, mappings and ``finalize_model_grads`` run as they
are.

A fourth place matters only to ``bench --against megatron``, which runs megatron-core's own
pipeline schedules (ours replace them everywhere else): ``schedules.py`` creates its token
counter with ``torch.zeros([], dtype=torch.int, device="cuda")`` in both pipelined schedules.
:func:`install_for_schedules` gives that one module a view of ``torch`` whose ``zeros`` puts
tensors asked for on ``"cuda"`` on the CPU; every other name is torch's own object, so the
schedules run at the same speed and nothing outside ``schedules.py`` sees a change.

A fifth, not about CUDA, on any install without Transformer Engine (GPU ones too):
megatron-core 0.16's ``transformer/moe/moe_utils.py`` binds ``te_general_gemm`` only when TE
imports, yet every router's gating reads the name, so a mixture-of-experts forward raises
``NameError``. :func:`bind_missing_te_general_gemm` binds it to None, the value that module
itself tests for before it falls back to ``torch.mm``; our models call it when they have experts. (The
router's move of its weights to ``torch.cuda.current_device()`` is the first place's.)

A sixth, for overlapped pairs (``runtime/expert_overlap.py``), which run megatron-core's
fine-grained schedule plan (combined 1F1B's per-layer nodes): its nodes take CUDA streams and
events (``pipeline_parallel/utils.py``, ``models/common/model_chunk_schedule_plan.py``,
``models/gpt/fine_grained_callables.py``), mark NVTX ranges, and call ``Tensor.record_stream``
on their inputs and gradients. Megatron's own combined 1F1B (``pipeline_parallel/combined_1f1b.py``,
its interleaved schedule with ``overlap_moe_expert_parallel_comm``, which ``bench --against
megatron`` runs) also puts its loss node on ``torch.cuda.current_stream()``.
:func:`install` (the runtime, below the adapter, cannot call the shim) gives those four
modules a view of ``torch`` whose ``cuda`` has host streams and events (no-ops: host work is in
order) and no-op NVTX ranges, and makes ``record_stream`` a no-op for host tensors (a CPU-only
torch has no other kind, and there the call always raised). The overlap itself comes from our
communication thread, not from these streams: on the host megatron-core's combined 1F1B runs its
nodes one after the other.
"""

from __future__ import annotations

import contextlib
import types

import torch

_installed = False
_schedules_installed = False


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
        _install_host_streams_for_alltoall()
        _install_host_schedule_plans()
        _installed = True
    return True


class _HostStream:
    """What the alltoall dispatcher asks of its CUDA stream and event, on the host."""

    def wait_stream(self, other: object) -> None:
        return None

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        return None

    # what megatron-core's schedule-plan nodes ask of their CUDA event (stream_acquire_context)
    def record(self, stream: object = None) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None


_HOST_STREAM = _HostStream()


def _host_split_sizes(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
    """``moe_utils.maybe_move_tensor_to_cpu`` for host tensors: numpy where asked, as for device ones."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _install_host_streams_for_alltoall() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    cuda = module_view(
        torch.cuda,
        Stream=lambda *args, **kwargs: _HOST_STREAM,
        current_stream=lambda *args, **kwargs: _HOST_STREAM,
        stream=lambda stream: contextlib.nullcontext(),
    )
    token_dispatcher.torch = module_view(torch, cuda=cuda)  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes  # type: ignore[attr-defined]


def bind_missing_te_general_gemm() -> None:
    """``moe_utils.te_general_gemm = None`` where megatron-core left the name unbound (no TE)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def install_for_schedules() -> bool:
    """:func:`install`, plus megatron-core's ``pipeline_parallel.schedules`` counting tokens on
    the CPU (see the module docstring); nothing with CUDA. Returns whether it is in effect."""
    global _schedules_installed
    if not install():
        return False
    if not _schedules_installed:
        from megatron.core.pipeline_parallel import schedules

        schedules.torch = module_view(torch, zeros=_zeros_on_cpu)  # type: ignore[attr-defined]
        _schedules_installed = True
    return True


def _install_host_schedule_plans() -> None:
    """megatron-core's fine-grained schedule plan on the host (the sixth place of the module
    docstring); part of :func:`install`."""
    from megatron.core.models.common import model_chunk_schedule_plan
    from megatron.core.models.gpt import fine_grained_callables
    from megatron.core.pipeline_parallel import combined_1f1b, utils

    nvtx = types.SimpleNamespace(
        range_push=lambda *args, **kwargs: None,
        range_pop=lambda *args, **kwargs: None,
        range=lambda *args, **kwargs: contextlib.nullcontext(),
    )
    cuda = module_view(
        torch.cuda,
        Stream=lambda *args, **kwargs: _HOST_STREAM,
        Event=lambda *args, **kwargs: _HOST_STREAM,
        current_stream=lambda *args, **kwargs: _HOST_STREAM,
        stream=lambda stream: contextlib.nullcontext(),
        nvtx=nvtx,
    )
    view = module_view(torch, cuda=cuda)
    for module in (utils, model_chunk_schedule_plan, fine_grained_callables, combined_1f1b):
        module.torch = view  # type: ignore[attr-defined]
    record_stream = torch.Tensor.record_stream

    def host_record_stream(tensor: torch.Tensor, stream: object) -> None:
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    torch.Tensor.record_stream = host_record_stream  # type: ignore[method-assign]


def module_view(module: types.ModuleType, **replaced: object) -> types.ModuleType:
    """A module object with ``module``'s names (and its lazy ones, on access) except ``replaced``:
    given to one megatron-core module as its ``torch``, it changes what that module calls and
    nothing anywhere else."""
    view = types.ModuleType(module.__name__)
    view.__dict__.update(module.__dict__)
    view.__getattr__ = lambda name: getattr(module, name)  # type: ignore[attr-defined]
    view.__dict__.update(replaced)
    return view


def _zeros_on_cpu(*args: object, **kwargs: object) -> torch.Tensor:
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = cpu_device()
    return torch.zeros(*args, **kwargs)  # type: ignore[call-overload]
