"""One candidate's predicted training step (``estimate``), and the variant of it that wins (``best_estimate``).

**Estimate** of one candidate (``estimate``), ranks in Megatron's order (tp fastest,
then dp, then pp):

* stage cuts between layers (``ModelCosts.layer_chunks``: ``balanced_cuts`` of the layer weights);
* chunk time, per microbatch = its segments' ``compute.segment_time`` (forward +
  backward, tp collectives, host issue), the preamble's included (every chunk repeats
  it) + the receives of the hidden state b·s·h
  (forward from the previous chunk, gradient from the next; b·s·h/tp with sequence parallelism) over NVLink when a model
  replica fits in a node (tp·dp·pp <= G), else over the inter-node link + the host's
  fixed cost of calling the chunk forward and backward (``call_host_s``; compiled: ``compiled_call_host_s``) + gradient
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
* memory per GPU: the fullest rank's ``memory.rank_peak_bytes`` (live bytes replayed from the graph over its
  schedule, ``memory.schedule_peak_bytes``);
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
  (``communication.overlapped_s``) plus the GEMM split into t chunks (``overlap_overheads.gemm_pieces``).

For each optimizer, the fastest variant that fits in ``HardwareProfile.usable_memory_bytes``
wins (memory is computed in order of step time, until one fits, and in ``search`` skipped where the
rank's parameters and optimizer state alone exceed it, ``memory.persistent_bytes``, or those plus the
activations its schedule holds at the least, ``memory.schedule_peak_floor``), else the leanest; of the
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
from autotp.cost_model.memory import held_in_flight, moment_arrays, schedule_peak_bytes, schedule_peak_floor
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
    compiled: bool = False  # the rank graphs run with ``compile=True`` (``compute``: inductor's fused kernels)

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
def _chunk_keys(costs: ModelCosts, chunks: int) -> tuple[tuple[tuple, ...], dict[tuple, tuple[tuple[int, int], ...]]]:
    """Each chunk's key (the traced layers it holds and how often, whether it is the first and the last) and, per
    distinct key, the (traced layer, copies) of its first chunk in the order the chunk reaches them (cached)."""
    counts: list[Counter] = [Counter() for _ in range(chunks)]
    for layer, chunk in enumerate(costs.layer_chunks(chunks)):
        counts[chunk][costs.traced_index(layer)] += 1
    keys = tuple((tuple(sorted(n.items())), c == 0, c == chunks - 1) for c, n in enumerate(counts))
    layers: dict[tuple, tuple[tuple[int, int], ...]] = {}
    for key, n in zip(keys, counts):
        layers.setdefault(key, tuple(n.items()))
    return keys, layers


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
    the fullest rank's parameters and optimizer state (``memory.persistent_bytes``); ``bound()`` too, and at least
    ``floor``: each rank's with the activations its schedule holds at the least (``memory.schedule_peak_floor``)."""

    estimate: Estimate
    memory: Callable[[], float]
    floor: float
    bound: Callable[[], float]


@dataclass(frozen=True, eq=False)
class _Chunks:
    """What the variants of a candidate that share a rank graph (``_chunks``) share, whichever optimizer: per chunk its
    time, GPU time and communication per microbatch and its segments' memory, per pipeline rank the parameters it
    holds and the sums of its chunks' times; the pipeline and its bubble."""

    config: Config
    sequence_parallel: bool  # what the rank graph runs (False at tp = 1)
    chunk_s: list[float]
    chunk_gpu: list[float]
    chunk_comm: list[float]
    chunk_mem: list[tuple]
    held: list[tuple[int, int]]  # per rank (parameter elements, tensors)
    rank_s: list[float]
    rank_gpu: list[float]
    pipeline_s: float
    bubble_s: float
    tied_s: float

    @functools.cached_property
    def memory_ranks(self) -> dict[tuple, int]:
        """The first rank of each group of ranks holding the same parameters and chunks, by (parameters, chunk peaks).

        Ranks holding the same bytes differ only in the microbatches in flight, which no schedule gives a later rank
        more of than an earlier one: the first rank of each group has the group's peak."""
        pp, b = self.config.pp, self.config.microbatch_size
        peaks = [_chunk_peaks(parts, b) for parts in self.chunk_mem]
        first: dict[tuple, int] = {}
        for r in range(pp):
            first.setdefault((self.held[r][0], tuple(peaks[r::pp])), r)
        return first


def _chunks(costs: ModelCosts, cluster: Cluster, training: Training, config: Config, v: Variant) -> _Chunks:
    hw = cluster.hardware
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    rc = costs.rank(config.tp, v.replicate, training.gather_outputs, sequence_parallel=v.sequence_parallel,
                    tp_overlap=v.tp_overlap, fp8=training.fp8, compiled=training.compiled)  # fmt: skip
    b, m, pp, vpp = config.microbatch_size, config.microbatches, config.pp, config.vpp
    chunks = pp * vpp

    call_s = hw.compiled_call_host_s if training.compiled else hw.call_host_s

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
    layer_ids = {id(seg) for seg in rc.layers}
    keys, layers_of = _chunk_keys(costs, chunks)
    alike: dict[tuple, tuple] = {}  # chunks of the same layers, ends and neighbours cost the same
    for key in dict.fromkeys(keys):
        c = 0 if key[1] else chunks - 1 if key[2] else 1
        counts = layers_of[key]
        parts = [(rc.layers[j], layers[j], n) for j, n in counts] + [(seg, st, 1) for seg, st in ends.get(c, [])]
        parts.append((rc.preamble, preamble, 1))
        recv = hop * ((c > 0) + (c < chunks - 1))
        grads = sum(n * seg.param_numel for seg, _, n in parts) * grad_bytes_per_param(training.precision)
        accumulate = (m - 1) / m * 3 * grads / hw.memory_bytes_per_s
        ordered = [(rc.preamble, 1)] + [(seg, 1) for seg, _ in ends.get(c, []) if seg is rc.embedding]
        ordered += [(rc.layers[j], n) for j, n in sorted(counts)] + [(seg, 1) for seg, _ in ends.get(c, []) if seg is rc.head]
        alike[key] = (sum(n * st.total_s for _, st, n in parts) + recv + accumulate + call_s,
                      sum(n * st.gpu_s for _, st, n in parts) + recv + accumulate,
                      sum(n * st.comm_s for _, st, n in parts) + recv,
                      tuple((layer_memory.get(id(seg), seg.memory), n) for seg, n in ordered),
                      [(seg.params, n, id(seg) in layer_ids) for seg, _, n in parts])  # fmt: skip
    chunk_s, chunk_gpu, chunk_comm, chunk_mem, chunk_params = (list(column) for column in zip(*(alike[key] for key in keys)))
    pipeline, bubble = pipeline_time_s(chunk_s, chunk_gpu, pp, vpp, m, config.schedule or "1f1b")
    held_by: dict[tuple, tuple[int, int]] = {}  # ranks holding chunks of the same keys hold the same parameters
    held = []
    for r in range(pp):
        mine = keys[r::pp]
        if mine not in held_by:
            held_by[mine] = _rank_params(chunk_params[r::pp])
        held.append(held_by[mine])
    tied = set(rc.embedding.params) & set(rc.head.params)
    tied_s = 0.0
    if tied and pp > 1:
        nbytes = sum(rc.embedding.params[name] for name in tied) * grad_bytes_per_param(training.precision)
        tied_s = all_reduce_s(nbytes, 2, hw.p2p_link if in_node else hw.inter_node)
    return _Chunks(config, rc.plan.sequence_parallel, chunk_s, chunk_gpu, chunk_comm, chunk_mem, held,
                   [sum(chunk_s[r::pp]) for r in range(pp)], [sum(chunk_gpu[r::pp]) for r in range(pp)], pipeline, bubble,
                   tied_s)  # fmt: skip


def _draft(costs: ModelCosts, cluster: Cluster, training: Training, config: Config, v: Variant,
           shared: _Chunks | None = None) -> _Draft:  # fmt: skip
    """The draft of variant ``v``; ``shared``: its ``_chunks``, if already made for a variant of the same rank graph."""
    hw = cluster.hardware
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    ch = shared if shared is not None else _chunks(costs, cluster, training, config, v)
    m, pp, vpp = config.microbatches, config.pp, config.vpp
    dp_per_node = max(1, min(config.dp, per_node // config.tp))
    syncs: dict[tuple, float] = {}  # ranks holding the same parameters and GPU time sync alike
    optimizers: dict[int, float] = {}
    for r, (params, tensors) in enumerate(ch.held):
        if v.distributed:
            backward = BACKWARD_SHARE * ch.rank_gpu[r]
            forward = (1 - BACKWARD_SHARE) * ch.rank_gpu[r] if training.overlap_param_gather and not training.cuda_graph_bytes else 0.0
            key = (params, backward, forward)
            if key not in syncs:
                syncs[key] = sharded_sync_s(params, training.precision, config.dp, dp_per_node, backward, hw, forward)
        else:
            key = (params, tensors)
            if key not in syncs:
                syncs[key] = _grad_sync_s(params, tensors, config.dp, dp_per_node, training.precision, hw)
        if params not in optimizers:
            optimizers[params] = optimizer_step_s(params, training.precision, config.dp if v.distributed else 1, hw)
    busiest = max(range(pp), key=ch.rank_s.__getitem__)
    sync = max(syncs.values()) + ch.tied_s
    optimizer = max(optimizers.values())
    step = ch.pipeline_s + sync + optimizer
    tokens = training.global_batch * costs.seq

    def memory() -> float:
        return max(
            rank_peak_bytes(params, training.precision, v.distributed, config.dp,
                            _schedule_peak_bytes(peaks, (config.schedule, pp, vpp, m, r), not v.distributed),
                            moment_arrays(config.schedule, pp, vpp, m, r).in_flight, training.cuda_graph_bytes)
            for (params, peaks), r in ch.memory_ranks.items()
        )  # fmt: skip

    def bound() -> float:
        in_flight = {r: held_in_flight(config.schedule, pp, vpp, m, r) for r in ch.memory_ranks.values()}
        return max(
            rank_peak_bytes(params, training.precision, v.distributed, config.dp, schedule_peak_floor(peaks, in_flight[r]),
                            in_flight[r], training.cuda_graph_bytes)
            for (params, peaks), r in ch.memory_ranks.items()
        )  # fmt: skip

    draft = Estimate(
        config=config,
        replicate=v.replicate,
        step_s=step,
        bubble_s=ch.bubble_s,
        comm_s=m * sum(ch.chunk_comm[busiest::pp]) + sync,
        optimizer_s=optimizer,
        mem_bytes_per_gpu=math.nan,
        tokens_per_s=tokens / step,
        mfu=3 * costs.forward_flops(training.global_batch) / (step * cluster.gpus * hw.mfu_flops_per_s),
        distributed_optimizer=v.distributed,
        sequence_parallel=ch.sequence_parallel,
        tp_overlap=v.tp_overlap if ch.sequence_parallel else (),
        host_wait_s=m * sum(s - g for s, g in zip(ch.chunk_s[busiest::pp], ch.chunk_gpu[busiest::pp])),
        recompute=v.recompute,
    )
    floor = max(persistent_bytes(params, training.precision, v.distributed, config.dp) for params in optimizers)
    return _Draft(draft, memory, floor, bound)


@functools.lru_cache(maxsize=4096)
def _segment_time(seg: Segment, batch: int, hw: HardwareProfile, tp_ranks_per_node: int, recompute: bool = False) -> SegmentTime:
    """``segment_time``, once per segment and microbatch size: candidates of one tp share their segments."""
    return segment_time(seg, batch, hw, tp_ranks_per_node, recompute)


@functools.lru_cache(maxsize=4096)
def _grad_sync_s(params: int, tensors: int, dp: int, dp_per_node: int, precision: str, hw: HardwareProfile) -> float:
    """``grad_sync_s``, once per rank's parameters: the sequence-parallel variants of a candidate hold the same."""
    return grad_sync_s(params, tensors, dp, dp_per_node, precision, hw)


@functools.lru_cache(maxsize=4096)
def _chunk_peaks(parts: tuple[tuple[SegmentMemory, int], ...], batch: int) -> ChunkPeaks:
    """``chunk_peaks``, once per chunk layout and microbatch size."""
    return chunk_peaks(list(parts), batch)


@functools.lru_cache(maxsize=65536)
def _schedule_peak_bytes(peaks: tuple[ChunkPeaks, ...], schedule: tuple[str | None, int, int, int, int], plain: bool) -> float:
    """``schedule_peak_bytes`` of rank ``schedule[-1]`` of ``moment_arrays(*schedule)``, once per distinct input
    (variants whose chunks hold the same bytes, ranks holding the same chunks at the same moments)."""
    return schedule_peak_bytes(peaks, moment_arrays(*schedule), plain)


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
    bound_activations: bool = False,
) -> Estimate:  # fmt: skip
    """The fastest fitting variant of ``config`` (module docstring); ``splits``: sequence parallelism can split its
    sequence. Without ``exact``, a candidate that fits in no variant may carry a lower bound of its memory: its
    parameters and optimizer state, and with ``bound_activations`` also the activations its schedule holds at the
    least (``_Draft.bound``)."""
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
        graphs = [Variant(r, False, sp, o, recompute) for r in layouts for sp, o in sequence]
        shared = [_chunks(costs, cluster, training, config, v) for v in graphs]
        found = {
            d: _fastest_fitting(
                [_draft(costs, cluster, training, config, replace(v, distributed=d), ch) for v, ch in zip(graphs, shared)],
                capacity, exact, bound_activations,
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


def _fastest_fitting(drafts: list[_Draft], capacity: float, exact: bool, bound_activations: bool = False) -> Estimate:
    """The fastest draft whose memory fits (ties: the leaner), else the leanest; memory is computed in order of step
    time, and not where its floor (with ``bound_activations``, its bound) already exceeds ``capacity`` unless
    ``exact``."""
    measured: list[Estimate] = []
    fits: Estimate | None = None
    for draft in sorted(drafts, key=lambda d: d.estimate.step_s):
        if fits is not None and draft.estimate.step_s > fits.step_s:
            break
        if not exact and draft.floor > capacity:
            memory = draft.floor
        elif not exact and bound_activations and (bound := draft.bound()) > capacity:
            memory = bound
        else:
            memory = draft.memory()
        est = replace(draft.estimate, mem_bytes_per_gpu=memory)
        measured.append(est)
        if est.mem_bytes_per_gpu <= capacity and (fits is None or est.mem_bytes_per_gpu < fits.mem_bytes_per_gpu):
            fits = est
    return fits if fits is not None else min(measured, key=lambda e: (e.mem_bytes_per_gpu, e.step_s))
