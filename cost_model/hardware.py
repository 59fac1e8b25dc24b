"""Hardware profiles: the constants that turn FLOPs and bytes into estimated seconds.

A ``HardwareProfile`` is one GPU (or CPU rank) and the links between ranks:

* compute: ``matmul_flops_per_s`` (achieved bf16 GEMM rate), ``matmul_latency_s`` (the
  fixed cost of one GEMM kernel: a GEMM of F FLOPs takes ``matmul_latency_s + F / rate``),
  or, when calibrated, ``matmul_curve``: measured (FLOPs, seconds) of GEMMs of
  transformer shapes, interpolated in log-log space (``matmul_time_s``);
  ``attention_flops_per_s`` (fused attention kernels, forward; one of F FLOPs takes
  ``attention_latency_s + F / rate``, ``attention_time_s``) and
  ``attention_backward_factor`` (their backward time over forward; 2.5 by default:
  FlashAttention-2's backward runs 5 GEMMs against 2), ``elementwise_backward_factor``
  (backward time over forward of eager memory-bound ops; 2 by default: read the saved
  inputs and the output gradient, write the input gradients), ``memory_bytes_per_s`` (achieved
  HBM bandwidth), ``optimizer_bytes_per_s`` (that of foreach AdamW's kernels, ``cost_model.dp_sync``;
  0: ``memory_bytes_per_s``), ``peak_flops_per_s`` (the datasheet dense bf16 peak, the MFU
  denominator) and ``compute_time_scale`` (eager kernels' time over what the roofline
  above gives them, for a whole decoder layer: GEMMs of a layer's shapes and its many
  small memory-bound kernels run below the rates of large isolated kernels; 1 unless
  ``autotp calibrate`` measured it);
* FP8: ``fp8_matmul_speedup``, the rate of FP8 GEMMs over bf16 ones (by default 2, the
  ratio of the dense FP8 and bf16 peaks in Ada/Hopper datasheets; H200 and H100 take 1.85,
  measured for tensorwise: rowwise ran 1.93, blockwise 1.59; the CPU profile takes 1: its
  ``torch._scaled_mm`` dequantizes to float32);
* host: ``op_overhead_s`` and ``backward_op_overhead_s``, the CPU time eager PyTorch
  spends dispatching one graph node forward and one autograd node backward, and
  ``collective_host_s``, what one tp collective node (autotp's ``autograd.Function``
  around a c10d call) costs the host instead, and ``call_host_s``, the fixed host cost
  of one forward + backward call of a rank's graph or pipeline chunk beyond its nodes
  (inputs and output structures, starting the autograd engine, the runtime's Python);
  built-in profiles leave it at 0, ``autotp calibrate`` measures it; under ``compile=True``
  ``compiled_launch_host_s`` per kernel launched (``cost_model.fused_kernels`` counts them) and
  ``compiled_call_host_s`` per call replace the per-node and per-call costs;
* memory: ``memory_capacity_bytes`` and ``reserved_bytes`` (CUDA context, NCCL buffers,
  allocator slack: never available to tensors);
* links (``Link``, alpha-beta): ``intra_node`` (built from the original
  ``collective_latency_s`` and ``allreduce_bus_bytes_per_s`` fields), ``p2p`` (intra-node
  point-to-point) and ``inter_node`` (per GPU: a node's NIC bandwidth divided by its GPUs).

Sources. **H200 SXM** (DESIGN.md §5, measured on 4×H200 NVLink NV18, torch 2.11, NCCL,
``NCCL_NVLS_ENABLE=0``): bf16 8192³ GEMM 805 TFLOP/s; all-reduce bus bandwidth 54 GB/s
at 1 MB, 212 at 8 MB, 306 at 64 MB, 338 at 256 MB, 353 at 1 GB, small calls floor at
21–29 µs. alpha = 25 µs with bus bandwidth 353 GB/s reproduces that curve within 6%
(``H200_ALLREDUCE_CURVE``; ``fit_link`` on it gives 24 µs, 346 GB/s, within 4%).
Its single-GPU constants (``H200_MEASURED``: the GEMM curve, attention, achieved HBM, the
elementwise backward, host costs, the layer time scale) are ``python benchmarks/measure_constants.py``'s
measurement of one H200 (that script's docstring says what each stands for; GEMM and attention as GPU
time, without the host's issue, which the queue adds); the tp collective's host cost, which one GPU cannot
measure, is ``autotp calibrate``'s fit of 4×H200 (``benchmarks/results/cost_model_h200x4.json``).
**H100 SXM**: its single-GPU constants (``H100_MEASURED``) are the same script's measurement of one H100,
its NVLink and tp-collective host constants H200's.
Everything else is a datasheet figure or a stated assumption, marked in each profile's
``source``. ``autotp calibrate`` on the machine measures all of them and caches the profile
(``calibrated_profile_path``), where ``get_profile`` and ``parallelize(plan="auto")`` find it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autotp.ir.errors import UserInputError

if TYPE_CHECKING:
    import torch

GiB = 2**30
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """An interconnect in the alpha-beta model (formulas in ``autotp.cost_model.communication``).

    ``latency_s``: fixed cost of one call (alpha); ``hop_latency_s``: extra latency per
    algorithm step (a ring all-reduce has 2(t-1) steps, a tree 2⌈log2 t⌉);
    ``bus_bytes_per_s``: NCCL's bus bandwidth (algorithm bandwidth times 2(t-1)/t for an
    all-reduce), reached by large messages.
    """

    latency_s: float
    bus_bytes_per_s: float
    hop_latency_s: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU and its links; the first five fields are the tensor-parallel (intra-node) view."""

    name: str
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    allreduce_bus_bytes_per_s: float
    collective_latency_s: float
    peak_flops_per_s: float = 0.0
    memory_capacity_bytes: float = 80e9
    optimizer_bytes_per_s: float = 0.0
    reserved_bytes: float = 3 * GiB
    matmul_latency_s: float = 0.0
    attention_flops_per_s: float = 0.0
    attention_latency_s: float = 0.0
    attention_backward_factor: float = 2.5
    elementwise_backward_factor: float = 2.0
    matmul_curve: tuple[tuple[float, float], ...] = ()
    op_overhead_s: float = 0.0
    backward_op_overhead_s: float = 0.0
    collective_host_s: float = 0.0
    call_host_s: float = 0.0
    compiled_launch_host_s: float = 0.0
    compiled_call_host_s: float = 0.0
    compute_time_scale: float = 1.0
    fp8_matmul_speedup: float = 2.0
    overlap_call_s: float = 0.0
    permuted_copy_slowdown: float = 0.0
    p2p: Link | None = None
    inter_node: Link = Link(latency_s=30e-6, bus_bytes_per_s=45e9, hop_latency_s=5e-6)
    source: str = ""

    @property
    def intra_node(self) -> Link:
        return Link(self.collective_latency_s, self.allreduce_bus_bytes_per_s)

    @property
    def p2p_link(self) -> Link:
        return self.p2p if self.p2p is not None else self.intra_node

    @property
    def mfu_flops_per_s(self) -> float:
        return self.peak_flops_per_s or self.matmul_flops_per_s

    @property
    def optimizer_rate(self) -> float:
        return self.optimizer_bytes_per_s or self.memory_bytes_per_s

    @property
    def attention_rate(self) -> float:
        return self.attention_flops_per_s or self.matmul_flops_per_s

    def attention_time_s(self, flops: np.ndarray) -> np.ndarray:
        """Forward time of fused attention kernels of ``flops`` FLOPs each (the causal half where causal)."""
        return self.attention_latency_s + flops / self.attention_rate

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_capacity_bytes - self.reserved_bytes

    def matmul_time_s(self, flops: np.ndarray) -> np.ndarray:
        """GEMM time of each element of ``flops``: the curve if measured, else latency + F/rate.

        Beyond the curve's largest GEMM the time grows at that GEMM's rate; below its
        smallest it stays at the smallest one's time (the launch floor).
        """
        if not self.matmul_curve:
            return self.matmul_latency_s + flops / self.matmul_flops_per_s
        points, seconds = np.array([f for f, _ in self.matmul_curve]), np.array([t for _, t in self.matmul_curve])
        inside = np.exp(np.interp(np.log(np.maximum(flops, 1.0)), np.log(points), np.log(seconds)))
        return np.where(flops > points[-1], seconds[-1] * flops / points[-1], inside)


# (message bytes, all-reduce bus bytes/s) on 4×H200, DESIGN.md §5.
H200_ALLREDUCE_CURVE: tuple[tuple[int, float], ...] = (
    (2**20, 54e9),
    (8 * 2**20, 212e9),
    (64 * 2**20, 306e9),
    (256 * 2**20, 338e9),
    (2**30, 353e9),
)

_EAGER_OVERHEAD = {"op_overhead_s": 6e-6, "backward_op_overhead_s": 8e-6, "collective_host_s": 30e-6}
# autotp calibrate on 4×H200 (benchmarks/results/cost_model_h200x4.json): the tp collective's host cost,
# which one GPU cannot measure; and benchmarks/bench_fp8.py's GEMM part, 1x H200, torch 2.11, 2026-11-24
# (benchmarks/results/fp8_h200x1.json): [8192, 4096] x [4096, 14336] at 807 TFLOP/s in bf16, 1493 in FP8
# tensorwise (the default recipe).
# The fused overlapped GEMMs' overheads (cost_model.overlap_overheads), both fitted to one pair of runs on
# 2x H200, torch 2.11, 2026-11-30 (python3 benchmarks/bench_tp.py --suite strong --shape small|small-b1 --tp 2,
# benchmarks/results/tp_strong_small{,_b1}_h200x2_r3.json): 4 Llama-3-8B layers at tp=2, b4 s2048 and b1 s8192,
# each with and without the overlap. At b1 nothing is permuted and the overlap cost 0.9 ms a layer more than
# the GEMM and transfer terms say (symmetric-memory barriers 3.6 ms a step over 32 calls); at b4 the permuted
# copies (elementwise_kernel<128, 4>, 11.3 ms a step against 1.6 without) take the rest.
_SYMM_MEM_OVERLAP = {"overlap_call_s": 1.1e-4, "permuted_copy_slowdown": 2.25}
H200_MULTI_GPU = {"collective_host_s": 349e-6, "fp8_matmul_speedup": 1.85, **_SYMM_MEM_OVERLAP}
# python benchmarks/measure_constants.py --json on 1x H200 (nvidia-h200 lease, 16 host cores), torch 2.11.0+cu130,
# 2026-11-29 (benchmarks/results/cost_model_constants_h200x1.json; --fit prints these; tests/test_planner.py refits
# the file). As the H100's below: GEMM and attention as GPU time, host costs from the 1024-token probe of width 1024.
H200_MEASURED = {
    "matmul_flops_per_s": 691.4e12,
    "matmul_latency_s": 2.855e-6,
    "matmul_curve": (
        (2.147e9, 5.77e-06), (4.295e9, 9.914e-06), (8.59e9, 1.495e-05), (1.718e10, 2.772e-05), (3.436e10, 5.029e-05),
        (6.872e10, 9.847e-05), (1.203e11, 1.71e-04), (1.374e11, 2.015e-04), (2.495e11, 3.62e-04), (2.749e11, 4.084e-04),
        (4.99e11, 7.296e-04), (5.498e11, 8.143e-04), (9.979e11, 1.465e-03), (1.996e12, 2.944e-03), (4.295e12, 6.411e-03),
    ),
    "attention_flops_per_s": 529.7e12,
    "attention_latency_s": 13.36e-6,
    "attention_backward_factor": 3.068,
    "memory_bytes_per_s": 4.157e12,
    "elementwise_backward_factor": 2.105,
    "optimizer_bytes_per_s": 3.037e12,
    "op_overhead_s": 13.88e-6,
    "backward_op_overhead_s": 14.78e-6,
    "call_host_s": 4.597e-3,
    "compute_time_scale": 0.989,
}
# the same file's compiled_host part (measure_constants.py --parts compiled_host, 1x H200, 2026-11-30)
COMPILED_HOST = {"compiled_launch_host_s": 18.9e-6, "compiled_call_host_s": 4.448e-3}
_NDR_RAIL = Link(latency_s=30e-6, bus_bytes_per_s=45e9, hop_latency_s=5e-6)

H200 = HardwareProfile(
    name="H200",
    allreduce_bus_bytes_per_s=353e9,
    collective_latency_s=25e-6,
    peak_flops_per_s=989.4e12,
    memory_capacity_bytes=141e9,
    inter_node=_NDR_RAIL,
    **H200_MULTI_GPU,
    **H200_MEASURED,
    **COMPILED_HOST,
    source="GEMM curve, attention, HBM, elementwise backward, host costs (eager and compiled) and the layer time scale measured on "
    "1x H200 (benchmarks/measure_constants.py, benchmarks/results/cost_model_constants_h200x1.json); NVLink all-reduce "
    "measured on 4x H200 (DESIGN.md §5), the tp collective's host cost by autotp calibrate on 4x H200 "
    "(benchmarks/results/cost_model_h200x4.json); capacity and peak from NVIDIA's H200 SXM datasheet; the inter-node "
    "link (8x ConnectX-7 400 Gb/s NDR per node, 45 GB/s per GPU) assumed",
)

# python benchmarks/measure_constants.py --json on 1x H100 80GB HBM3 SXM (nvidia-h100-x1 lease, 16 host cores, driver
# 580.159.04), torch 2.11.0+cu130, 2026-11-25 (benchmarks/results/cost_model_constants_h100x1.json; --fit prints these).
# GEMM and attention times are GPU time (CUDA-graph replays); host costs from the 1024-token probe of width 1024.
# The attention rate is per FLOP as cost_model.flops counts the node, and compute_time_scale is refitted whenever
# the model of a layer changes (tests/test_planner.py refits the file: gradient sums included, 2026-11-25 r5).
H100_MEASURED = {
    "matmul_flops_per_s": 712.5e12,
    "matmul_latency_s": 3.27e-6,
    "matmul_curve": (
        (2.147e9, 6.109e-06), (4.295e9, 9.875e-06), (8.59e9, 1.509e-05), (1.718e10, 2.78e-05), (3.436e10, 5.043e-05),
        (6.872e10, 9.664e-05), (1.203e11, 1.621e-04), (1.374e11, 2.037e-04), (2.495e11, 3.576e-04), (2.749e11, 3.942e-04),
        (4.99e11, 6.915e-04), (5.498e11, 7.792e-04), (9.979e11, 1.423e-03), (1.996e12, 2.856e-03), (4.295e12, 6.132e-03),
    ),
    "attention_flops_per_s": 532e12,  # FLOPs as cost_model.flops counts them (the causal half of QK^T and PV)
    "attention_latency_s": 13.5e-6,
    "attention_backward_factor": 3.21,
    "memory_bytes_per_s": 3.003e12,
    "elementwise_backward_factor": 2.21,
    "op_overhead_s": 10.0e-6,
    "backward_op_overhead_s": 44.8e-6,
    "call_host_s": 1.09e-3,
    "compute_time_scale": 0.977,
    "optimizer_bytes_per_s": 2.42e12,  # 42 bytes per bf16 parameter (dp_sync.adamw_bytes_per_param) in 18.6 ms per 1.07e9
}

H100 = HardwareProfile(
    name="H100",
    allreduce_bus_bytes_per_s=353e9,
    collective_latency_s=25e-6,
    peak_flops_per_s=989.4e12,
    memory_capacity_bytes=80e9,
    inter_node=_NDR_RAIL,
    **H200_MULTI_GPU,
    **H100_MEASURED,
    **COMPILED_HOST,
    source="GEMM curve, attention, HBM, elementwise backward, host costs and the layer time scale measured on 1x H100 "
    "(benchmarks/measure_constants.py, benchmarks/results/cost_model_constants_h100x1.json); NVLink all-reduce, the "
    "tp collective's host cost, the compiled host costs and the FP8 speedup from H200 (same NVLink 4 and host software; one GPU cannot measure "
    "them); capacity and peak from NVIDIA's H100 SXM datasheet; inter-node 8x 400 Gb/s NDR (45 GB/s per GPU) assumed",
)

A100 = HardwareProfile(
    name="A100",
    matmul_flops_per_s=250e12,
    memory_bytes_per_s=2.039e12,
    allreduce_bus_bytes_per_s=230e9,
    collective_latency_s=25e-6,
    peak_flops_per_s=312e12,
    memory_capacity_bytes=80e9,
    attention_flops_per_s=150e12,
    inter_node=Link(latency_s=30e-6, bus_bytes_per_s=22e9, hop_latency_s=5e-6),
    **_EAGER_OVERHEAD,
    **_SYMM_MEM_OVERLAP,
    source="A100 SXM 80GB datasheet (312 TFLOP/s bf16, 2.039 TB/s, NVLink 3 600 GB/s); assumed: GEMM at "
    "80% of peak, all-reduce bus bandwidth 230 GB/s, inter-node 8x 200 Gb/s HDR (22 GB/s per GPU), the fused "
    "overlap's overheads H200's",
)

PCIE = HardwareProfile(
    name="H100-PCIe",
    matmul_flops_per_s=600e12,
    memory_bytes_per_s=2.0e12,
    allreduce_bus_bytes_per_s=22e9,
    collective_latency_s=30e-6,
    peak_flops_per_s=756e12,
    memory_capacity_bytes=80e9,
    attention_flops_per_s=300e12,
    inter_node=Link(latency_s=40e-6, bus_bytes_per_s=5.5e9, hop_latency_s=8e-6),
    **_EAGER_OVERHEAD,
    **_SYMM_MEM_OVERLAP,
    source="8x H100 PCIe 80GB per host without NVLink bridges: datasheet 756 TFLOP/s bf16, 2.0 TB/s; "
    "assumed: GEMM at 80% of peak, all-reduce through the PCIe Gen5 switches at 22 GB/s bus bandwidth, "
    "2x 200 Gb/s NICs per node (5.5 GB/s per GPU), the fused overlap's overheads H200's",
)

CPU = HardwareProfile(
    name="CPU",
    matmul_flops_per_s=50e9,
    memory_bytes_per_s=10e9,
    allreduce_bus_bytes_per_s=1e9,
    collective_latency_s=100e-6,
    memory_capacity_bytes=16 * GiB,
    reserved_bytes=1 * GiB,
    op_overhead_s=10e-6,
    backward_op_overhead_s=15e-6,
    collective_host_s=50e-6,
    fp8_matmul_speedup=1.0,
    inter_node=Link(latency_s=200e-6, bus_bytes_per_s=1e9),
    source="a few-core CPU host, fp32, gloo over TCP loopback: assumed round numbers; run autotp "
    "calibrate for this machine's",
)

PROFILES: dict[str, HardwareProfile] = {"h200": H200, "h100": H100, "a100": A100, "pcie": PCIE, "cpu": CPU}


def profile_for_gpu(device_name: str) -> HardwareProfile | None:
    """The built-in profile of a GPU named as ``torch.cuda.get_device_name`` names it, if any."""
    for key, profile in (("H200", H200), ("H100 PCIe", PCIE), ("H100", H100), ("A100", A100)):
        if key in device_name:
            return profile
    return None


def device_hardware(device: torch.device) -> str | None:
    """The ``PROFILES`` key of the GPU kind of a CUDA ``device`` (None for other devices or unknown GPUs)."""
    import torch  # here: the CLI imports this module for ``--help``, which must not load torch

    if device.type != "cuda":
        return None
    profile = profile_for_gpu(torch.cuda.get_device_name(device))
    return profile_key(profile) if profile is not None else None


def profile_key(profile: HardwareProfile) -> str | None:
    """The ``PROFILES`` key of a built-in profile, or of the built-in one a calibration measured."""
    name = profile.name.removesuffix(" (calibrated)")
    measured = profile_for_gpu(name) or (CPU if name == CPU.name else None)
    return next((key for key, builtin in PROFILES.items() if builtin in (profile, measured) or builtin.name == name), None)


def calibrated_profile_path(device_name: str) -> Path:
    """Where ``autotp calibrate`` caches this machine's profile of ``device_name`` (``CPU`` for CPU ranks):
    ``$AUTOTP_CACHE_DIR/profiles/<device>.json``, by default under ``~/.cache/autotp``."""
    root = Path(os.environ.get("AUTOTP_CACHE_DIR") or Path.home() / ".cache" / "autotp")
    return root / "profiles" / (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json")


def cached_calibration(builtin: HardwareProfile) -> HardwareProfile | None:
    """This machine's cached calibration of the GPU kind ``builtin`` describes, if ``autotp calibrate`` wrote one."""
    folder = calibrated_profile_path("x").parent
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        profile = load_profile(path)
        device = profile.name.removesuffix(" (calibrated)")
        if (CPU if device == "CPU" else profile_for_gpu(device)) is builtin:
            log.info("hardware profile: %s's calibration cached in %s", builtin.name, path)
            return profile
    return None


def get_profile(name_or_path: str, calibrated: bool = True) -> HardwareProfile:
    """A built-in profile by name (replaced by this machine's cached calibration of that GPU kind
    unless ``calibrated`` is False), or a JSON profile written by ``autotp calibrate``."""
    builtin = PROFILES.get(name_or_path.lower())
    if builtin is not None:
        return (cached_calibration(builtin) if calibrated else None) or builtin
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return load_profile(Path(name_or_path))
    raise UserInputError(
        f"unknown hardware {name_or_path!r}; use one of {', '.join(PROFILES)} or the path of a JSON "
        "profile written by autotp calibrate"
    )


def profile_to_json(profile: HardwareProfile) -> dict:
    return dataclasses.asdict(profile)


def profile_from_json(data: dict) -> HardwareProfile:
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise UserInputError(f"unknown hardware profile keys {unknown}; expected some of {sorted(fields)}")
    values = dict(data)
    for key in ("p2p", "inter_node"):
        if isinstance(values.get(key), dict):
            values[key] = Link(**values[key])
    values["matmul_curve"] = tuple(tuple(point) for point in values.get("matmul_curve", ()))
    return HardwareProfile(**values)


def load_profile(path: Path) -> HardwareProfile:
    if not path.is_file():
        raise UserInputError(f"hardware profile {path} does not exist; write one with autotp calibrate --out {path}")
    return profile_from_json(json.loads(path.read_text()))


def save_profile(profile: HardwareProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_json(profile), indent=1) + "\n")


def fit_alpha_beta(traffic: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares (alpha, bandwidth) of ``time = alpha + traffic / bandwidth``.

    ``traffic`` is what the operation moves (bytes, or FLOPs for a GEMM). Residuals are
    relative (weighted by 1/time), so the 20 µs small calls count as much as the
    milliseconds-long large ones; alpha is clamped at 0.
    """
    t = np.asarray(times, dtype=float)
    x = np.stack([np.ones_like(t), np.asarray(traffic, dtype=float)], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha = 0.0
        inv_bw = float(np.sum(x[:, 1] / t) / np.sum((x[:, 1] / t) ** 2))
    if inv_bw <= 0:
        raise UserInputError("the measured times do not grow with the message size; measure larger messages")
    return float(alpha), float(1.0 / inv_bw)


def fit_link(curve: tuple[tuple[int, float], ...], ranks: int) -> Link:
    """The ``Link`` whose ring all-reduce reproduces a measured (bytes, bus bytes/s) curve over ``ranks``."""
    traffic = [2 * (ranks - 1) / ranks * n for n, _ in curve]
    times = [sent / bus for sent, (_, bus) in zip(traffic, curve)]
    alpha, bandwidth = fit_alpha_beta(traffic, times)
    return Link(alpha, bandwidth)
