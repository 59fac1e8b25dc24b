"""One candidate's predicted training step (``estimate``), and the variant of it that wins (``best_estimate``).

**Estimate** of one candidate (``estimate``), ranks in Megatron's order (tp fastest,
then dp, then pp):

* stage cuts between layers (``ModelCosts.layer_chunks``: ``balanced_cuts`` of the layer weights);
* chunk time, per microbatch = its segments' ``compute.segment_time`` (forward +
  backward, tp collectives, host issue), the preamble's included (every chunk repeats
  it) + the receives of the hidden state b·s·h
  (forward from the previous chunk, gradient from the next; b·s·h/tp with sequence parallelism) over NVLink when a model
  replica fits in a node (tp·dp·pp <= G), else over the inter-node link + the host's
  fixed cost of calling the chunk forward and backward (``call_host_s``) + gradient
  accumulation (every microbatch after the first adds its gradients to ``.grad``, 3
  gradient bytes moved per parameter: (m-1)/m of that per microbatch);
* pipeline time and bubble: ``bubble.pipeline_time_s`` (the fill and drain from the
  chunks' GPU time);
* gradient sync, plain optimizer (autotp's runtime with a torch optimizer: after the
  backward, not overlapped with it): per 25 MB bucket of n_k tensors, GPU time = an
  all-reduce over the dp group (``communication.group_all_reduce_s``, min(dp, G/tp) of
  its ranks per node) + 6 bytes moved per gradient byte (concatenate, divide, copy back);
  host time = (3 + 4·n_k) ops (cat, all-reduce, divide; per tensor a reshape, a slice, a
  view and a copy) at ``op_overhead_s``. The buckets run as a ``compute.queue_s`` queue:
  the host issues bucket k+1 while the GPU reduces bucket k, so the sync costs max-like,
  not the sum of host and GPU time; tied embeddings with pp > 1 all-reduce their
  gradient between the first and last stages;
* gradient sync, distributed optimizer (``autotp.DistributedOptimizer``): reduce-scatter
  overlapped with the last microbatch's backward (``BACKWARD_SHARE`` of the rank's chunk
  GPU time), then the parameters' all-gather, overlapped with the next forward (the rest) but
  its first bucket, unless ``overlap_param_gather`` is off or CUDA graphs run (``dp_sync.sharded_sync_s``);
* optimizer step: the bytes a foreach AdamW moves (``dp_sync.adamw_bytes_per_param``) over
  the rank's parameters, its 1/dp slice with the distributed optimizer, at
  ``HardwareProfile.optimizer_rate`` (``dp_sync.optimizer_step_s``); ``train_step`` does not run it, the step time includes it;
* step = pipeline + gradient sync + optimizer; tokens/s = B·s/step; host wait = m · Σ (chunk time − chunk GPU
  time) over the busiest rank's chunks: how long its GPU waits for the host (the plan's ``host_share`` of the step,
  which the machine's host constants decide: ``autotp calibrate`` measures them);
  MFU = 3 · forward FLOPs of B samples / (step · gpus · peak FLOP/s);
* memory per GPU: the fullest rank's ``memory.rank_peak_bytes`` (live bytes replayed from the graph);
* small linears: a linear whose sharding saves less compute per microbatch,
  (1 - 1/t) · 3 · its forward FLOPs / GEMM rate, than one tp all-reduce's latency costs
  is replicated (``plan_tensor_parallel(replicate=...)``) in one of the variants below.

**Variants** of a candidate (``best_estimate``), each estimated as above on the rank graph
compiled for it (``ModelCosts.rank``):

* the optimizer (``Training.distributed_optimizer``): plain, or distributed where dp > 1
  (``autotp.ir.training_step``; None tries both, except for ``bf16-pure``);
* the layout: every linear sharded, or the small linears replicated;
* sequence parallelism, where tp > 1 and it splits the sequence (``passes/sequence_parallel``;
  ``Training.sequence_parallel`` None tries both): the norms, residual adds and dropout run
  on s/tp tokens (their time in ``segment_time`` of the compiled graph), each all-reduce
  becomes a reduce-scatter + all-gather pair (the same bytes in two calls: two latencies,
  two host costs), the weights those ops read (norms) get their partial gradients
  all-reduced, the activations between the tp regions are s/tp tokens
  (``liveness.simulate`` on the local shapes), the pipeline sends b·s·h/tp;
* with it, overlap (``Training.tp_overlap`` None tries both): the all-gathers before and the
  reduce-scatters after GEMMs run as ``all_gather_matmul`` / ``matmul_reduce_scatter``
  (``passes/tp_overlap``), charged only what the GEMM leaves exposed
  (``communication.overlapped_s``) plus the GEMM split into t chunks (``compute.gemm_pieces``).

For each optimizer, the fastest variant that fits in ``HardwareProfile.usable_memory_bytes``
wins (memory is computed in order of step time, until one fits, and in ``search`` skipped where the
rank's parameters and optimizer state alone exceed it: ``memory.persistent_bytes``), else the leanest; of the
two optimizers, the faster that fits (``PlanEstimate.needs_distributed_optimizer``: only
the distributed one fits). A user's ``True``/``False`` for any of them fixes it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from autotp.cost_model.bubble import pipeline_time_s
from autotp.cost_model.candidates import Cluster, Config
from autotp.cost_model.communication import all_reduce_s, p2p_s
from autotp.cost_model.compute import ModelCosts, Segment, SegmentTime, segment_time
from autotp.cost_model.dp_sync import grad_sync_s, optimizer_step_s, sharded_sync_s
from autotp.cost_model.hardware import HardwareProfile
from autotp.cost_model.liveness import SegmentMemory
from autotp.cost_model.memory import ChunkPeaks, chunk_peaks, grad_bytes_per_param, persistent_bytes, rank_peak_bytes
from autotp.cost_model.memory import moment_arrays
from autotp.cost_model.recompute import recomputed
from autotp.ir.errors import UserInputError
from autotp.ir.plan import OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER

BACKWARD_SHARE = 2 / 3  # of a microbatch's forward + backward GPU time
OVERLAP_BOTH = (OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER)


@dataclass(frozen=True)
class Training:
    """What is trained: ``global_batch`` samples per step of the traced sequence length,
    and the training step. ``distributed_optimizer``, ``sequence_parallel`` and
    ``tp_overlap`` None: the planner picks, per candidate (module docstring)."""

    global_batch: int
    precision: str = "bf16"
    distributed_optimizer: bool | None = False
    gather_outputs: bool = False
    cuda_graph_bytes: float = 0.0  # static buffers of one capture (one microbatch in flight)
    overlap_param_gather: bool = True  # the distributed optimizer's all-gather hides behind the next forward
    sequence_parallel: bool | None = None  # with tp > 1 (``ParallelPlan.sequence_parallel``)
    tp_overlap: bool | None = None  # with sequence parallelism (``ParallelPlan.tp_overlap``)
    fp8: str = ""  # the FP8 recipe of the decoder GEMMs ("": none; ``ParallelPlan.fp8``)
    # every decoder layer recomputed in the backward; None: where a candidate needs it to fit. Off unless asked: the
    # candidates it rescues win at scale through comm and host terms that no multi-GPU run has checked yet
    recompute: bool | None = False

    def __post_init__(self) -> None:
        if self.tp_overlap and self.sequence_parallel is False:
            raise UserInputError(
                "tp_overlap=True overlaps the all-gathers and reduce-scatters of sequence parallelism; "
                "leave sequence parallelism on or to the planner, or turn the overlap off"
            )


@dataclass(frozen=True)
class Variant:
    """The choices of one candidate that ``best_estimate`` weighs (module docstring)."""

    replicate: frozenset[str] = frozenset()
    distributed: bool = False
    sequence_parallel: bool = False
    tp_overlap: tuple[str, ...] = ()
    recompute: bool = False


@dataclass(frozen=True)
class Estimate:
    """Predicted step of one candidate, before it is turned into a ``ParallelPlan``."""

    config: Config
    replicate: frozenset[str]
    step_s: float
    bubble_s: float
    comm_s: float
    optimizer_s: float
    mem_bytes_per_gpu: float
    tokens_per_s: float
    mfu: float
    distributed_optimizer: bool = False
    needs_distributed_optimizer: bool = False  # the plain optimizer would not fit
    sequence_parallel: bool = False
    tp_overlap: tuple[str, ...] = ()
    host_wait_s: float = 0.0  # of the busiest rank's chunks, the time its GPU waits for the host to issue work
    recompute: bool = False  # every decoder layer recomputes its activations in the backward


def small_linears(costs: ModelCosts, tp: int, batch: int, hw: HardwareProfile) -> frozenset[str]:
    """Linears whose sharding saves less compute per microbatch than one tp all-reduce's latency."""
    if tp == 1:
        return frozenset()
    return frozenset(
        name
        for name, flops in costs.linears
        if (1 - 1 / tp) * 3 * flops * batch / hw.matmul_flops_per_s < hw.collective_latency_s
    )


@functools.lru_cache(maxsize=256)
def _chunk_layers(costs: ModelCosts, chunks: int) -> tuple[Counter, ...]:
    """For each chunk, how many model layers of each traced layer it holds (cached)."""
    out: list[Counter] = [Counter() for _ in range(chunks)]
    for layer, chunk in enumerate(costs.layer_chunks(chunks)):
        out[chunk][costs.traced_index(layer)] += 1
    return tuple(out)


def estimate(
    costs: ModelCosts, cluster: Cluster, training: Training, config: Config, replicate: frozenset[str] = frozenset(),
    distributed: bool = False, *, sequence_parallel: bool | None = None, tp_overlap: tuple[str, ...] | None = None,
) -> Estimate:  # fmt: skip
    """Predicted step time and memory of ``config`` (formulas in the module docstring); ``sequence_parallel``,
    ``tp_overlap`` None and the recompute follow ``training`` (its None: off)."""
    sp = bool(training.sequence_parallel) if sequence_parallel is None else sequence_parallel
    overlap = (OVERLAP_BOTH if sp and training.tp_overlap else ()) if tp_overlap is None else tp_overlap
    draft = _draft(costs, cluster, training, config, Variant(replicate, distributed, sp, overlap, bool(training.recompute)))
    return replace(draft.estimate, mem_bytes_per_gpu=draft.memory())


@dataclass(frozen=True)
class _Draft:
    """An ``Estimate`` without its memory; ``memory()`` computes it (the slower half), ``floor`` is at most that:
    the fullest rank's parameters and optimizer state (``memory.persistent_bytes``)."""

    estimate: Estimate
    memory: Callable[[], float]
    floor: float


def _draft(costs: ModelCosts, cluster: Cluster, training: Training, config: Config, v: Variant) -> _Draft:
    hw = cluster.hardware
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    rc = costs.rank(config.tp, v.replicate, training.gather_outputs, sequence_parallel=v.sequence_parallel,
                    tp_overlap=v.tp_overlap, fp8=training.fp8)  # fmt: skip
    b, m, pp, vpp = config.microbatch_size, config.microbatches, config.pp, config.vpp
    chunks = pp * vpp

    def timed(seg: Segment, recompute: bool = False) -> SegmentTime:
        return _segment_time(seg, b, hw, min(config.tp, per_node), recompute)

    layers = [timed(seg, v.recompute) for seg in rc.layers]
    preamble = timed(rc.preamble)
    ends: dict[int, list] = {0: [(rc.embedding, timed(rc.embedding))]}
    ends.setdefault(chunks - 1, []).append((rc.head, timed(rc.head)))
    in_node = config.tp * config.dp * pp <= per_node
    hidden = costs.hidden_bytes * b / (config.tp if rc.plan.sequence_parallel else 1)
    hop = p2p_s(hidden, hw.p2p_link if in_node else hw.inter_node)
    layer_memory = {id(seg): recomputed(seg.memory) if v.recompute else seg.memory for seg in rc.layers}
    chunk_s, chunk_gpu, chunk_comm, chunk_mem, chunk_params = [], [], [], [], []
    layer_ids = {id(seg) for seg in rc.layers}
    alike: dict[tuple, tuple] = {}  # chunks of the same layers, ends and neighbours cost the same
    for c, counts in enumerate(_chunk_layers(costs, chunks)):
        key = (tuple(sorted(counts.items())), c == 0, c == chunks - 1)
        if key not in alike:
            parts = [(rc.layers[j], layers[j], n) for j, n in counts.items()] + [(seg, st, 1) for seg, st in ends.get(c, [])]
            parts.append((rc.preamble, preamble, 1))
            recv = hop * ((c > 0) + (c < chunks - 1))
            grads = sum(n * seg.param_numel for seg, _, n in parts) * grad_bytes_per_param(training.precision)
            accumulate = (m - 1) / m * 3 * grads / hw.memory_bytes_per_s
            ordered = [(rc.preamble, 1)] + [(seg, 1) for seg, _ in ends.get(c, []) if seg is rc.embedding]
            ordered += [(rc.layers[j], n) for j, n in sorted(counts.items())] + [(seg, 1) for seg, _ in ends.get(c, []) if seg is rc.head]
            alike[key] = (sum(n * st.total_s for _, st, n in parts) + recv + accumulate + hw.call_host_s,
                          sum(n * st.gpu_s for _, st, n in parts) + recv + accumulate,
                          sum(n * st.comm_s for _, st, n in parts) + recv,
                          tuple((layer_memory.get(id(seg), seg.memory), n) for seg, n in ordered),
                          [(seg.params, n, id(seg) in layer_ids) for seg, _, n in parts])  # fmt: skip
        for out, value in zip((chunk_s, chunk_gpu, chunk_comm, chunk_mem, chunk_params), alike[key]):
            out.append(value)
    pipeline, bubble = pipeline_time_s(chunk_s, chunk_gpu, pp, vpp, m, config.schedule or "1f1b")

    dp_per_node = max(1, min(config.dp, per_node // config.tp))
    held = [_rank_params(chunk_params[r::pp]) for r in range(pp)]
    syncs: dict[tuple, float] = {}  # ranks holding the same parameters and GPU time sync alike
    optimizers = []
    for r, (params, tensors) in enumerate(held):
        if v.distributed:
            backward = BACKWARD_SHARE * sum(chunk_gpu[r::pp])
            forward = (1 - BACKWARD_SHARE) * sum(chunk_gpu[r::pp]) if training.overlap_param_gather and not training.cuda_graph_bytes else 0.0
            key = (params, backward, forward)
            if key not in syncs:
                syncs[key] = sharded_sync_s(params, training.precision, config.dp, dp_per_node, backward, hw, forward)
            optimizers.append(optimizer_step_s(params, training.precision, config.dp, hw))
        else:
            key = (params, tensors)
            if key not in syncs:
                syncs[key] = grad_sync_s(params, tensors, config.dp, dp_per_node, training.precision, hw)
            optimizers.append(optimizer_step_s(params, training.precision, 1, hw))
    tied = set(rc.embedding.params) & set(rc.head.params)
    tied_s = 0.0
    if tied and pp > 1:
        nbytes = sum(rc.embedding.params[name] for name in tied) * grad_bytes_per_param(training.precision)
        tied_s = all_reduce_s(nbytes, 2, hw.p2p_link if in_node else hw.inter_node)
    busiest = max(range(pp), key=lambda r: sum(chunk_s[r::pp]))
    sync = max(syncs.values()) + tied_s
    step = pipeline + sync + max(optimizers)
    tokens = training.global_batch * costs.seq

    def memory() -> float:
        peaks = [_chunk_peaks(parts, b) for parts in chunk_mem]
        # Ranks holding the same bytes differ only in the microbatches in flight, which no schedule gives a later rank
        # more of than an earlier one: the first rank of each such group has the group's peak.
        first: dict[tuple, int] = {}
        for r in range(pp):
            first.setdefault((held[r][0], tuple(peaks[r::pp])), r)
        return max(
            _rank_peak_bytes(params, training.precision, v.distributed, config.dp, peaks_r, (config.schedule, pp, vpp, m, r),
                             training.cuda_graph_bytes)
            for (params, peaks_r), r in first.items()
        )  # fmt: skip

    draft = Estimate(
        config=config,
        replicate=v.replicate,
        step_s=step,
        bubble_s=bubble,
        comm_s=m * sum(chunk_comm[busiest::pp]) + sync,
        optimizer_s=max(optimizers),
        mem_bytes_per_gpu=math.nan,
        tokens_per_s=tokens / step,
        mfu=3 * costs.forward_flops(training.global_batch) / (step * cluster.gpus * hw.mfu_flops_per_s),
        distributed_optimizer=v.distributed,
        sequence_parallel=rc.plan.sequence_parallel,
        tp_overlap=v.tp_overlap if rc.plan.sequence_parallel else (),
        host_wait_s=m * sum(s - g for s, g in zip(chunk_s[busiest::pp], chunk_gpu[busiest::pp])),
        recompute=v.recompute,
    )
    floor = max(persistent_bytes(params, training.precision, v.distributed, config.dp) for params, _ in held)
    return _Draft(draft, memory, floor)


@functools.lru_cache(maxsize=4096)
def _segment_time(seg: Segment, batch: int, hw: HardwareProfile, tp_ranks_per_node: int, recompute: bool = False) -> SegmentTime:
    """``segment_time``, once per segment and microbatch size: candidates of one tp share their segments."""
    return segment_time(seg, batch, hw, tp_ranks_per_node, recompute)


@functools.lru_cache(maxsize=4096)
def _chunk_peaks(parts: tuple[tuple[SegmentMemory, int], ...], batch: int) -> ChunkPeaks:
    """``chunk_peaks``, once per chunk layout and microbatch size."""
    return chunk_peaks(list(parts), batch)


@functools.lru_cache(maxsize=65536)
def _rank_peak_bytes(params: int, precision: str, distributed: bool, dp: int, peaks: tuple[ChunkPeaks, ...],
                     schedule: tuple[str | None, int, int, int, int], cuda_graph_bytes: float) -> float:  # fmt: skip
    """``rank_peak_bytes`` of rank ``schedule[-1]`` of ``schedule_moments(*schedule)``, once per distinct input
    (variants whose chunks hold the same bytes, ranks holding the same chunks at the same moments)."""
    return rank_peak_bytes(params, precision, distributed, dp, list(peaks), moment_arrays(*schedule), cuda_graph_bytes)


def _rank_params(chunks: list[list[tuple[dict[str, int], int, bool]]]) -> tuple[int, int]:
    """(elements, tensors) of the parameters one rank holds: a decoder layer counted per copy (its traced names stand
    for every layer it represents, in every chunk), the other segments' names once (a tied embedding and head)."""
    names: dict[str, int] = {}
    numel = tensors = 0
    for parts in chunks:
        for params, copies, layer in parts:
            if layer:
                numel += copies * sum(params.values())
                tensors += copies * len(params)
            else:
                names.update(params)
    return numel + sum(names.values()), tensors + len(names)


def sequence_options(training: Training, tp: int, splits: bool = True) -> list[tuple[bool, tuple[str, ...]]]:
    """(sequence parallelism, overlapped kinds) to weigh at ``tp``; ``splits``: sequence parallelism can split the sequence."""
    if tp == 1 or training.sequence_parallel is False or not splits:
        return [(False, ())]
    overlaps = [OVERLAP_BOTH] if training.tp_overlap else [()] if training.tp_overlap is False else [(), OVERLAP_BOTH]
    off = [] if training.sequence_parallel or training.tp_overlap else [(False, ())]
    return off + [(True, o) for o in overlaps]


def best_estimate(
    costs: ModelCosts, cluster: Cluster, training: Training, config: Config, *, splits: bool = True, exact: bool = True,
) -> Estimate:  # fmt: skip
    """The fastest fitting variant of ``config`` (module docstring); ``splits``: sequence parallelism can split its
    sequence. Without ``exact``, a candidate that fits in no variant may carry a lower bound of its memory."""
    forced = training.distributed_optimizer
    if config.dp == 1:
        options = [bool(forced)]
    elif forced is None and training.precision == "bf16-pure":
        options = [False]
    else:
        options = [False, True]
    small = small_linears(costs, config.tp, config.microbatch_size, cluster.hardware)
    layouts = [frozenset(), small] if small else [frozenset()]
    sequence = sequence_options(training, config.tp, splits)
    capacity = cluster.hardware.usable_memory_bytes
    for recompute in [False, True] if training.recompute is None else [training.recompute]:
        found = {
            d: _fastest_fitting(
                [_draft(costs, cluster, training, config, Variant(r, d, sp, o, recompute)) for r in layouts for sp, o in sequence],
                capacity, exact,
            )  # fmt: skip
            for d in options
        }
        allowed = [e for d, e in found.items() if forced is None or d == forced]
        fitting = [e for e in allowed if e.mem_bytes_per_gpu <= capacity] or allowed
        best = min(fitting, key=lambda e: (e.step_s, e.mem_bytes_per_gpu))
        if best.mem_bytes_per_gpu <= capacity:
            break
        lean = Variant(best.replicate, best.distributed_optimizer, best.sequence_parallel, best.tp_overlap)
        if _draft(costs, cluster, training, config, lean).floor > capacity:
            break  # its parameters and optimizer state alone do not fit: recomputing activations cannot help
    needs = best.distributed_optimizer and False in found and found[False].mem_bytes_per_gpu > capacity
    return replace(best, needs_distributed_optimizer=needs)


def _fastest_fitting(drafts: list[_Draft], capacity: float, exact: bool) -> Estimate:
    """The fastest draft whose memory fits (ties: the leaner), else the leanest; memory is computed in order of step
    time, and not where its floor already exceeds ``capacity`` unless ``exact``."""
    measured: list[Estimate] = []
    fits: Estimate | None = None
    for draft in sorted(drafts, key=lambda d: d.estimate.step_s):
        if fits is not None and draft.estimate.step_s > fits.step_s:
            break
        over = not exact and draft.floor > capacity
        est = replace(draft.estimate, mem_bytes_per_gpu=draft.floor if over else draft.memory())
        measured.append(est)
        if est.mem_bytes_per_gpu <= capacity and (fits is None or est.mem_bytes_per_gpu < fits.mem_bytes_per_gpu):
            fits = est
    return fits if fits is not None else min(measured, key=lambda e: (e.mem_bytes_per_gpu, e.step_s))
