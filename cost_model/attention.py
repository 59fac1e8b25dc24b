"""Which kernel causal attention runs on (``plan.attention_backend``, ``passes/attention_backend``).

torch's ``scaled_dot_product_attention`` tries FlashAttention-2 first. On Hopper (compute
capability 9.x) with cuDNN 9, cuDNN's fused attention runs the same causal attention faster
(PyTorch 2.5 release notes: up to 75% over FlashAttention-2 on H100; torch ranks it after flash
since 2.5.1 for numerical issues with some shapes, which the pass avoids by rewriting only
unmasked, dropout-free calls of equal head counts and head dim <= 128).
``benchmarks/bench_single_gpu.py --sdpa`` measures both on the device.

Rule: ``"cudnn"`` on a CUDA device of compute capability 9.x whose cuDNN is 9 or newer, else
``""`` (torch's own choice).
"""

from __future__ import annotations

import torch

from autotp.ir.plan import ATTENTION_CUDNN
_HOPPER = 9
_CUDNN_9 = 90000


def attention_backend(device: torch.device) -> str:
    """The attention kernel for graphs that run on ``device``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    major, _ = torch.cuda.get_device_capability(device)
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return ATTENTION_CUDNN if major == _HOPPER and version is not None and version >= _CUDNN_9 else ""
