"""The plan's expert-parallel entries: one ``MoeLayerPlan`` per MoE layer whose experts are
spread over the ep ranks, and the arithmetic that the passes, the runtime and the cost
model share (which experts a rank holds, the sync-free capacity).

Expert parameters follow MoE folding (seed 001): the dense layers run on ``tp-cp-dp-pp``
and the expert layers on ``etp-ep-edp-pp`` over the same ranks (``autotp.ir.rank_groups``).
With ``etp = 1`` each expert is whole on one ep rank: ep rank r holds experts
``[r*E/ep, (r+1)*E/ep)`` -- rows ``[r*E/ep, (r+1)*E/ep)`` of a fused ``[E, ...]`` weight, or
the parameters of those expert modules in a loop -- and the ``edp = world/(ep*pp)`` ranks
holding the same experts average their gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeLayerPlan:
    """One MoE layer under expert parallelism.

    ``params`` are its expert parameters; ``experts_of`` the expert each one belongs to for a
    loop over expert modules (empty for fused ``[E, ...]`` weights, split on dim 0).
    ``rows`` and ``capacity`` are what the planned inputs give (rows a rank dispatches,
    rows per expert and source rank in sync-free mode; the pass recomputes both for each
    input signature); ``router`` describes the router for reports."""

    name: str
    form: str
    num_experts: int
    top_k: int
    router: str
    params: tuple[str, ...]
    experts_of: tuple[int, ...] = ()
    rows: int = 0
    capacity: int = 0

    def local_experts(self, ep: int, ep_rank: int) -> range:
        local = self.num_experts // ep
        return range(ep_rank * local, (ep_rank + 1) * local)

    def expert_of(self, param: str) -> int | None:
        """The expert a loop-form parameter belongs to; None for a fused weight (all experts)."""
        if not self.experts_of:
            return None
        return self.experts_of[self.params.index(param)]

    def to_json(self) -> dict:
        return {"name": self.name, "form": self.form, "num_experts": self.num_experts, "top_k": self.top_k,
                "router": self.router, "params": list(self.params), "experts_of": list(self.experts_of),
                "rows": self.rows, "capacity": self.capacity}  # fmt: skip

    @staticmethod
    def from_json(d: dict) -> MoeLayerPlan:
        return MoeLayerPlan(d["name"], d["form"], d["num_experts"], d["top_k"], d["router"], tuple(d["params"]),
                            tuple(d.get("experts_of", ())), d.get("rows", 0), d.get("capacity", 0))  # fmt: skip


@dataclass(frozen=True)
class ExpertParallelEstimate:
    """The cost model's price of one ep for a plan (``autotp.cost_model.moe_costs``): its extra
    step time over tensor-parallel experts and the memory it saves. The planner records the
    chosen one in ``ParallelPlan.moe_estimate``; ``autotp plan`` prints it."""

    ep: int
    dispatch: str
    capacity_factor: float
    dispatch_s: float  # all-to-alls, count exchanges and host syncs, per step
    imbalance: float
    delta_s: float  # step time minus the tensor-parallel experts' step time
    saved_bytes: float  # per GPU, against tensor-parallel experts

    def describe(self) -> str:
        mode = self.dispatch + (f" cf {self.capacity_factor:g}" if self.capacity_factor else "")
        return (f"ep={self.ep} ({mode}): dispatch {self.dispatch_s * 1e3:.2f} ms/step, imbalance x{self.imbalance:.2f}, "
                f"{self.delta_s * 1e3:+.2f} ms/step, saves {self.saved_bytes / 2**30:.2f} GiB/GPU")  # fmt: skip

    def to_json(self) -> dict:
        return {"ep": self.ep, "dispatch": self.dispatch, "capacity_factor": self.capacity_factor, "dispatch_s": self.dispatch_s,
                "imbalance": self.imbalance, "delta_s": self.delta_s, "saved_bytes": self.saved_bytes}  # fmt: skip

    @staticmethod
    def from_json(d: dict) -> ExpertParallelEstimate:
        return ExpertParallelEstimate(d["ep"], d["dispatch"], d["capacity_factor"], d["dispatch_s"], d["imbalance"],
                                      d["delta_s"], d["saved_bytes"])  # fmt: skip


def capacity_for(rows: int, tp: int, num_experts: int, factor: float) -> int:
    """Sync-free capacity: ``ceil(factor * rows_per_rank / E)`` rows per expert and source rank,
    where a rank dispatches its tp slice ``rows / tp`` of the layer's rows (tokens x top-k).
    Factor 1 fits perfectly balanced routing; ``E / top_k`` (or more) never drops a row."""
    return max(1, math.ceil(factor * math.ceil(rows / tp) / num_experts))


def expert_param_owner(layer: MoeLayerPlan, param: str, ep: int) -> int | None:
    """The ep rank holding a loop-form expert parameter (None: a fused weight, split over all)."""
    expert = layer.expert_of(param)
    return None if expert is None else expert // (layer.num_experts // ep)
