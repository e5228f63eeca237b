"""Time of one kernel or one collective on a device profile: the cost model's building blocks.

Each is a roofline with a fixed cost: a GEMM takes the longer of its FLOPs at the sustained
GEMM throughput and its bytes at the sustained HBM bandwidth, plus a launch gap; flash attention
runs at an efficiency that grows with the keys each query sees (short contexts fill the tensor
cores less); a ring collective over g ranks moves (g-1)/g of its buffer over the group's
slowest link (NVLink inside a node, InfiniBand across nodes), plus a latency per ring step.
"""

from __future__ import annotations

from .devices import DeviceProfile

ATTENTION_HALF_KEYS = 128  # keys per query at which flash attention runs at half its efficiency


class Kernels:
    """Durations (seconds) of kernels and collectives on ``profile``."""

    def __init__(self, profile: DeviceProfile) -> None:
        self.profile = profile
        self.gemm_flops = profile.peak_flops * profile.gemm_efficiency
        self.hbm = profile.hbm_bandwidth * profile.hbm_efficiency
        self.fp8_flops = profile.fp8_peak_flops * profile.fp8_gemm_efficiency

    def gemm(self, m: float, n: float, k: float, element_bytes: int = 2) -> float:
        """An (m x k) @ (k x n) GEMM: 2mnk FLOPs, reading both operands and writing the result."""
        if min(m, n, k) <= 0:
            return 0.0
        compute = 2.0 * m * n * k / self.gemm_flops
        traffic = element_bytes * (m * k + k * n + m * n) / self.hbm
        return max(compute, traffic) + self.profile.kernel_overhead

    def grouped_gemm(self, groups: int, m: float, n: float, k: float, fp8: bool = False) -> float:
        """``groups`` GEMMs (m x k) @ (k x n) in one grouped kernel (megatron-core's expert GEMMs):
        each a roofline at the profile's grouped-GEMM share of the peak (the dense GEMM's where
        the profile has none), one launch."""
        if min(groups, m, n, k) <= 0:
            return 0.0
        p = self.profile
        share = p.grouped_gemm_efficiency or (p.fp8_gemm_efficiency if fp8 else p.gemm_efficiency)
        peak = p.fp8_peak_flops if fp8 else p.peak_flops
        operand = 1 if fp8 else 2
        compute = 2.0 * m * n * k / (peak * share)
        traffic = (operand * (m * k + k * n) + 2 * m * n) / self.hbm
        return groups * max(compute, traffic) + p.kernel_overhead

    def gemm_fp8(self, m: float, n: float, k: float) -> float:
        """The same GEMM in FP8 (Transformer Engine's linears under ``--fp8-format``): FP8 operands
        (1 byte), a 16-bit result, at the profile's FP8 throughput. The casts to FP8 are
        bandwidth-bound kernels of their own (``PlanCosts``)."""
        if min(m, n, k) <= 0:
            return 0.0
        if self.fp8_flops <= 0:
            raise ValueError(f"{self.profile.name} has no FP8 tensor cores (fp8_peak_flops 0)")
        compute = 2.0 * m * n * k / self.fp8_flops
        traffic = (m * k + k * n + 2 * m * n) / self.hbm
        return max(compute, traffic) + self.profile.kernel_overhead

    def attention(self, flops: float, keys: float, backward: bool = False) -> float:
        """Flash attention doing ``flops`` with about ``keys`` keys per query."""
        if flops <= 0:
            return 0.0
        p = self.profile
        peak = p.attention_backward_efficiency if backward else p.attention_efficiency
        efficiency = peak * keys / (keys + ATTENTION_HALF_KEYS)
        return flops / (p.peak_flops * efficiency) + p.kernel_overhead

    def memory(self, nbytes: float) -> float:
        """A bandwidth-bound kernel (norms, activations, residual adds, optimizer) moving ``nbytes``."""
        return nbytes / self.hbm if nbytes > 0 else 0.0

    def link(self, intra_node: bool) -> float:
        return self.profile.nvlink_bandwidth if intra_node else self.profile.ib_bandwidth

    def collective(self, nbytes: float, group: int, intra_node: bool) -> float:
        """All-gather or reduce-scatter whose full (gathered) buffer is ``nbytes``, over ``group``
        ranks; an all-reduce is two of them."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        steps = group - 1
        return steps / group * nbytes / self.link(intra_node) + steps * self.profile.collective_latency

    def p2p(self, nbytes: float, intra_node: bool) -> float:
        """One point-to-point message between pipeline ranks."""
        return nbytes / self.link(intra_node) + self.profile.p2p_latency

    def host_copy(self, nbytes: float) -> float:
        """One device-to-host or host-to-device copy over the GPU's PCIe link (pinned memory)."""
        return nbytes / self.profile.pcie_bandwidth
