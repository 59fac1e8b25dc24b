"""The planner: tp, pp, dp, vpp and microbatch size for a model on a cluster, best first.

**Input.** ``ModelCosts`` of a graph traced once (``autotp.compiler.trace_for_planning``: one decoder
layer on the meta device at the planned sequence length; later layers repeat it), a
``Cluster`` (GPUs, GPUs per node, ``HardwareProfile``) and a ``Training`` setup (global
batch B, precision, distributed optimizer, whether outputs are gathered).

**Candidates** (``autotp.cost_model.candidates``):

* tp divides the GPUs per node, so a tp group never spans nodes (its 4 all-reduces per
  layer need NVLink), and the model (``plan_tensor_parallel`` raises otherwise);
* pp divides gpus/tp and is at most the number of layers; dp = gpus/(tp·pp) divides B;
* microbatch size b divides B/dp; m = B/(dp·b) microbatches, m >= pp when pp > 1 (1F1B);
* vpp = 1, or v >= 2 when pp >= 2, the layers divide into pp·v equal chunks and pp
  divides m (interleaved 1F1B).

Degrees passed as ``tp=``, ``pp=``, ``vpp=``, ``microbatch_size=`` are kept.

**Estimate** of one candidate (``estimate``), ranks in Megatron's order (tp fastest,
then dp, then pp):

* stage cuts as ``plan_pipeline`` makes them (``balanced_cuts`` of the layer weights);
* chunk time, per microbatch = its segments' ``compute.segment_time`` (forward +
  backward, tp collectives, host issue), the preamble's included (every chunk repeats
  it) + the receives of the hidden state b·s·h
  (forward from the previous chunk, gradient from the next) over NVLink when a model
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
* optimizer step: 2 · bytes_per_param · params / memory bandwidth (each state read and
  written once), of the rank's 1/dp slice with the distributed optimizer
  (``dp_sync.sharded_optimizer_s``); ``train_step`` does not run it, the step time includes it;
* step = pipeline + gradient sync + optimizer; tokens/s = B·s/step;
  MFU = 3 · forward FLOPs of B samples / (step · gpus · peak FLOP/s);
* memory per GPU: the fullest rank's ``memory.rank_peak_bytes`` (live bytes replayed from the graph);
* small linears: a linear whose sharding saves less compute per microbatch,
  (1 - 1/t) · 3 · its forward FLOPs / GEMM rate, than one tp all-reduce's latency costs
  is replicated (``plan_tensor_parallel(replicate=...)``) when that estimate is faster.

**The training step** (``autotp.ir.training_step``): ``Training.precision`` and
``Training.distributed_optimizer``: True or False fix it; None lets the planner
estimate each candidate with dp > 1 both ways (not for ``bf16-pure``, which the
distributed optimizer does not run: it keeps fp32 master weights) and keep the faster
that fits. A plan records its step (``ParallelPlan.precision``,
``ParallelPlan.distributed_optimizer``) and whether it needs the distributed optimizer
to fit (``PlanEstimate.needs_distributed_optimizer``).

Candidates that need more memory than ``HardwareProfile.usable_memory_bytes`` are
dropped; the rest are ranked by step time.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, replace

import torch
from autotp.cost_model.bubble import pipeline_time_s
from autotp.cost_model.candidates import Cluster, Config, candidates
from autotp.cost_model.communication import all_reduce_s, p2p_s
from autotp.cost_model.dp_sync import grad_sync_s, sharded_optimizer_s, sharded_sync_s
from autotp.cost_model.compute import (
    ModelCosts,
    RankCosts,
    SegmentTime,
    segment_time,
)
from autotp.cost_model.hardware import (
    CPU,
    GiB,
    HardwareProfile,
    calibrated_profile_path,
    get_profile,
    load_profile,
    profile_for_gpu,
)
from autotp.cost_model.memory import PRECISIONS, bytes_per_param, chunk_peaks, grad_bytes_per_param
from autotp.cost_model.memory import rank_peak_bytes, schedule_moments

from autotp.ir.plan import DP_BUCKET_BYTES, ParallelPlan
from autotp.analysis.layers import layer_index, with_layer_index
from autotp.ir.errors import UserInputError

BACKWARD_SHARE = 2 / 3  # of a microbatch's forward + backward GPU time


@dataclass(frozen=True)
class Training:
    """What is trained: ``global_batch`` samples per step of the traced sequence length,
    and the training step (``distributed_optimizer`` None: the planner picks, per candidate)."""

    global_batch: int
    precision: str = "bf16"
    distributed_optimizer: bool | None = False
    gather_outputs: bool = False
    cuda_graph_bytes: float = 0.0  # static buffers of one capture (one microbatch in flight)
    overlap_param_gather: bool = True  # the distributed optimizer's all-gather hides behind the next forward
    sequence_parallel: bool = False  # with tp > 1 (``ParallelPlan.sequence_parallel``)


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


@dataclass(frozen=True)
class PlanEstimate:
    """A plan and its predicted metrics; ``step_s`` includes ``optimizer_s``, which ``train_step`` does not run."""

    plan: ParallelPlan
    step_s: float
    tokens_per_s: float
    mfu: float
    mem_bytes_per_gpu: float
    bubble_share: float
    comm_share: float
    microbatch_size: int
    microbatches: int
    schedule: str | None
    optimizer_s: float
    needs_distributed_optimizer: bool = False

    def to_json(self) -> dict:
        return {
            "tp": self.plan.tp,
            "pp": self.plan.pp,
            "dp": self.plan.dp,
            "vpp": self.plan.vpp,
            "microbatch_size": self.microbatch_size,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "mem_bytes_per_gpu": self.mem_bytes_per_gpu,
            "bubble_share": self.bubble_share,
            "comm_share": self.comm_share,
            "optimizer_s": self.optimizer_s,
            "precision": self.plan.precision,
            "distributed_optimizer": self.plan.distributed_optimizer,
            "needs_distributed_optimizer": self.needs_distributed_optimizer,
            "plan": json.loads(self.plan.to_json()),
        }


# ---- estimate --------------------------------------------------------------------------


def small_linears(costs: ModelCosts, tp: int, batch: int, hw: HardwareProfile) -> frozenset[str]:
    """Linears whose sharding saves less compute per microbatch than one tp all-reduce's latency."""
    if tp == 1:
        return frozenset()
    return frozenset(
        name
        for name, flops in costs.linears
        if (1 - 1 / tp) * 3 * flops * batch / hw.matmul_flops_per_s < hw.collective_latency_s
    )


def _chunk_layers(costs: ModelCosts, chunks: int) -> tuple[Counter, ...]:
    """For each chunk, how many model layers of each traced layer it holds."""
    out: list[Counter] = [Counter() for _ in range(chunks)]
    for layer, chunk in enumerate(costs.layer_chunks(chunks)):
        out[chunk][costs.traced_index(layer)] += 1
    return tuple(out)


def estimate(
    costs: ModelCosts, cluster: Cluster, training: Training, config: Config, replicate: frozenset[str] = frozenset(),
    distributed: bool = False,
) -> Estimate:
    """Predicted step time and memory of ``config`` (formulas in the module docstring)."""
    hw = cluster.hardware
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    rc = costs.rank(config.tp, replicate, training.gather_outputs, sequence_parallel=training.sequence_parallel)
    b, m, pp, vpp = config.microbatch_size, config.microbatches, config.pp, config.vpp
    chunks = pp * vpp

    def timed(seg) -> SegmentTime:
        return segment_time(seg, b, hw, min(config.tp, per_node))

    layers = [timed(seg) for seg in rc.layers]
    preamble = timed(rc.preamble)
    ends: dict[int, list] = {0: [(rc.embedding, timed(rc.embedding))]}
    ends.setdefault(chunks - 1, []).append((rc.head, timed(rc.head)))
    in_node = config.tp * config.dp * pp <= per_node
    hop = p2p_s(costs.hidden_bytes * b, hw.p2p_link if in_node else hw.inter_node)
    chunk_s, chunk_gpu, chunk_comm, chunk_mem, chunk_params = [], [], [], [], []
    layer_ids = {id(seg) for seg in rc.layers}
    for c, counts in enumerate(_chunk_layers(costs, chunks)):
        parts = [(rc.layers[j], layers[j], n) for j, n in counts.items()] + [(seg, st, 1) for seg, st in ends.get(c, [])]
        parts.append((rc.preamble, preamble, 1))
        recv = hop * ((c > 0) + (c < chunks - 1))
        grads = sum(n * seg.param_numel for seg, _, n in parts) * grad_bytes_per_param(training.precision)
        accumulate = (m - 1) / m * 3 * grads / hw.memory_bytes_per_s
        chunk_s.append(sum(n * st.total_s for _, st, n in parts) + recv + accumulate + hw.call_host_s)
        chunk_gpu.append(sum(n * st.gpu_s for _, st, n in parts) + recv + accumulate)
        chunk_comm.append(sum(n * st.comm_s for _, st, n in parts) + recv)
        ordered = [(rc.preamble, 1)] + [(seg, 1) for seg, _ in ends.get(c, []) if seg is rc.embedding]
        ordered += [(rc.layers[j], n) for j, n in sorted(counts.items())] + [(seg, 1) for seg, _ in ends.get(c, []) if seg is rc.head]
        chunk_mem.append(chunk_peaks([(seg.memory, n) for seg, n in ordered], b))
        chunk_params.append([(seg.params, n, id(seg) in layer_ids) for seg, _, n in parts])
    pipeline, bubble = pipeline_time_s(chunk_s, chunk_gpu, pp, vpp, m, config.schedule or "1f1b")

    dp_per_node = max(1, min(config.dp, per_node // config.tp))
    memories, syncs, optimizers = [], [], []
    for r in range(pp):
        params, tensors = _rank_params(chunk_params[r::pp])
        moments = schedule_moments(config.schedule, pp, vpp, m, r)
        memories.append(rank_peak_bytes(params, training.precision, distributed, config.dp, chunk_mem[r::pp], moments,
                                        training.cuda_graph_bytes))
        if distributed:
            backward = BACKWARD_SHARE * sum(chunk_gpu[r::pp])
            forward = (1 - BACKWARD_SHARE) * sum(chunk_gpu[r::pp]) if training.overlap_param_gather and not training.cuda_graph_bytes else 0.0
            syncs.append(sharded_sync_s(params, training.precision, config.dp, dp_per_node, backward, hw, forward))
            optimizers.append(sharded_optimizer_s(params, training.precision, config.dp, hw))
        else:
            syncs.append(grad_sync_s(params, tensors, config.dp, dp_per_node, training.precision, hw))
            optimizers.append(2 * bytes_per_param(training.precision) * params / hw.memory_bytes_per_s)
    tied = set(rc.embedding.params) & set(rc.head.params)
    tied_s = 0.0
    if tied and pp > 1:
        nbytes = sum(rc.embedding.params[name] for name in tied) * grad_bytes_per_param(training.precision)
        tied_s = all_reduce_s(nbytes, 2, hw.p2p_link if in_node else hw.inter_node)
    busiest = max(range(pp), key=lambda r: sum(chunk_s[r::pp]))
    sync = max(syncs) + tied_s
    step = pipeline + sync + max(optimizers)
    tokens = training.global_batch * costs.seq
    return Estimate(
        config=config,
        replicate=replicate,
        step_s=step,
        bubble_s=bubble,
        comm_s=m * sum(chunk_comm[busiest::pp]) + sync,
        optimizer_s=max(optimizers),
        mem_bytes_per_gpu=max(memories),
        tokens_per_s=tokens / step,
        mfu=3 * costs.forward_flops(training.global_batch) / (step * cluster.gpus * hw.mfu_flops_per_s),
        distributed_optimizer=distributed,
    )


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


def _best_layout(costs: ModelCosts, cluster: Cluster, training: Training, config: Config, distributed: bool) -> Estimate:
    """``estimate`` with every linear sharded, or with the small ones replicated if that is faster."""
    plain = estimate(costs, cluster, training, config, distributed=distributed)
    small = small_linears(costs, config.tp, config.microbatch_size, cluster.hardware)
    if not small:
        return plain
    trimmed = estimate(costs, cluster, training, config, small, distributed=distributed)
    return trimmed if trimmed.step_s < plain.step_s else plain


def best_estimate(costs: ModelCosts, cluster: Cluster, training: Training, config: Config) -> Estimate:
    """The best layout with the training step's optimizer, or with the faster fitting one
    when ``training.distributed_optimizer`` is None (module docstring)."""
    forced = training.distributed_optimizer
    if config.dp == 1:
        options = [bool(forced)]
    elif forced is None and training.precision == "bf16-pure":
        options = [False]
    else:
        options = [False, True]
    found = {d: _best_layout(costs, cluster, training, config, d) for d in options}
    capacity = cluster.hardware.usable_memory_bytes
    allowed = [e for d, e in found.items() if forced is None or d == forced]
    fitting = [e for e in allowed if e.mem_bytes_per_gpu <= capacity] or allowed
    best = min(fitting, key=lambda e: (e.step_s, e.mem_bytes_per_gpu))
    needs = best.distributed_optimizer and False in found and found[False].mem_bytes_per_gpu > capacity
    return replace(best, needs_distributed_optimizer=needs)


# ---- plans -----------------------------------------------------------------------------


def _expand_layers(costs: ModelCosts, names: tuple) -> tuple:
    """Parameter layouts of the traced layers, repeated under every model layer's names."""
    if costs.num_layers == costs.traced_layers:
        return names
    out = []
    for layout in names:
        j = layer_index(layout.name)
        if j is None:
            out.append(layout)
            continue
        for i in range(costs.num_layers):
            if costs.traced_index(i) == j:
                out.append(replace(layout, name=with_layer_index(layout.name, i)))
    return tuple(out)


def to_plan(costs: ModelCosts, training: Training, est: Estimate, hw: HardwareProfile) -> PlanEstimate:
    """The ``ParallelPlan`` of an estimate, with its metrics."""
    cfg = est.config
    rc: RankCosts = costs.rank(cfg.tp, est.replicate, training.gather_outputs, sequence_parallel=training.sequence_parallel)
    chunks = cfg.pp * cfg.vpp
    schedule = f", schedule {cfg.schedule}" if cfg.schedule else ""
    note = (
        f"planned for {hw.name}: microbatch size {cfg.microbatch_size}, {cfg.microbatches} microbatches{schedule}; "
        f"predicted {est.step_s:.4g} s per step, {est.mem_bytes_per_gpu / GiB:.1f} GiB per GPU"
    )
    replicated = tuple(f"replicated (comm outweighs compute): {n}" for n in sorted(est.replicate))
    plan = replace(
        rc.plan,
        pp=cfg.pp,
        dp=cfg.dp,
        vpp=cfg.vpp,
        params=_expand_layers(costs, rc.plan.params),
        layer_chunks=costs.layer_chunks(chunks) if chunks > 1 else (),
        embedding_chunk=0,
        head_chunk=chunks - 1,
        notes=rc.plan.notes + replicated + (note,),
        microbatches=cfg.microbatches,
        microbatch_size=cfg.microbatch_size,
        schedule=cfg.schedule or "",
        dp_bucket_bytes=DP_BUCKET_BYTES,
        precision=training.precision,
        distributed_optimizer=est.distributed_optimizer,
    )
    return PlanEstimate(
        plan=plan,
        step_s=est.step_s,
        tokens_per_s=est.tokens_per_s,
        mfu=est.mfu,
        mem_bytes_per_gpu=est.mem_bytes_per_gpu,
        bubble_share=est.bubble_s / est.step_s,
        comm_share=est.comm_s / est.step_s,
        microbatch_size=cfg.microbatch_size,
        microbatches=cfg.microbatches,
        schedule=cfg.schedule,
        optimizer_s=est.optimizer_s,
        needs_distributed_optimizer=est.needs_distributed_optimizer,
    )


@dataclass(frozen=True)
class PlanSearch:
    """What ``search`` looked at: the fastest plans that fit, and what it dropped and why."""

    plans: list[PlanEstimate]
    candidates: int
    over_memory: int  # candidates that do not fit in the usable memory
    refused_tp: dict[int, str]  # tp degrees that cannot split the model, with the reason
    refused_candidates: int  # candidates at those degrees

    def dropped_summary(self, capacity_bytes: float) -> str:
        """One line: how many candidates were dropped, and why."""
        dropped = self.over_memory + self.refused_candidates
        why = []
        if self.over_memory:
            why.append(f"{self.over_memory} need more than the {capacity_bytes / GiB:.1f} GiB usable per GPU")
        for t, reason in self.refused_tp.items():
            why.append(f"tp={t} cannot split the model ({reason})")
        return f"{self.candidates} candidates, {dropped} dropped" + (f": {'; '.join(why)}" if why else "")


def plan(
    costs: ModelCosts,
    cluster: Cluster,
    training: Training,
    *,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    microbatch_size: int | None = None,
    top: int = 10,
) -> list[PlanEstimate]:
    """The ``top`` fastest plans that fit in memory, best first (``search``'s plans)."""
    return search(costs, cluster, training, tp=tp, pp=pp, vpp=vpp, microbatch_size=microbatch_size, top=top).plans


def search(
    costs: ModelCosts,
    cluster: Cluster,
    training: Training,
    *,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    microbatch_size: int | None = None,
    top: int = 10,
) -> PlanSearch:
    """The ``top`` fastest plans that fit in memory, best first (rules in the module
    docstring), with the count of candidates dropped and why.

    Raises ValueError when no plan fits (saying by how much the smallest misses) or the
    degrees cannot be laid out.
    """
    if training.precision not in PRECISIONS:
        raise UserInputError(f"unknown precision {training.precision!r}: choose one of {', '.join(PRECISIONS)}")
    configs = candidates(costs.num_layers, cluster, training.global_batch, tp=tp, pp=pp, vpp=vpp, microbatch_size=microbatch_size)
    usable: set[int] = set()
    refused: dict[int, str] = {}
    for t in sorted({c.tp for c in configs}):
        try:
            costs.rank(t, frozenset(), training.gather_outputs)
            usable.add(t)
        except ValueError as e:
            if tp is not None:
                raise
            refused[t] = str(e)
    estimates = [best_estimate(costs, cluster, training, c) for c in configs if c.tp in usable]
    if not estimates:
        raise UserInputError("no tp degree splits this model: " + "; ".join(f"tp={t}: {why}" for t, why in refused.items()))
    capacity = cluster.hardware.usable_memory_bytes
    fitting = sorted((e for e in estimates if e.mem_bytes_per_gpu <= capacity), key=lambda e: (e.step_s, e.mem_bytes_per_gpu))
    if not fitting:
        least = min(estimates, key=lambda e: e.mem_bytes_per_gpu)
        c = least.config
        raise UserInputError(
            f"the model does not fit on {cluster.gpus} x {cluster.hardware.name} at any degree: the leanest plan "
            f"(tp={c.tp}, pp={c.pp}, dp={c.dp}, microbatch size {c.microbatch_size}) needs "
            f"{least.mem_bytes_per_gpu / GiB:.1f} GiB per GPU, {(least.mem_bytes_per_gpu - capacity) / GiB:.1f} GiB more "
            f"than the {capacity / GiB:.1f} GiB usable; use more GPUs, the distributed optimizer, or a shorter sequence"
        )
    plans = [to_plan(costs, training, e, cluster.hardware) for e in fitting[:top]]
    return PlanSearch(plans, len(configs), len(estimates) - len(fitting), refused, len(configs) - len(estimates))


# ---- parallelize(plan="auto") ----------------------------------------------------------


def detect_hardware(device: torch.device) -> HardwareProfile:
    """``AUTOTP_HARDWARE`` (a profile name or JSON path) if set, else this machine's cached
    calibration of ``device``, else the built-in profile of its GPU."""
    chosen = os.environ.get("AUTOTP_HARDWARE")
    if chosen:
        return get_profile(chosen)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cached = calibrated_profile_path(name)
    if cached.is_file():
        return load_profile(cached)
    profile = CPU if device.type != "cuda" else profile_for_gpu(name)
    if profile is not None:
        return profile
    raise UserInputError(f"no hardware profile for {name!r}; run autotp calibrate (it caches one for this machine)")


def auto_plan(costs: ModelCosts, world: int, *, tp: int | None = None, pp: int | None = None, vpp: int | None = None) -> ParallelPlan:
    """The planner's best plan for ``costs.gm`` (traced at the example inputs) on ``world`` local ranks.

    The example batch is the global batch and its sequence length the planned one.
    ``LOCAL_WORLD_SIZE`` ranks share a node; precision follows the parameters (fp32, or
    16-bit weights with a 16-bit AdamW).
    """
    gm = costs.gm
    tensor = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
    hw = detect_hardware(tensor.device)
    per_node = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
    training = Training(costs.batch, "fp32" if dtype == torch.float32 else "bf16-pure", gather_outputs=True)
    return plan(costs, Cluster(world, per_node, hw), training, tp=tp, pp=pp, vpp=vpp, top=1)[0].plan


# ---- presenting plans --------------------------------------------------------------------
