"""The runtime side of expert parallelism, in one place: the ep/edp groups of MoE folding,
which expert parameters this rank holds, and their gradients.

Groups come from ``autotp.ir.rank_groups`` (Megatron's ``etp-ep-edp-pp`` order over the
same ranks as ``tp-cp-dp-pp``). With ``etp = 1`` ep rank r of a group holds experts
``[r*E/ep, (r+1)*E/ep)``: rows of each fused ``[E, ...]`` weight (``ExpertShards.spec``), or
the parameters of those expert modules (the others are not held at all).

**Gradients.** The backward of the dispatch brings every token's gradient to the rank
holding its expert, so after the backward an expert weight's gradient already sums the
tokens of its whole ep group. The dense gradients are averaged over dp; for the expert
ones to match, they are summed over edp (the ranks holding the same experts) and divided
by dp (``grad_sync.ExpertGradMean``); the DistributedOptimizer reduce-scatters them over edp
and divides by dp (``grad_buffers``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autotp.ir.moe_ops import DISPATCH_OPS  # noqa: F401 (the schemas the kernels below implement)
from autotp.ir.moe_plan import MoeLayerPlan, expert_param_owner
from autotp.ir.plan import ParallelPlan
from autotp.ir.program import BucketLayout
from autotp.runtime.processes import moe_dispatch  # moe_dispatch also registers the dispatch kernels
from autotp.runtime.gradients.grad_buffers import GradBuffers, ParamUse
from autotp.runtime.gradients.grad_sync import GradSyncs
from autotp.runtime.processes.groups import ExpertGroups
from autotp.runtime.state.shard_map import Piece, ShardSpec


class ExpertShards:
    """Which expert parameters this rank holds, and how (``plan.moe_layers``)."""

    def __init__(self, plan: ParallelPlan, groups: ExpertGroups | None) -> None:
        self.groups = groups
        self.ep = plan.ep if groups is not None else 1
        self.ep_rank = groups.ep_rank if groups is not None else 0
        self.layers: dict[str, MoeLayerPlan] = {p: layer for layer in plan.moe_layers for p in layer.params}

    def is_expert(self, name: str) -> bool:
        return self.ep > 1 and name in self.layers

    def owner(self, name: str) -> int | None:
        """The ep rank holding a loop-form expert parameter; None for a fused weight or a dense parameter."""
        return expert_param_owner(self.layers[name], name, self.ep) if self.is_expert(name) else None

    def held(self, name: str) -> bool:
        owner = self.owner(name)
        return owner is None or owner == self.ep_rank

    def spec(self, name: str, shape: tuple[int, ...]) -> ShardSpec | None:
        """The shard spec of a fused expert weight (rows of this rank's experts), else None."""
        if not self.is_expert(name) or self.owner(name) is not None:
            return None
        local = shape[0] // self.ep
        return ShardSpec(name, shape, 0, local, (Piece(self.ep_rank * local, 0, local),))

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        spec = self.spec(name, tuple(full.shape))
        return full if spec is None else full.narrow(0, spec.pieces[0].global_start, spec.local_len)

    @torch.no_grad()
    def gather(self, name: str, local: torch.Tensor | None, like: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """The whole tensor of an expert parameter (or its grad) on every rank of the ep group."""
        assert self.groups is not None
        owner = self.owner(name)
        if owner is not None:
            has = torch.tensor([int(local is not None)], device=device)
            src = self.groups.ep_ranks[owner]
            dist.broadcast(has, src=src, group=self.groups.ep_group)
            if not has.item():
                return None
            full = local.detach().clone() if local is not None else torch.empty(like.shape, dtype=like.dtype, device=device)
            dist.broadcast(full, src=src, group=self.groups.ep_group)
            return full
        assert local is not None
        parts = [torch.empty_like(local) for _ in range(self.ep)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.groups.ep_group)
        return torch.cat(parts)

    def counts_in_norm(self, name: str, dp_rank: int | None) -> bool:
        """Whether this rank's gradient of an expert parameter counts toward the global norm:
        the ranks of one ep group hold disjoint experts; edp replicas count once."""
        assert self.groups is not None
        edp_rank = 0 if self.groups.edp_group is None else dist.get_rank(self.groups.edp_group)
        return self.held(name) and (dp_rank is None or edp_rank == 0)


def drop_counts(plan: ParallelPlan, reset: bool) -> dict[str, tuple[int, int]]:
    """(rows dropped, rows routed) per sync-free MoE layer of ``plan`` since the last reset, counted
    per process and layer name (two models with the same layer names in one process share them)."""
    mine = {layer.name for layer in plan.moe_layers}
    counts = {k: v for k, v in moe_dispatch.drop_counts().items() if k in mine}
    if reset:
        moe_dispatch.reset_drop_counts(mine)
    return counts


class GradBufferSet(GradSyncs):
    """The DistributedOptimizer's buffers with expert parallelism: the dense parameters'
    over dp, the expert parameters' over edp (averaged over dp, module docstring), behind
    the one ``GradBuffers`` interface the optimizer and the model call. Buckets are numbered
    across the parts, in order."""

    def __init__(self, parts: list[GradBuffers]) -> None:
        super().__init__(list(parts))
        self.buffers = parts
        self.slots = {name: slot for part in parts for name, slot in part.slots.items()}
        self.buckets = [b for part in parts for b in part.buckets]
        self.overlap = parts[0].overlap
        self.dp = max(part.dp for part in parts)
        self._offsets = [sum(len(p.buckets) for p in parts[:i]) for i in range(len(parts))]

    @property
    def generation(self) -> int:
        return self.buffers[0].generation

    def shard_pieces(self) -> list:
        return [piece for part in self.buffers for piece in part.shard_pieces()]

    def padding(self) -> int:
        return sum(part.padding() for part in self.buffers)

    def gather_params(self) -> None:
        for part in self.buffers:
            part.gather_params()

    def param_buckets(self, aliases: dict[str, list[str]]) -> BucketLayout | None:
        bucket_of: dict[str, int] = {}
        chunks: dict[int, set[int]] = {}
        for offset, part in zip(self._offsets, self.buffers):
            layout = part.param_buckets(aliases)
            if layout is None:
                continue
            bucket_of.update({name: offset + b for name, b in layout.bucket_of.items()})
            for chunk, buckets in layout.chunk_buckets.items():
                chunks.setdefault(chunk, set()).update(offset + b for b in buckets)
        return BucketLayout(bucket_of, {c: tuple(sorted(b)) for c, b in chunks.items()}) if bucket_of else None

    def wait_bucket(self, index: int) -> None:
        part = max(i for i, offset in enumerate(self._offsets) if offset <= index)
        self.buffers[part].wait_bucket(index - self._offsets[part])


def grad_buffers(uses: list[ParamUse], plan: ParallelPlan, dp_rank: int, dp_group: dist.ProcessGroup | None,
                 groups: ExpertGroups, experts: ExpertShards, **kw: Any) -> GradBufferSet:  # fmt: skip
    """Dense and expert gradient buffers (``GradBuffers`` keywords in ``kw``)."""
    dense = [u for u in uses if not experts.is_expert(u.name)]
    expert = [u for u in uses if experts.is_expert(u.name)]
    edp = 1 if groups.edp_group is None else dist.get_world_size(groups.edp_group)
    edp_rank = 0 if groups.edp_group is None else dist.get_rank(groups.edp_group)
    parts = [GradBuffers(dense, plan.dp, dp_rank, dp_group, **kw)] if dense else []
    if expert:
        shared = {}  # an expert layer lives on one pipeline stage
        parts.append(GradBuffers(expert, edp, edp_rank, groups.edp_group, **dict(kw, shared_groups=shared),
                                 mean_over=plan.dp))  # fmt: skip
    return GradBufferSet(parts)
