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

**Estimate** of one candidate and its variants (``autotp.cost_model.step_estimate``): step
time (pipeline, gradient sync, optimizer step), MFU and peak memory per GPU, for each of
its variants: plain or distributed optimizer (``Training.distributed_optimizer``; None
weighs both where dp > 1), small linears sharded or replicated, and where tp > 1 sequence
parallelism on or off and, with it, tp communication overlapped with the GEMMs or not
(``Training.sequence_parallel``, ``Training.tp_overlap``; None weighs both, True/False fix
it). Each is charged on the rank graph compiled for it: only the exposed part of an
overlapped collective, and activations of s/tp tokens between the tp regions with
sequence parallelism. A candidate keeps its fastest variant that fits.

**The plan** (``to_plan``) records every choice: ``ParallelPlan.precision``,
``distributed_optimizer``, ``sequence_parallel``, ``tp_overlap``, the replicated linears
(notes), microbatches and schedule; ``PlanEstimate.needs_distributed_optimizer`` says
whether only the distributed optimizer fits.

Candidates that need more memory than ``HardwareProfile.usable_memory_bytes`` are
dropped; the rest are ranked by step time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from autotp.cost_model.candidates import Cluster, Config, candidates
from autotp.cost_model.compute import ModelCosts, RankCosts
from autotp.cost_model.hardware import (
    CPU,
    GiB,
    HardwareProfile,
    calibrated_profile_path,
    get_profile,
    load_profile,
    profile_for_gpu,
    profile_key,
)
from autotp.cost_model.memory import PRECISIONS
from autotp.cost_model.moe_costs import moe_facts, with_expert_parallel
from autotp.cost_model.step_estimate import Estimate, Training, best_estimate, estimate

from autotp.ir.moe_plan import ExpertParallelEstimate
from autotp.ir.plan import DP_BUCKET_BYTES, KEPT_WHOLE_COMM, RECOMPUTE_MEMORY, KeptWhole, ParallelPlan
from autotp.analysis.layers import layer_index, with_layer_index
from autotp.ir.errors import UserInputError

__all__ = [
    "Cluster", "Config", "Estimate", "PlanEstimate", "PlanSearch", "Training", "auto_plan", "best_estimate",
    "auto_sequence_parallel", "candidates", "detect_hardware", "estimate", "plan", "search", "to_plan",
]  # fmt: skip


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
    host_share: float = 0.0  # of the step, the GPU waiting for the host (``Estimate.host_wait_s``)

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
            "host_share": self.host_share,
            "precision": self.plan.precision,
            "distributed_optimizer": self.plan.distributed_optimizer,
            "needs_distributed_optimizer": self.needs_distributed_optimizer,
            "sequence_parallel": self.plan.sequence_parallel,
            "tp_overlap": list(self.plan.tp_overlap),
            "plan": json.loads(self.plan.to_json()),
        }


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


def to_plan(costs: ModelCosts, training: Training, est: Estimate, hw: HardwareProfile,
            expert: ExpertParallelEstimate | None = None) -> PlanEstimate:  # fmt: skip
    """The ``ParallelPlan`` of an estimate, with its metrics (and its expert parallelism)."""
    cfg = est.config
    rc: RankCosts = costs.rank(cfg.tp, est.replicate, training.gather_outputs, sequence_parallel=est.sequence_parallel,
                               tp_overlap=est.tp_overlap, fp8=training.fp8, compiled=training.compiled)  # fmt: skip
    chunks = cfg.pp * cfg.vpp
    schedule = f", schedule {cfg.schedule}" if cfg.schedule else ""
    sequence = ""
    if cfg.tp > 1:
        overlap = f", {' and '.join(est.tp_overlap)} overlapped with the GEMMs" if est.tp_overlap else ""
        sequence = f", sequence parallelism {'on' if est.sequence_parallel else 'off'}{overlap}"
    recompute = ", every layer recomputed in the backward" if est.recompute else ""
    note = (
        f"planned for {hw.name}: microbatch size {cfg.microbatch_size}, {cfg.microbatches} microbatches{schedule}{sequence}{recompute}; "
        f"predicted {est.step_s:.4g} s per step, {est.mem_bytes_per_gpu / GiB:.1f} GiB per GPU"
    )
    kept = tuple(KeptWhole(n, KEPT_WHOLE_COMM) for n in sorted(est.replicate))
    plan = replace(
        rc.plan,
        pp=cfg.pp,
        dp=cfg.dp,
        vpp=cfg.vpp,
        params=_expand_layers(costs, rc.plan.params),
        layer_chunks=costs.layer_chunks(chunks) if chunks > 1 else (),
        embedding_chunk=0,
        head_chunk=chunks - 1,
        notes=rc.plan.notes + (note,),
        kept_whole=rc.plan.kept_whole + kept,
        microbatches=cfg.microbatches,
        microbatch_size=cfg.microbatch_size,
        schedule=cfg.schedule or "",
        dp_bucket_bytes=DP_BUCKET_BYTES,
        precision=training.precision,
        distributed_optimizer=est.distributed_optimizer,
        hardware=profile_key(hw) or rc.plan.hardware,
        recompute_layers=tuple(range(costs.num_layers)) if est.recompute else (),
        recompute_reason=RECOMPUTE_MEMORY if est.recompute else "",
    )
    if expert is not None:
        plan = replace(plan, ep=expert.ep, etp=1, moe_dispatch=expert.dispatch, moe_capacity_factor=expert.capacity_factor,
                       moe_estimate=expert)  # fmt: skip
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
        host_share=est.host_wait_s / est.step_s,
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
    progress: Callable[[str], None] | None = None,
    expert_parallel: bool = True,
) -> PlanSearch:
    """The ``top`` fastest plans that fit in memory, best first (rules in the module
    docstring), with the count of candidates dropped and why; ``progress`` is told each step.

    With ``expert_parallel``, the MoE layers of each candidate spread their experts over ep
    ranks where that is faster or needed to fit (``cost_model.moe_costs``).

    Raises ValueError when no plan fits (saying by how much the smallest misses) or the
    degrees cannot be laid out.
    """
    if training.precision not in PRECISIONS:
        raise UserInputError(f"unknown precision {training.precision!r}: choose one of {', '.join(PRECISIONS)}")
    configs = candidates(costs.num_layers, cluster, training.global_batch, tp=tp, pp=pp, vpp=vpp, microbatch_size=microbatch_size)
    usable: set[int] = set()
    splits: set[int] = set()  # tp degrees whose sequence parallelism splits the sequence
    refused: dict[int, str] = {}
    needs_split = bool(training.sequence_parallel or training.tp_overlap)
    tell = progress or (lambda message: None)
    for t in sorted({c.tp for c in configs}):
        tell(f"compiling the traced layers as a tp={t} rank")
        try:
            costs.rank(t, frozenset(), training.gather_outputs, compiled=training.compiled)
            usable.add(t)
            if t > 1 and training.sequence_parallel is not False:
                costs.rank(t, frozenset(), training.gather_outputs, sequence_parallel=True, compiled=training.compiled)
                splits.add(t)
        except ValueError as e:
            if t in usable and not needs_split:
                continue  # sequence parallelism cannot split it: the candidates at t run without
            usable.discard(t)
            if tp is not None:
                raise
            refused[t] = str(e)
    tell(f"estimating {sum(c.tp in usable for c in configs)} candidate plans")
    facts = moe_facts(costs) if expert_parallel else None
    # A candidate that fits in no variant is only counted, unless expert parallelism subtracts what it saves from its
    # memory or its leanest variant decides whether recomputation is tried: then it carries its exact memory or floor.
    bound = facts is None and training.recompute is not None
    estimates = [best_estimate(costs, cluster, training, c, splits=c.tp in splits, exact=False, bound_activations=bound)
                 for c in configs if c.tp in usable]  # fmt: skip
    experts: dict[int, ExpertParallelEstimate] = {}
    if facts is not None:
        priced = [with_expert_parallel(facts, e, cluster, training, costs.seq) for e in estimates]
        estimates = [e for e, _ in priced]
        experts = {id(e): o for e, o in priced if o is not None}
    if not estimates:
        raise UserInputError("no tp degree splits this model: " + "; ".join(f"tp={t}: {why}" for t, why in refused.items()))
    capacity = cluster.hardware.usable_memory_bytes
    fitting = sorted((e for e in estimates if e.mem_bytes_per_gpu <= capacity), key=lambda e: (e.step_s, e.mem_bytes_per_gpu))
    if not fitting:  # the leanest by its exact memory, not a floor
        exact = [best_estimate(costs, cluster, training, e.config, splits=e.config.tp in splits) for e in estimates]
        least = min(exact, key=lambda e: e.mem_bytes_per_gpu)
        c = least.config
        raise UserInputError(
            f"the model does not fit on {cluster.gpus} x {cluster.hardware.name} at any degree: the leanest plan "
            f"(tp={c.tp}, pp={c.pp}, dp={c.dp}, microbatch size {c.microbatch_size}) needs "
            f"{least.mem_bytes_per_gpu / GiB:.1f} GiB per GPU, {(least.mem_bytes_per_gpu - capacity) / GiB:.1f} GiB more "
            f"than the {capacity / GiB:.1f} GiB usable; use more GPUs, the distributed optimizer, or a shorter sequence"
        )
    plans = [to_plan(costs, training, e, cluster.hardware, experts.get(id(e))) for e in fitting[:top]]
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


def auto_plan(
    costs: ModelCosts, world: int, *, tp: int | None = None, pp: int | None = None, vpp: int | None = None,
    sequence_parallel: bool | None = None, tp_overlap: bool | None = None, fp8: str = "", compiled: bool = False,
) -> ParallelPlan:  # fmt: skip
    """The planner's best plan for ``costs.gm`` (traced at the example inputs) on ``world`` local ranks.

    The example batch is the global batch and its sequence length the planned one.
    ``LOCAL_WORLD_SIZE`` ranks share a node; precision follows the parameters (fp32, or
    16-bit weights with a 16-bit AdamW). ``sequence_parallel`` and ``tp_overlap``: True or
    False fix them, None lets the planner weigh both. ``fp8``: the candidates' decoder GEMMs
    run that FP8 recipe (priced as ``autotp.cost_model.fp8`` says). ``compiled``: the ranks run ``compile=True``.
    """
    hw, per_node, training = _local_setup(costs, world, costs.batch)
    training = replace(training, sequence_parallel=sequence_parallel, tp_overlap=tp_overlap, fp8=fp8, compiled=compiled)
    return plan(costs, Cluster(world, per_node, hw), training, tp=tp, pp=pp, vpp=vpp, top=1)[0].plan


def auto_sequence_parallel(costs: ModelCosts, chosen: ParallelPlan, *, sequence_parallel: bool | None = None,
                           tp_overlap: bool | None = None, fp8: str = "", compiled: bool = False) -> ParallelPlan:  # fmt: skip
    """``chosen`` with the sequence parallelism and overlap that the planner weighs best at its degrees
    (``best_estimate``); True or False fix either. A sequence that tp does not split runs without,
    unless either is True (then the sequence-parallel pass's ValueError says how to pad it)."""
    if chosen.tp == 1:
        return replace(chosen, sequence_parallel=False, tp_overlap=())
    world = chosen.tp * chosen.pp * chosen.dp
    m = max(chosen.microbatches, chosen.pp if chosen.pp > 1 else 1)
    config = Config(chosen.tp, chosen.pp, chosen.dp, chosen.vpp, max(1, costs.batch // (chosen.dp * m)), m)
    hw, per_node, training = _local_setup(costs, world, config.microbatch_size * m * chosen.dp)
    training = replace(training, sequence_parallel=sequence_parallel, tp_overlap=tp_overlap,
                       distributed_optimizer=chosen.distributed_optimizer, fp8=fp8, compiled=compiled)  # fmt: skip
    try:
        costs.rank(chosen.tp, frozenset(), training.gather_outputs, sequence_parallel=True, fp8=fp8, compiled=compiled)
        splits = True
    except ValueError:
        if sequence_parallel or tp_overlap:
            raise
        splits = False
    best = best_estimate(costs, Cluster(world, per_node, hw), training, config, splits=splits)
    return replace(chosen, sequence_parallel=best.sequence_parallel, tp_overlap=best.tp_overlap)


def _local_setup(costs: ModelCosts, world: int, global_batch: int) -> tuple[HardwareProfile, int, Training]:
    """This machine's profile, ranks per node and training step for a graph traced at the example inputs."""
    gm = costs.gm
    tensor = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
    per_node = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
    training = Training(global_batch, "fp32" if dtype == torch.float32 else "bf16-pure", gather_outputs=True)
    return detect_hardware(tensor.device), per_node, training
