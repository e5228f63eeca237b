"""Numbers that activation offload is planned with, measured on the device at hand.

``auto`` offload needs PipeOffload's k, the copy time over the compute time of a layer: from the
model shape (h, s) and two throughputs, which are measured here when not configured: the
delivered FLOP/s of a square GEMM in the training dtype, and the bandwidth of copies between
the device and (pinned) host memory, the slower direction. :func:`measure_offload` calibrates
the simulator: the bytes one OFFLOAD of a unit of a chunk frees (:func:`measure_slice_offload`
per slice of a sliced chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..schedule.costs import offload_ratio
from ..schedule.ir import Op, OpKind
from .memory import ActivationMeter
from .offload import DEFAULT_MIN_BYTES, OffloadEngine


def _timed(device: torch.device, work: Callable[[], object], repeats: int) -> float:
    """Seconds per call of ``work`` on ``device``, after one warm-up call."""
    work()
    if device.type == "cpu":
        started = time.perf_counter()
        for _ in range(repeats):
            work()
        return (time.perf_counter() - started) / repeats
    module = torch.get_device_module(device)
    start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure_copy_bandwidths(
    device: torch.device | str, nbytes: int | None = None, repeats: int = 5
) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes/s of one copy between ``device`` and host memory,
    pinned on an accelerator (default size: 256 MiB on an accelerator, 16 MiB on CPU)."""
    device = torch.device(device)
    accelerated = device.type != "cpu"
    size = nbytes or (256 if accelerated else 16) * 2**20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=accelerated)
    on_device = torch.ones(size, dtype=torch.uint8, device=device)
    out = _timed(device, lambda: host.copy_(on_device, non_blocking=accelerated), repeats)
    back = _timed(device, lambda: on_device.copy_(host, non_blocking=accelerated), repeats)
    return size / out, size / back


def measure_host_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of the slower copy direction between ``device`` and host memory."""
    return min(measure_copy_bandwidths(device, nbytes, repeats))


def measure_compute_throughput(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, size: int | None = None, repeats: int = 5
) -> float:
    """Delivered FLOP/s of a square GEMM (default size 8192 on an accelerator, 512 on CPU)."""
    device = torch.device(device)
    n = size or (8192 if device.type != "cpu" else 512)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32  # what a CPU run computes in
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timed(device, lambda: a @ b, repeats)


def offload_ratio_on(
    device: torch.device | str,
    hidden: int,
    seq_length: int,
    dtype: torch.dtype = torch.bfloat16,
    compute_throughput: float | None = None,
    host_bandwidth: float | None = None,
) -> float:
    """k for a model of width ``hidden`` at ``seq_length`` tokens on ``device``; each throughput
    not given is measured."""
    throughput = compute_throughput or measure_compute_throughput(device, dtype)
    bandwidth = host_bandwidth or measure_host_bandwidth(device)
    return offload_ratio(hidden, seq_length, throughput, bandwidth)


def measure_offload(
    chunk: torch.nn.Module,
    run_forward: Callable[[torch.nn.Module], Tensor],
    input_tensor: Tensor | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> int:
    """Bytes one OFFLOAD of a unit of ``chunk`` frees on the device, to calibrate the
    simulator's ``offload_bytes`` (the rest of what the F keeps stays: small tensors and the
    like). ``run_forward`` and ``input_tensor`` as for ``memory.measure_op_memory``."""
    from megatron.core.utils import get_attr_wrapped_model

    meter = ActivationMeter()
    meter.exclude(chunk.parameters())
    engine = OffloadEngine(next(chunk.parameters()).device, min_bytes)
    unit = (0, 0, 0)
    engine.begin(meter, [Op(OpKind.OFFLOAD, *unit)], list(chunk.parameters()))
    stage_input = None if input_tensor is None else input_tensor.detach().requires_grad_(True)
    get_attr_wrapped_model(chunk, "set_input_tensor")(stage_input)
    with engine.saving(unit, stage_input) as handle:
        output = run_forward(chunk)
    before = meter.live
    engine.offload(unit)
    freed = before - meter.live
    engine.reload(unit)
    del output
    handle.release()
    engine.finish()
    return freed


def measure_slice_offload(
    chunk: torch.nn.Module,
    context: Any,
    lengths: Sequence[int],
    run_forward: Callable[[torch.nn.Module, int], Tensor],
    make_input: Callable[[int], Tensor | None],
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> list[int]:
    """:func:`measure_offload` for the k slices of one microbatch on a sliced chunk (arguments as
    for ``memory.measure_slice_memory``): the bytes one OFFLOAD of each slice frees right after
    its F. The K/V cache keeps each slice's keys and values for the later slices, so they stay on
    the device and are not counted."""
    from megatron.core.utils import get_attr_wrapped_model

    meter = ActivationMeter()
    meter.exclude(chunk.parameters())
    engine = OffloadEngine(next(chunk.parameters()).device, min_bytes)
    units = [(0, 0, j) for j in range(len(lengths))]
    engine.begin(meter, [Op(OpKind.OFFLOAD, *unit) for unit in units], list(chunk.parameters()))
    context.release()
    context.set_slicing(list(lengths))
    freed, kept = [], []
    try:
        for j, unit in enumerate(units):
            stage_input = make_input(j)
            if stage_input is not None:
                stage_input = stage_input.detach().requires_grad_(True)
            get_attr_wrapped_model(chunk, "set_input_tensor")(stage_input)
            with context.running(0, j), engine.saving(unit, stage_input) as handle:
                output = run_forward(chunk, j)
            before = meter.live
            engine.offload(unit)
            freed.append(before - meter.live)
            kept.append((output, handle))
        for unit in units:
            engine.reload(unit)
    finally:
        kept.clear()
        context.release()
        engine.discard()
    return freed
