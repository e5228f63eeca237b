"""Device profiles: what one GPU and its links deliver, with each number's stated uncertainty.

The planner's cost model reads nothing else about the hardware, so a profile measured on a real
GPU (``plan --calibrate``, ``calibrate.py``) replaces a built-in one field for field. Every
built-in number and where it comes from (datasheet, published measurement, or an assumption)
is in docs/planner.md; ``UNCERTAINTY`` is the relative error each field is stated to carry, which
``perturbed`` applies to check that a ranking does not hinge on one guess.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU in a cluster node. Bandwidths in bytes/s per GPU and direction, times in seconds.

    ``gemm_efficiency`` and the attention efficiencies are shares of ``peak_flops`` that large
    bf16 GEMMs and flash attention sustain in training; ``nvlink_bandwidth`` and ``ib_bandwidth``
    are the bus bandwidths NCCL's collectives reach inside a node and across nodes (one NIC per
    GPU); ``reserved_bytes`` is device memory the model does not count (CUDA context, NCCL
    buffers, allocator slack). ``fp8_peak_flops`` and ``fp8_gemm_efficiency`` are the dense FP8
    tensor-core peak and the share of it FP8 GEMMs sustain (Transformer Engine's linears under
    ``--fp8-format``); 0 for a GPU without FP8 tensor cores. ``grouped_gemm_efficiency`` is the
    share of that peak (BF16's, or FP8's under ``--fp8-format``) megatron-core's grouped expert
    GEMMs sustain; 0 where no measurement is known (the dense GEMM's is used, and said)."""

    name: str
    memory_bytes: float
    peak_flops: float
    gemm_efficiency: float
    attention_efficiency: float
    attention_backward_efficiency: float
    hbm_bandwidth: float
    hbm_efficiency: float
    nvlink_bandwidth: float
    ib_bandwidth: float
    pcie_bandwidth: float
    kernel_overhead: float = 4e-6
    collective_latency: float = 15e-6
    p2p_latency: float = 10e-6
    reserved_bytes: float = 3 * GIB
    fp8_peak_flops: float = 0.0
    fp8_gemm_efficiency: float = 0.0
    grouped_gemm_efficiency: float = 0.0  # share of the peak (BF16 or FP8) grouped GEMMs sustain; 0: no data
    source: str = "built-in"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        """A profile from JSON; unknown keys are refused so a typo is not silently ignored."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown profile field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if missing:
            raise ValueError(f"profile lacks {', '.join(missing)}")
        profile = cls(**data)
        for name in NUMERIC_FIELDS:
            if not float(getattr(profile, name)) > 0:
                raise ValueError(f"profile field {name} must be positive, got {getattr(profile, name)}")
        for name in FP8_FIELDS:
            if not float(getattr(profile, name)) >= 0:
                raise ValueError(
                    f"profile field {name} must be 0 (no FP8) or positive, got {getattr(profile, name)}"
                )
        return profile

    def perturbed(self, factors: dict[str, float]) -> DeviceProfile:
        """This profile with some numeric fields multiplied by ``factors`` (field -> factor);
        efficiencies stay at most 1."""
        changes: dict[str, float] = {}
        for name, factor in factors.items():
            value = getattr(self, name) * factor
            changes[name] = min(value, 1.0) if name.endswith("efficiency") else value
        return replace(self, **changes)


FP8_FIELDS = ("fp8_peak_flops", "fp8_gemm_efficiency", "grouped_gemm_efficiency")  # 0: no FP8 / no data
NUMERIC_FIELDS = tuple(f.name for f in fields(DeviceProfile) if f.name not in ("name", "source", *FP8_FIELDS))

# Relative uncertainty each field is stated to have (docs/planner.md, "Uncertainty"). Datasheet
# capacities and peaks are exact; efficiencies and achieved bandwidths are the guesses.
UNCERTAINTY: dict[str, float] = {
    "gemm_efficiency": 0.10,
    "attention_efficiency": 0.20,
    "attention_backward_efficiency": 0.20,
    "hbm_efficiency": 0.10,
    "nvlink_bandwidth": 0.20,
    "ib_bandwidth": 0.25,
    "pcie_bandwidth": 0.25,
    "kernel_overhead": 0.50,
    "collective_latency": 0.50,
    "p2p_latency": 0.50,
}

# Sustained share of the maximum achievable matmul throughput in end-to-end training (clocks
# under a full training load, GEMMs beside NCCL kernels, shapes off the best tile): an assumption
# (15% below the measured best case), not fitted; docs/planner.md compares what it predicts with
# published runs.
SUSTAINED = 0.85

# Hopper's dense FP8 tensor-core peak (H100/H200 SXM datasheet: 1,979 TFLOP/s without sparsity,
# twice BF16's) and the share of it the best measured FP8 GEMM reaches (1,453 TFLOP/s on an H200,
# stas00/ml-engineering's table), derated like BF16's by SUSTAINED (docs/planner.md, "FP8").
HOPPER_FP8_PEAK = 1978.9e12
HOPPER_FP8_BEST = 0.734
# Grouped expert GEMMs on Hopper, BF16 and FP8 alike: 63-66% of the BF16 peak for Qwen3-30B-A3B's
# expert at 4,096 tokens per expert (Transformer Engine PR #2045, cuBLAS multi-stream and CUTLASS),
# 61-68% on an H200 at 1,024-8,192 tokens (TileOPs PR #1567), 61-68% of the FP8 peak for
# DeepSeek-V3's experts (DeepGEMM's contiguous layout); below ~2,000 tokens per expert less
# (docs/planner.md, "Mixture of experts"). Derated by SUSTAINED like the dense GEMM.
HOPPER_GROUPED_BEST = 0.645

PROFILES: dict[str, DeviceProfile] = {
    "h100-80gb": DeviceProfile(
        name="h100-80gb",
        memory_bytes=81559 * 2**20,
        peak_flops=989.4e12,
        gemm_efficiency=0.801 * SUSTAINED,
        attention_efficiency=0.55,
        attention_backward_efficiency=0.40,
        hbm_bandwidth=3.35e12,
        hbm_efficiency=0.80,
        nvlink_bandwidth=360e9,
        ib_bandwidth=45e9,
        pcie_bandwidth=40e9,
        fp8_peak_flops=HOPPER_FP8_PEAK,
        fp8_gemm_efficiency=HOPPER_FP8_BEST * SUSTAINED,
        grouped_gemm_efficiency=HOPPER_GROUPED_BEST * SUSTAINED,
    ),
    "h200-141gb": DeviceProfile(
        name="h200-141gb",
        memory_bytes=143771 * 2**20,
        peak_flops=989.4e12,
        gemm_efficiency=0.801 * SUSTAINED,
        attention_efficiency=0.55,
        attention_backward_efficiency=0.40,
        hbm_bandwidth=4.8e12,
        hbm_efficiency=0.80,
        nvlink_bandwidth=360e9,
        ib_bandwidth=45e9,
        pcie_bandwidth=40e9,
        fp8_peak_flops=HOPPER_FP8_PEAK,
        fp8_gemm_efficiency=HOPPER_FP8_BEST * SUSTAINED,
        grouped_gemm_efficiency=HOPPER_GROUPED_BEST * SUSTAINED,
    ),
    "a100-80gb": DeviceProfile(
        name="a100-80gb",
        memory_bytes=81920 * 2**20,
        peak_flops=312e12,
        gemm_efficiency=0.859 * SUSTAINED,
        attention_efficiency=0.60,
        attention_backward_efficiency=0.45,
        hbm_bandwidth=2.039e12,
        hbm_efficiency=0.80,
        nvlink_bandwidth=240e9,
        ib_bandwidth=22.5e9,
        pcie_bandwidth=20e9,
    ),
    "a100-40gb": DeviceProfile(
        name="a100-40gb",
        memory_bytes=40960 * 2**20,
        peak_flops=312e12,
        gemm_efficiency=0.859 * SUSTAINED,
        attention_efficiency=0.60,
        attention_backward_efficiency=0.45,
        hbm_bandwidth=1.555e12,
        hbm_efficiency=0.80,
        nvlink_bandwidth=240e9,
        ib_bandwidth=22.5e9,
        pcie_bandwidth=20e9,
    ),
}


def get_profile(name: str) -> DeviceProfile:
    """A built-in profile by name; KeyError lists the names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; choose from: {', '.join(PROFILES)}") from None


def save_profile(profile: DeviceProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile written by :func:`save_profile` (``plan --calibrate``); ValueError if malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds {type(data).__name__}, not a profile object")
    return DeviceProfile.from_dict(data)
