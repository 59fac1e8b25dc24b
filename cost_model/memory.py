"""Memory per rank: model states, activations in flight, CUDA-graph buffers.

**Model states** (``bytes_per_param``): Megatron's table of bytes per parameter, with d
the data-parallel size (the distributed optimizer shards the optimizer states, and the
fp32 copies that live with them, over the d ranks of the dp group; the seed text calls
d "TP×PP", but the sharding is over the data-parallel group):

=====================================  =================  ==================
precision                               plain optimizer    distributed
=====================================  =================  ==================
``bf16``: bf16 params and grads          20                 4 + 16/d
``bf16-fp32-grads``: fp32 grads          18                 6 + 12/d
``fp32``: fp32 params and grads          16                 8 + 8/d
``bf16-pure``: bf16 AdamW, no master     8                  4 + 4/d
=====================================  =================  ==================

The replicated part is the param and grad; the sharded part is the fp32 master copy,
the fp32 main grad where grads are bf16, and Adam's two moments (4 bytes each, or 2 in
``bf16-pure``, what ``torch.optim.AdamW`` keeps for a bf16 model trained by autotp).

**Activations in flight** (``in_flight``), in units of one microbatch through one chunk,
on pipeline rank r of p, with m microbatches and v chunks per rank:

* no pipeline: 1 (microbatches run one after another; gradients accumulate);
* GPipe: m (every forward before the first backward);
* 1F1B: min(p - r, m) (r's p-r-1 warmup forwards, plus the one before its first backward);
* interleaved 1F1B: min((p-r-1)·2 + (v-1)·p + 1, m·v) (its warmup, plus one).

Rank 0 holds the most. A rank's memory (``rank_memory_bytes``) is its parameters times
``bytes_per_param``, plus ``in_flight`` times the activation bytes of one of its chunks,
plus the CUDA-graph buffers (static inputs and outputs of captured regions; 0 until
regions are planned), also ``in_flight`` times: each microbatch in flight has its own
capture (``autotp.runtime.cudagraphs``).
"""

from __future__ import annotations

from autotp.ir.errors import UserInputError

# precision -> (param bytes, grad bytes, optimizer bytes sharded by the distributed optimizer)
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "bf16": (2, 2, 16),
    "bf16-fp32-grads": (2, 4, 12),
    "fp32": (4, 4, 8),
    "bf16-pure": (2, 2, 4),
}


def _precision(name: str) -> tuple[int, int, int]:
    if name not in PRECISIONS:
        raise UserInputError(f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def bytes_per_param(precision: str, distributed_optimizer: bool = False, dp: int = 1) -> float:
    """Bytes of params, grads and optimizer states per parameter (table in the module docstring)."""
    param, grad, sharded = _precision(precision)
    return param + grad + (sharded / dp if distributed_optimizer else sharded)


def grad_bytes_per_param(precision: str) -> int:
    return _precision(precision)[1]


def in_flight(schedule: str | None, pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """Microbatch-chunks whose activations rank ``rank`` holds at its peak (``schedule`` None: no pipeline)."""
    if schedule is None or pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
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
