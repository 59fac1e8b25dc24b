"""Hardware profiles: the constants that turn FLOPs and bytes into estimated seconds.

Sources (DESIGN.md §5, measured on 4×H200 NVLink, torch 2.11, NCCL, ``NCCL_NVLS_ENABLE=0``):

* a bf16 8192³ GEMM runs at 805 TFLOP/s;
* all-reduce bus bandwidth reaches 353 GB/s at 1 GB; small calls floor at about
  21–29 µs. An alpha-beta fit with alpha = 25 µs and bus bandwidth 353 GB/s reproduces
  the measured bus bandwidths from 1 MB to 1 GB within 6% (4 ranks).

Memory bandwidth is not in §5: it is NVIDIA's datasheet figure (H200 SXM 4.8 TB/s,
H100 SXM 3.35 TB/s). H100 has no measurement of its own here; it is the same GH100
chip and NVLink generation as H200, so it takes H200's measured GEMM rate and
all-reduce constants (uncalibrated).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU and its tensor-parallel interconnect."""

    name: str
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    allreduce_bus_bytes_per_s: float
    collective_latency_s: float


H200 = HardwareProfile(
    name="H200",
    matmul_flops_per_s=805e12,
    memory_bytes_per_s=4.8e12,
    allreduce_bus_bytes_per_s=353e9,
    collective_latency_s=25e-6,
)

H100 = HardwareProfile(
    name="H100",
    matmul_flops_per_s=805e12,
    memory_bytes_per_s=3.35e12,
    allreduce_bus_bytes_per_s=353e9,
    collective_latency_s=25e-6,
)

PROFILES: dict[str, HardwareProfile] = {"h200": H200, "h100": H100}
