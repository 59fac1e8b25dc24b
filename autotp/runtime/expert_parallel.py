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
by dp (``sync_expert_grads``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.ir.moe_ops import DISPATCH_OPS  # noqa: F401 (the schemas the kernels below implement)
from autotp.ir.moe_plan import MoeLayerPlan, ep_group_key, expert_param_owner
from autotp.ir.plan import ParallelPlan
from autotp.ir.rank_groups import groups_of, rank_groups
from autotp.runtime import collectives, moe_dispatch  # noqa: F401 (registers the dispatch kernels)
from autotp.runtime.shard_map import Piece, ShardSpec


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel group (ranks, its index there) and its edp group."""

    ep: int
    ep_rank: int
    ep_ranks: tuple[int, ...]
    ep_group: dist.ProcessGroup | None
    edp_group: dist.ProcessGroup | None


def make_expert_groups(plan: ParallelPlan, world: int, rank: int, timeout: datetime.timedelta) -> ExpertGroups | None:
    """Create the ep and edp groups (collective) and register the ep group's key; None without ep."""
    if plan.ep == 1 or world == 1:
        return None
    groups = rank_groups(world, tp=plan.tp, pp=plan.pp, ep=plan.ep, etp=plan.etp or plan.tp)
    mine = groups_of(rank, groups)
    made: dict[str, dist.ProcessGroup] = {}
    for name in ("ep", "edp"):
        for ranks in groups[name]:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                made[name] = group
    collectives.register_group(ep_group_key(plan.ep), made["ep"])
    return ExpertGroups(plan.ep, mine["ep"].index(rank), tuple(mine["ep"]), made["ep"], made["edp"])


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


def sync_expert_grads(grads: list[torch.Tensor], groups: ExpertGroups, dp: int) -> None:
    """Sum expert gradients over edp and divide by dp (module docstring)."""
    for g in grads:
        if groups.edp_group is not None:
            dist.all_reduce(g, group=groups.edp_group)
        g /= dp
