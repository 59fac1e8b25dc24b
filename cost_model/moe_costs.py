"""Cost of expert parallelism for one plan: dispatch time, expert imbalance, capacity, memory.

For a rank of a plan (tp, pp, dp, microbatch size b, m microbatches, sequence s) and the MoE
layers of its pipeline stage (``L = layers / pp``; each with E experts, top-k, hidden H,
``f`` forward FLOPs per routed row, ``P`` expert parameters), with ``etp = 1`` and ep | tp·dp:

* **Rows.** A rank dispatches its tp slice of the tokens' rows: ``S = b·s·k / tp``.
* **All-to-all** (``all_to_all_group_s``): one movement of n = S·H·e bytes (e: activation
  bytes; sync-free moves ``cf·n``, padding included) over ep ranks laid out consecutively,
  g = min(ep, gpus per node) of them per node. The share (g-1)/ep of the bytes stays on the
  node, (ep-g)/ep crosses it, both at once:
  ``T_a2a = alpha + max((g-1)/ep · n / B_intra, (ep-g)/ep · n / B_inter)``.
  Four per layer and microbatch (to the experts and back, forward and backward), plus the
  exchange of E counts (``alpha``).
* **tp gather.** With tp > 1 the combine all-gathers the rows over tp (``(tp-1)/tp·n·tp``
  bytes, forward and backward) where tensor-parallel experts all-reduce the layer's output
  (``2(tp-1)/tp · b·s·H·e``); the difference is charged.
* **Imbalance** (``imbalance``): the slowest rank sets the pace. Dropless, uniform random
  routing of R = S·ep rows over ep ranks gives each rank Binomial(R, 1/ep) rows; the
  expected maximum of ep of them is about ``1 + sqrt(2 ln ep · (ep-1)/R)`` times the mean.
  Trained routers are no better than uniform, so this is a lower bound. Sync-free: the
  grouped matmuls multiply the rows that arrived (packed, at the received counts' offsets),
  at most ``cf`` times the mean: ``min(cf, I)``.
  The expert compute ``3·S·f`` (forward + backward) is charged ``(I - 1)`` extra.
* **Host syncs.** Dropless movements read the counts on the host: four per layer and
  microbatch, ``DROPLESS_SYNC_S`` each (the device queue drains).
* **Memory.** Tensor-parallel experts keep P/tp per rank, expert-parallel P/ep; both at the
  training step's bytes per parameter (the distributed optimizer shards expert state over
  edp = tp·dp/ep, dense state over dp).

``expert_parallel_options`` prices every ep that divides tp·dp and E against the
tensor-parallel experts of the same plan (``delta_s``, ``saved_bytes``);
``with_expert_parallel`` picks one for a planner estimate without sequence parallelism
(autotp does not combine the two yet): the fastest that fits when tensor-parallel experts
do not fit, else the fastest (tensor-parallel experts included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autotp.analysis.moe import GROUPED, find_moe_layers
from autotp.analysis.shapes import shape_of
from autotp.cost_model.candidates import Cluster
from autotp.cost_model.communication import all_gather_s, all_reduce_s
from autotp.cost_model.compute import ModelCosts
from autotp.cost_model.hardware import HardwareProfile
from autotp.cost_model.step_estimate import Estimate, Training
from autotp.ir.moe_plan import ExpertParallelEstimate
from autotp.ir.training_step import TrainingStep

DROPLESS_SYNC_S = 30e-6
"""One host read of the dispatch counts: the device queue drains and refills (an estimate of
launch latency plus a small kernel's time, not a measurement)."""


@dataclass(frozen=True)
class MoeFacts:
    """The model's MoE layers as the cost model sees them (all layers alike)."""

    layers: int
    num_experts: int
    top_k: int
    hidden: int
    flops_per_row: float
    expert_params: int  # per layer
    grouped: bool


def moe_facts(costs: ModelCosts) -> MoeFacts | None:
    """The MoE layers of the traced graph scaled to the whole model; None without any."""
    found = [l for l in find_moe_layers(costs.gm) if not l.blocker]
    if not found:
        return None
    first = found[0]
    params = dict(costs.gm.named_parameters())
    per_layer = sum(params[p].numel() for p in first.expert_params)
    if first.form == GROUPED:
        flops = sum(2 * shape[-2] * shape[-1] for mm in first.grouped_mms if (shape := shape_of(mm.args[1])))
        hidden = (shape_of(first.grouped_mms[0].args[0]) or (0, 0))[-1]
    else:
        expert = first.experts[0]
        flops = sum(2 * params[p].numel() for p in expert.params if params[p].dim() == 2)
        hidden = (shape_of(next(iter(expert.gathers.values()))) or (0, 0))[-1]
    scale = costs.num_layers / max(costs.traced_layers, 1)
    return MoeFacts(round(len(found) * scale), first.num_experts, first.top_k, hidden, flops, per_layer,
                    first.form == GROUPED)  # fmt: skip


def all_to_all_group_s(nbytes: float, ep: int, per_node: int, hw: HardwareProfile) -> float:
    """One all-to-all of ``nbytes`` per rank over ``ep`` consecutive ranks (module docstring)."""
    if ep == 1:
        return 0.0
    g = min(ep, per_node)
    inside = (g - 1) / ep * nbytes / hw.intra_node.bus_bytes_per_s
    across = (ep - g) / ep * nbytes / hw.inter_node.bus_bytes_per_s
    latency = hw.inter_node.latency_s if ep > g else hw.intra_node.latency_s
    return latency + max(inside, across)


def imbalance(rows_per_rank: float, ep: int) -> float:
    """Expected max/mean rows over ep ranks under uniform random routing (module docstring)."""
    if ep == 1 or rows_per_rank <= 0:
        return 1.0
    return 1.0 + math.sqrt(2 * math.log(ep) * (ep - 1) / (rows_per_rank * ep))


def option(facts: MoeFacts, *, tp: int, pp: int, dp: int, microbatch: int, microbatches: int, seq: int, ep: int,
           per_node: int, hw: HardwareProfile, step: TrainingStep, activation_bytes: int = 2, dispatch: str = "dropless",
           capacity_factor: float = 0.0) -> ExpertParallelEstimate:  # fmt: skip
    """The cost of expert parallelism over ``ep`` ranks for one plan (module docstring)."""
    layers = facts.layers / pp
    rows = microbatch * seq * facts.top_k / tp
    moved = rows * facts.hidden * activation_bytes * (capacity_factor if capacity_factor else 1.0)
    movements = 4 * all_to_all_group_s(moved, ep, per_node, hw) + hw.collective_latency_s
    syncs = 0.0 if capacity_factor else 4 * DROPLESS_SYNC_S
    tp_delta = 0.0
    if tp > 1:
        gathered = all_gather_s(moved * tp, tp, hw.intra_node)
        tp_delta = 2 * (gathered - all_reduce_s(microbatch * seq * facts.hidden * activation_bytes, tp, hw.intra_node))
    ratio = min(capacity_factor, imbalance(rows, ep)) if capacity_factor else imbalance(rows, ep)
    compute = 3 * rows * facts.flops_per_row / hw.matmul_flops_per_s
    per_microbatch = movements + syncs + tp_delta + (ratio - 1) * compute
    dispatch_s = layers * microbatches * (movements + syncs)
    edp = tp * dp // ep
    tp_experts = facts.expert_params * layers / tp * step.bytes_per_param(dp)
    ep_experts = facts.expert_params * layers / ep * step.bytes_per_param(edp)
    return ExpertParallelEstimate(ep, dispatch, capacity_factor, dispatch_s, ratio, layers * microbatches * per_microbatch,
                                tp_experts - ep_experts)  # fmt: skip


def expert_parallel_options(facts: MoeFacts, **plan: object) -> list[ExpertParallelEstimate]:
    """Every ep dividing tp·dp and the expert count, dropless (and sync-free at capacity
    factor 1.25 for fused experts), priced against tensor-parallel experts."""
    tp, dp = int(plan["tp"]), int(plan["dp"])  # type: ignore[call-overload]
    out = []
    for ep in range(2, tp * dp + 1):
        if (tp * dp) % ep or facts.num_experts % ep:
            continue
        out.append(option(facts, ep=ep, **plan))  # type: ignore[arg-type]
        if facts.grouped:
            out.append(option(facts, ep=ep, dispatch="sync_free", capacity_factor=1.25, **plan))  # type: ignore[arg-type]
    return out



def with_expert_parallel(facts: MoeFacts, est: Estimate, cluster: Cluster, training: Training, seq: int) -> tuple[Estimate, ExpertParallelEstimate | None]:
    """``est`` with the best expert parallelism for its plan: the fastest option that fits
    when tensor-parallel experts do not, else the fastest of all (tensor-parallel experts included)."""
    cfg = est.config
    if est.sequence_parallel:  # the dispatch takes whole tokens: expert parallelism runs without sequence parallelism
        return est, None
    step = TrainingStep(training.precision, est.distributed_optimizer)
    options = expert_parallel_options(facts, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, microbatch=cfg.microbatch_size,
                                      microbatches=cfg.microbatches, seq=seq, per_node=cluster.gpus_per_node,
                                      hw=cluster.hardware, step=step)  # fmt: skip
    capacity = cluster.hardware.usable_memory_bytes
    fits = [o for o in options if est.mem_bytes_per_gpu - o.saved_bytes <= capacity]
    best = min(fits, key=lambda o: o.delta_s, default=None)
    if best is None or (est.mem_bytes_per_gpu <= capacity and best.delta_s >= 0):
        return est, None
    step_s = est.step_s + best.delta_s
    return replace(est, step_s=step_s, mem_bytes_per_gpu=est.mem_bytes_per_gpu - best.saved_bytes,
                   tokens_per_s=est.tokens_per_s * est.step_s / step_s, mfu=est.mfu * est.step_s / step_s,
                   comm_s=est.comm_s + best.dispatch_s), best  # fmt: skip
