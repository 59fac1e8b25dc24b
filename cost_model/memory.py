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
plus the largest of, over the moments of its schedule (``moment_arrays``: each F, B
and W of ``autotp.ir.schedules``, with what the other microbatches hold then):

* what the others hold: the saved bytes of every microbatch-chunk whose forward ran and
  backward did not, ``ChunkPeaks.deferred`` of every zero-bubble B waiting for its W,
  and the parameter gradients of the chunks a backward (or W) already reached;
* plus the running action's own peak: the chunk's forward peak; its backward peak (the
  first one allocating the chunk's gradients as it goes, a later one adding each new
  gradient in place); a W its deferred bytes (and, the first time, the gradients);
* or the optimizer step: all gradients + its temporaries (``optimizer_transient_bytes``:
  foreach Adam computes sqrt of the second moment for every parameter at once, half the
  state bytes; over the 1/d slice with the distributed optimizer);

plus the CUDA-graph buffers (static inputs and outputs of captured regions; 0 until
regions are planned), once per microbatch in flight: each has its own capture
(``autotp.runtime.execution.cudagraphs``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autotp.ir import schedules
from autotp.ir.schedules import Action
from autotp.ir.training_step import PRECISIONS, TrainingStep
from autotp.ir.training_step import precision as _precision

if TYPE_CHECKING:  # liveness imports torch, which `autotp plan --help` must not load
    from autotp.cost_model.liveness import SegmentMemory

__all__ = ["PRECISIONS", "ChunkPeaks", "bytes_per_param", "chunk_peaks", "grad_bytes_per_param", "held_in_flight", "in_flight", "moment_arrays", "rank_peak_bytes", "schedule_peak_bytes", "schedule_peak_floor"]


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


def held_in_flight(schedule: str | None, pp: int, vpp: int, microbatches: int, rank: int) -> int:
    """The most microbatch-chunks whose activations rank ``rank`` holds at once, the running forward's included
    (``MomentArrays.in_flight``): ``in_flight``, but under ZB-H1 that of 1F1B, its order of F and B (the deferred
    W's hold no activations)."""
    return in_flight("1f1b" if schedule == "zbh1" else schedule, pp, vpp, microbatches, rank)


@dataclass(frozen=True)
class ChunkPeaks:
    """Live bytes of one microbatch through a chunk at a microbatch size (module docstring)."""

    saved: float
    forward: float
    first_backward: float
    later_backward: float
    deferred: float  # held from a zero-bubble B to its W
    grads: float  # its parameter gradients (in the parameters' dtype)


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
    if any(seg.grads_returned_together for seg, _ in parts):  # a later microbatch's gradients live as the first's
        later = max(later, first)
    return ChunkPeaks(prefix, forward, first, later, deferred, sum(n * g for _, n, g, *_ in values))


def persistent_bytes(params: float, precision: str, distributed: bool, dp: int) -> float:
    """Parameters and optimizer state; with the distributed optimizer also its gradient buffer."""
    p = _precision(precision)
    if distributed:
        return params * (p.param + p.grad + p.sharded / dp)
    return params * (p.param + p.sharded)


def optimizer_transient_bytes(params: float, precision: str, distributed: bool, dp: int) -> float:
    return params * _precision(precision).optimizer_state / 2 / (dp if distributed else 1)


@dataclass(frozen=True, eq=False)
class MomentArrays:
    """The distinct moments of a rank's schedule, one row each: the action's chunk, kind (F, B
    or W), whether it allocates the chunk's gradients (``first``: a B or W before which the chunk
    has none), and per local chunk what the other microbatches hold while it runs: ``held``,
    microbatches whose forward of the chunk ran and backward did not; ``deferred``, zero-bubble
    backwards waiting for their W; ``grads``, whether the chunk's parameter gradients exist."""

    chunk: np.ndarray
    forward: np.ndarray
    weight: np.ndarray
    first: np.ndarray
    held: np.ndarray
    deferred: np.ndarray
    grads: np.ndarray
    in_flight: int  # the most microbatch-chunks alive at once (CUDA-graph slots)


@functools.lru_cache(maxsize=8192)
def moment_arrays(name: str | None, pp: int, vpp: int, microbatches: int, rank: int) -> MomentArrays:
    """The moments of rank ``rank``'s schedule (``None``: no pipeline, F then B per microbatch), in order of first
    occurrence. The state an action sees is the one before it, except that a B sees its own microbatch released
    and a W its own deferral ended: running sums over the actions of each change."""
    if name is None or pp == 1:
        actions = [Action(kind, 0, i) for i in range(microbatches) for kind in "FB"]
    else:
        actions = schedules.schedule(name, pp, vpp, microbatches, rank)
    chunks = vpp if name == "interleaved" else 1
    kinds = np.array([a.kind for a in actions])
    chunk = np.array([a.chunk for a in actions])
    forward, backward, weight = kinds == "F", kinds == "B", kinds == "W"
    defers = backward if name == "zbh1" else np.zeros_like(backward)  # a zero-bubble B leaves its W for later
    allocates = (backward & ~defers) | weight
    one_hot = np.zeros((len(actions), chunks), dtype=int)
    one_hot[np.arange(len(actions)), chunk] = 1
    held = np.cumsum(one_hot * (forward.astype(int) - backward)[:, None], axis=0) - one_hot * forward[:, None]
    deferred = np.cumsum(one_hot * (defers.astype(int) - weight)[:, None], axis=0) - one_hot * defers[:, None]
    grads = (np.cumsum(one_hot * allocates[:, None], axis=0) - one_hot * allocates[:, None]) > 0
    first = ~forward & ~grads[np.arange(len(actions)), chunk]
    rows = np.column_stack([np.where(forward, 0, np.where(backward, 1, 2)), chunk, first, held, deferred, grads])
    _, index = np.unique(rows.view(np.dtype((np.void, rows.itemsize * rows.shape[1]))).ravel(), return_index=True)
    keep = np.sort(index)
    held_kept = held[keep].astype(float)
    return MomentArrays(
        chunk=chunk[keep],
        forward=forward[keep],
        weight=weight[keep],
        first=first[keep],
        held=held_kept,
        deferred=deferred[keep].astype(float),
        grads=grads[keep].astype(float),
        in_flight=int(max(held_kept.sum(axis=1) + forward[keep])),
    )


def schedule_peak_bytes(chunks: Sequence[ChunkPeaks], moments: MomentArrays, plain: bool) -> float:
    """The most live bytes at any of the ``moments`` beyond the persistent ones: what the other microbatches hold
    plus the running action's own (module docstring); ``plain``: the parameter gradients are allocated by the
    backward (the distributed optimizer's gradient buffer is persistent)."""
    saved, forward, first_backward, later_backward, deferred, grads = np.array(
        [(k.saved, k.forward, k.first_backward, k.later_backward, k.deferred, k.grads) for k in chunks]
    ).T
    held = moments.held @ saved + moments.deferred @ deferred + plain * (moments.grads @ grads)
    c = moments.chunk
    backward = np.where(plain & moments.first, first_backward[c], later_backward[c])
    own = np.where(moments.forward, forward[c], np.where(moments.weight, deferred[c] + plain * moments.first * grads[c], backward))
    return float((held + own).max())


def schedule_peak_floor(chunks: Sequence[ChunkPeaks], in_flight: int) -> float:
    """At most ``schedule_peak_bytes`` of a schedule whose ``MomentArrays.in_flight`` is ``in_flight``: at its
    fullest moment the other microbatch-chunks hold in_flight - 1 chunks' saved bytes while a forward runs (its own
    peak), or in_flight of them while a B or W runs; every term is at least the smallest of its kind."""
    saved = min(k.saved for k in chunks)
    return (in_flight - 1) * saved + min(saved, min(k.forward for k in chunks))


def rank_peak_bytes(params: float, precision: str, distributed: bool, dp: int, activations: float, in_flight: int,
                    cuda_graph_bytes: float = 0.0) -> float:  # fmt: skip
    """Peak live bytes of a rank holding ``params`` parameter elements, whose schedule holds at most ``activations``
    bytes beyond them (``schedule_peak_bytes``; a ``schedule_peak_floor`` gives a lower bound) and ``in_flight``
    microbatch-chunks at once (``MomentArrays.in_flight``; module docstring)."""
    plain = not distributed
    optimizer = params * _precision(precision).grad * plain + optimizer_transient_bytes(params, precision, distributed, dp)
    return persistent_bytes(params, precision, distributed, dp) + max(optimizer, activations) + in_flight * cuda_graph_bytes