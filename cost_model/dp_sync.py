"""Data-parallel gradient sync: autotp's all-reduce buckets (``grad_sync_s``, formulas in
``autotp.cost_model.planner``'s docstring) and the distributed optimizer's reduce-scatter,
all-gather and step (``autotp.DistributedOptimizer``).

One rank's gradients, ``G = params · grad bytes``, sit in buckets of ``DP_BUCKET_BYTES``
(k buckets, the last one smaller). Each bucket is reduce-scattered over the dp group as
soon as the last microbatch's backward has produced it, so all buckets but the last
overlap with that backward (``W``: the rank's backward GPU time of one microbatch):

    exposed reduce-scatter = max(Σ_j RS(b_j) - W, RS(b_last))

After the step the updated parameters (``params · param bytes``, the same buckets) are
all-gathered, one bucket after the other in order of first use, and the next forward
waits for each bucket only before its first read (``overlap_param_gather``). The first
bucket has nothing to hide behind; the rest overlap the next forward (``F``: the rank's
forward GPU time of its first microbatch):

    exposed all-gather = max(Σ_j AG(b_j) - F, AG(b_first))

(F = 0 without the overlap, with CUDA graphs: then all of ``Σ_j AG(b_j)`` is exposed).
RS and AG run hierarchically across nodes
(``communication.group_sharded_s``); together they move the bytes of one all-reduce. The host issues one collective and one divide per
bucket (``op_overhead_s`` each).

The optimizer step (``optimizer_step_s``) touches this rank's 1/d slice only (d = 1: the
plain optimizer): ``adamw_bytes_per_param · params / d`` bytes at
``HardwareProfile.optimizer_rate``. ``torch.optim.AdamW(foreach=True)`` (``_multi_tensor_adam``)
runs one pass per foreach op over the tensor it steps (w bytes: the fp32 master where kept,
else the parameter), the two moments (s bytes each) and the gradient it reads (g: the fp32
copy where kept, else the grad): weight decay ``mul_`` (2w), ``lerp_`` of the first moment
(2s + g), ``mul_`` (2s) and ``addcmul_`` (2s + 2g) of the second, ``sqrt`` (2s), ``div_``
(2s), ``add_`` of eps (2s), ``addcdiv_`` into w (2w + 2s): 4w + 14s + 3g (42 bytes for
bf16-pure, where the old count, every state read and written once, gave 16). A master is
copied back into the 16-bit parameter (w + param bytes), a grad copy made first (grad +
copy bytes).
"""

from __future__ import annotations

import math

import numpy as np

from autotp.cost_model.communication import group_all_reduce_s, group_sharded_s
from autotp.cost_model.compute import queue_s
from autotp.cost_model.hardware import HardwareProfile
from autotp.ir.plan import DP_BUCKET_BYTES
from autotp.ir.training_step import precision

GRAD_SYNC_BYTES_MOVED = 6
GRAD_SYNC_BUCKET_OPS, GRAD_SYNC_TENSOR_OPS = 3, 4


def grad_sync_s(params: int, tensors: int, dp: int, dp_per_node: int, precision_name: str, hw: HardwareProfile) -> float:
    """``autotp.runtime.gradients.grad_sync.all_reduce_buckets`` of one rank's gradients, as a host/GPU queue."""
    if dp == 1:
        return 0.0
    total = params * precision(precision_name).grad
    buckets = max(1, math.ceil(total / DP_BUCKET_BYTES))
    sizes = np.full(buckets, float(DP_BUCKET_BYTES))
    sizes[-1] = total - (buckets - 1) * DP_BUCKET_BYTES
    full, last = (group_all_reduce_s(n, dp, dp_per_node, hw) for n in (DP_BUCKET_BYTES, sizes[-1]))
    reduce = np.full(buckets, full)
    reduce[-1] = last
    gpu = reduce + GRAD_SYNC_BYTES_MOVED * sizes / hw.memory_bytes_per_s
    host = (GRAD_SYNC_BUCKET_OPS + GRAD_SYNC_TENSOR_OPS * tensors * sizes / total) * hw.op_overhead_s
    return queue_s(host, gpu)


def _buckets(total: float) -> list[float]:
    k = max(1, math.ceil(total / DP_BUCKET_BYTES))
    return [float(DP_BUCKET_BYTES)] * (k - 1) + [total - (k - 1) * DP_BUCKET_BYTES]


def sharded_sync_s(params: int, precision_name: str, dp: int, dp_per_node: int, backward_s: float, hw: HardwareProfile,
                   forward_s: float = 0.0) -> float:  # fmt: skip
    """Exposed reduce-scatter (behind ``backward_s``) and all-gather (behind the next forward's
    ``forward_s``) of one rank's ``params`` over ``dp`` ranks (module docstring)."""
    if dp == 1:
        return 0.0
    p = precision(precision_name)
    grads = _buckets(params * p.grad)
    full, last = grads[0], grads[-1]  # every bucket but the last is full
    scatter, scatter_last = (group_sharded_s(b, dp, dp_per_node, hw) for b in (full, last))
    gather, gather_last = (group_sharded_s(b * p.param / p.grad, dp, dp_per_node, hw) for b in (full, last))
    k = len(grads) - 1
    host = 2 * 2 * len(grads) * hw.op_overhead_s
    # buckets are laid out in reverse order of use: the last one is read first
    return (max(k * scatter + scatter_last - backward_s, scatter_last) + max(k * gather + gather_last - forward_s, gather_last)
            + host)  # fmt: skip


def adamw_bytes_per_param(precision_name: str) -> int:
    """Bytes a foreach AdamW step moves per parameter (module docstring)."""
    p = precision(precision_name)
    stepped, grad, moment = p.master or p.param, p.grad_copy or p.grad, p.optimizer_state // 2
    master = stepped + p.param if p.master else 0
    grad_copy = p.grad + p.grad_copy if p.grad_copy else 0
    return 4 * stepped + 14 * moment + 3 * grad + master + grad_copy


def optimizer_step_s(params: int, precision_name: str, dp: int, hw: HardwareProfile) -> float:
    """Memory time of stepping this rank's 1/dp slice (dp = 1: the plain optimizer)."""
    return adamw_bytes_per_param(precision_name) * params / dp / hw.optimizer_rate
