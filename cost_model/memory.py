"""Memory per rank: model states, activations in flight, CUDA-graph buffers.

**Model states** (``bytes_per_param``): bytes per parameter of the training step
(``autotp.ir.training_step``: Megatron's table, shared with the runtime), with d the
data-parallel size; the distributed optimizer shards the optimizer state, the fp32
master weights and the fp32 copy of 16-bit grads over the d ranks of the dp group (the
seed text calls d "TP×PP", but the sharding is over the data-parallel group):

=====================================  =================  ==================
precision                               plain optimizer    distributed
=====================================  =================  ==================
``bf16``: bf16 params and grads          20                 4 + 16/d
``bf16-fp32-grads``: fp32 grads          18                 6 + 12/d
``fp32``: fp32 params and grads          16                 8 + 8/d
``bf16-pure``: bf16 AdamW, no master     8                  4 + 4/d
=====================================  =================  ==================

**Activations in flight** (``in_flight``), in units of one microbatch through one chunk,
on pipeline rank r of p, with m microbatches and v chunks per rank:

* no pipeline: 1 (microbatches run one after another; gradients accumulate);
* GPipe: m (every forward before the first backward);
* 1F1B: min(p - r, m) (r's p-r-1 warmup forwards, plus the one before its first backward);
* interleaved 1F1B: min((p-r-1)·2 + (v-1)·p + 1, m·v) (its warmup, plus one);
* ZB-H1: min(p, m) on every rank (1F1B's p-r, plus the r microbatches whose weight
  gradients it defers; their autograd graphs stay until their ``W``).

Rank 0 holds the most. A rank's memory (``rank_memory_bytes``) is its parameters times
``bytes_per_param``, plus ``in_flight`` times the activation bytes of one of its chunks,
plus the CUDA-graph buffers (static inputs and outputs of captured regions; 0 until
regions are planned), also ``in_flight`` times: each microbatch in flight has its own
capture (``autotp.runtime.cudagraphs``).
"""

from __future__ import annotations

from autotp.ir.training_step import PRECISIONS, TrainingStep
from autotp.ir.training_step import precision as _precision

__all__ = ["PRECISIONS", "bytes_per_param", "grad_bytes_per_param", "in_flight", "rank_memory_bytes"]


def bytes_per_param(precision: str, distributed_optimizer: bool = False, dp: int = 1) -> float:
    """Bytes of params, grads and optimizer states per parameter (table in the module docstring)."""
    return TrainingStep(precision, distributed_optimizer).bytes_per_param(dp)


def grad_bytes_per_param(precision: str) -> int:
    return _precision(precision).grad


def in_flight(schedule: str | None, pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """Microbatch-chunks whose activations rank ``rank`` holds at its peak (``schedule`` None: no pipeline)."""
    if schedule is None or pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
    if schedule == "zbh1":
        return min(pp, microbatches)
    assert schedule == "interleaved", f"unknown schedule {schedule!r}"
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, microbatches * vpp)


def rank_memory_bytes(
    params: float,
    precision: str,
    distributed_optimizer: bool,
    dp: int,
    activation_bytes: float,
    cuda_graph_bytes: float = 0.0,
) -> float:
    """Model states of ``params`` parameters plus the activations and CUDA-graph buffers held."""
    return params * bytes_per_param(precision, distributed_optimizer, dp) + activation_bytes + cuda_graph_bytes
