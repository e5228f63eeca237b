"""``plan --calibrate``: measure the profile's quantities on the local GPU and write them as JSON.

Measured with torch (imported here, inside the functions, so the planner stays torch-free):
bf16 GEMM throughput on training-sized shapes, flash attention (``scaled_dot_product_attention``,
causal, bf16) forward and backward, HBM copy bandwidth, pinned host<->device copies (PCIe), the
launch gap of a tiny kernel and the memory the device reports. Links between GPUs cannot be
measured from one device: NVLink and InfiniBand bandwidths stay those of the ``base`` profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .devices import SUSTAINED, DeviceProfile


class NoGPU(RuntimeError):
    """No CUDA device to measure (the command prints one line and exits 2)."""


def _timer(torch: Any, run: Callable[[], Any], repeat: int = 10) -> float:
    """Median seconds of ``run`` on the current stream, after two warm-up calls."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _gemm(torch: Any) -> float:
    """Best FLOP/s over a few training-sized bf16 GEMMs (tokens x hidden x FFN shard)."""
    best = 0.0
    for m, n, k in ((8192, 8192, 8192), (16384, 7168, 8192), (16384, 8192, 3584)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        best = max(best, 2 * m * n * k / _timer(torch, lambda a=a, b=b: a @ b))
    return best


def _attention(torch: Any) -> tuple[float, float]:
    """Causal flash attention FLOP/s, forward and backward (8 heads of 128, 16K tokens)."""
    import torch.nn.functional as F

    heads, length, dim = 8, 16384, 128
    q, k, v = (
        torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    flops = heads * (4 * dim) * length * length / 2  # causal pairs, QK^T and PV

    def forward() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = forward()
    grad = torch.randn_like(out)
    forward_s = _timer(torch, forward)
    both = _timer(torch, lambda: torch.autograd.grad(forward(), (q, k, v), grad))
    return flops / forward_s, 2 * flops / max(both - forward_s, 1e-9)


def _bandwidths(torch: Any) -> tuple[float, float, float]:
    """(HBM copy bytes/s counting read and write, pinned host-to-device and device-to-host
    bytes/s the slower of the two, seconds of a tiny kernel)."""
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hbm = 2 * size / _timer(torch, lambda: dst.copy_(src))
    host = torch.empty(size // 4, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size // 4, dtype=torch.uint8, device="cuda")
    up = host.numel() / _timer(torch, lambda: device.copy_(host, non_blocking=True))
    down = host.numel() / _timer(torch, lambda: host.copy_(device, non_blocking=True))
    tiny = torch.zeros(1, device="cuda")
    launches = 100
    launch = _timer(torch, lambda: [tiny.add_(1) for _ in range(launches)]) / launches
    return hbm, min(up, down), launch


def calibrate(base: DeviceProfile) -> DeviceProfile:
    """A profile of the local GPU: ``base`` with every quantity one device can measure replaced."""
    try:
        import torch
    except ModuleNotFoundError:
        raise NoGPU("no torch here, so no GPU to measure (pip install torch)") from None
    if not torch.cuda.is_available():
        raise NoGPU("no CUDA GPU here: run --calibrate on the GPU machine, then pass --profile FILE")
    properties = torch.cuda.get_device_properties(0)
    gemm = _gemm(torch)
    attention_forward, attention_backward = _attention(torch)
    hbm, pcie, launch = _bandwidths(torch)
    peak = base.peak_flops
    return replace(
        base,
        name=f"{properties.name} (calibrated)",
        memory_bytes=float(properties.total_memory),
        gemm_efficiency=min(1.0, gemm / peak) * SUSTAINED,  # same derate as the built-in profiles
        attention_efficiency=min(1.0, attention_forward / peak),
        attention_backward_efficiency=min(1.0, attention_backward / peak),
        hbm_bandwidth=hbm,
        hbm_efficiency=1.0,
        pcie_bandwidth=pcie,
        kernel_overhead=launch,
        source=f"measured on {properties.name} by plan --calibrate; NVLink/InfiniBand from {base.name}",
    )
