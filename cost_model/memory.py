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

**Live bytes of a microbatch in a chunk** (``chunk_peaks``) come from the node-by-node
replay of the rank graph (``autotp.cost_model.liveness``: what is alive at every
forward and backward node, per segment), composed over the chunk's segments in order
(preamble, embedding, layers, head): a segment's nodes see its own live bytes plus the
saved bytes of every segment before it (a layer repeated n times: n-1 more copies).
The backward of the first microbatch allocates the parameter gradients as it reaches
them (those of later segments are alive); later microbatches find them all allocated
and add each new one in place (a transient of its size).

**A rank's peak** (``rank_peak_bytes``) is its persistent bytes (parameters and
optimizer state, the distributed optimizer's gradient buffer; ``persistent_bytes``)
plus the largest of, with h = ``in_flight`` and ``others`` = (h - 1) · the largest
chunk's saved bytes (the other microbatches in flight; under ZB-H1 the r of them that
wait for their ``W`` hold only its inputs, ``ChunkPeaks.deferred``):

* a forward: others + the chunk's forward peak (+ all gradients once a backward ran
  before it: m > h);
* the first backward: others + the chunk's first-microbatch backward peak;
* a later backward (m > h): others + all gradients + the chunk's later backward peak;
* the optimizer step: all gradients + its temporaries (``optimizer_transient_bytes``:
  foreach Adam computes sqrt of the second moment for every parameter at once, half the
  state bytes; over the 1/d slice with the distributed optimizer);

plus the CUDA-graph buffers (static inputs and outputs of captured regions; 0 until
regions are planned), h times: each microbatch in flight has its own capture
(``autotp.runtime.cudagraphs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autotp.cost_model.liveness import SegmentMemory
from autotp.ir.training_step import PRECISIONS, TrainingStep
from autotp.ir.training_step import precision as _precision

__all__ = ["PRECISIONS", "ChunkPeaks", "bytes_per_param", "chunk_peaks", "grad_bytes_per_param", "in_flight", "rank_peak_bytes"]


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


@dataclass(frozen=True)
class ChunkPeaks:
    """Live bytes of one microbatch through a chunk at a microbatch size (module docstring)."""

    saved: float
    forward: float
    first_backward: float
    later_backward: float
    deferred: float  # held from a zero-bubble B to its W


def chunk_peaks(parts: list[tuple[SegmentMemory, int]], batch: int) -> ChunkPeaks:
    """``parts``: the chunk's segments in forward order, each with its number of copies."""
    at = np.array([1.0, batch])
    values = []
    deferred = sum(n * float(seg.deferred @ at) for seg, n in parts)
    for seg, copies in parts:
        values.append((
            float(seg.saved @ at), copies, float(seg.param_grads @ at), float(np.max(seg.forward @ at)),
            float(np.max((seg.backward + seg.own_grads) @ at)), float(np.max((seg.backward + seg.grad_transient) @ at)),
        ))  # fmt: skip
    forward = first = later = 0.0
    prefix = 0.0
    grads_after = sum(n * g for _, n, g, *_ in values)
    for saved, n, grads, fwd, bwd_first, bwd_later in values:
        grads_after -= n * grads
        last = prefix + (n - 1) * saved  # the last copy: every earlier one's saved bytes are alive
        forward = max(forward, last + fwd)
        later = max(later, last + bwd_later)
        # backward runs the last copy first; the first copy sees the others' gradients instead of their activations
        first = max(first, last + grads_after + bwd_first, prefix + grads_after + (n - 1) * grads + bwd_first)
        prefix += n * saved
    return ChunkPeaks(prefix, forward, first, later, deferred)


def persistent_bytes(params: float, precision: str, distributed: bool, dp: int) -> float:
    """Parameters and optimizer state; with the distributed optimizer also its gradient buffer."""
    p = _precision(precision)
    if distributed:
        return params * (p.param + p.grad + p.sharded / dp)
    return params * (p.param + p.sharded)


def optimizer_transient_bytes(params: float, precision: str, distributed: bool, dp: int) -> float:
    return params * _precision(precision).optimizer_state / 2 / (dp if distributed else 1)


def rank_peak_bytes(
    params: float,
    precision: str,
    distributed: bool,
    dp: int,
    chunks: list[ChunkPeaks],
    held: int,
    microbatches: int,
    cuda_graph_bytes: float = 0.0,
    deferred: int = 0,
) -> float:
    """Peak live bytes of a rank holding ``params`` parameter elements and ``chunks`` (module
    docstring); ``deferred`` of the ``held`` microbatches wait for their zero-bubble W only."""
    grads = 0.0 if distributed else params * _precision(precision).grad  # the buffer is persistent
    others = (held - deferred - 1) * max(c.saved for c in chunks) + deferred * max(c.deferred for c in chunks)
    steady = microbatches > held
    peaks = [grads + optimizer_transient_bytes(params, precision, distributed, dp)]
    for c in chunks:
        peaks.append(others + c.forward + (grads if steady else 0.0))
        peaks.append(others + (c.later_backward if distributed else c.first_backward))
        if steady:
            peaks.append(others + grads + c.later_backward)
    return persistent_bytes(params, precision, distributed, dp) + max(peaks) + held * cuda_graph_bytes
