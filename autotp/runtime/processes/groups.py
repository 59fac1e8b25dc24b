"""This process's place on every parallel axis of the plan, and the process groups of those axes.

The groups are the plan's ``rank_groups`` (Megatron's order; with ep or etp, the expert
axes fold the same world, seed 001). The groups that graph collectives name (tp, cp, ep,
etp, and the subgroups of ranks that hold the same slice of a parameter) are registered
in ``autotp.runtime.processes.collectives`` under their ``group_key``; the others (dp, edp, pp) are
handed to the runtime in ``Coords``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from autotp.ir.axes import Axis, group_key, replica_group_key
from autotp.ir.plan import ParallelPlan
from autotp.ir.rank_groups import groups_of
from autotp.runtime.processes import collectives
from autotp.runtime.execution.pipeline import PipelineGroups


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel group (ranks, its index there) and its edp group: the ep and
    edp groups ``make_groups`` made, for ``autotp.runtime.state.expert_parallel``."""

    ep: int
    ep_rank: int
    ep_ranks: tuple[int, ...]
    ep_group: dist.ProcessGroup | None
    edp_group: dist.ProcessGroup | None


GRAPH_AXES = (Axis.TP, Axis.CP, Axis.ETP, Axis.EP)
"""The axes whose collectives are nodes of the graphs (by key); tp's group is made even with one rank."""


@dataclass(frozen=True)
class Coords:
    """Where this process sits on every axis of the plan, and its groups on them."""

    ranks: dict[Axis, int]  # this process's index in its group of each axis (0 on an axis of one rank)
    keys: dict[Axis, str]  # the registered group key of each axis that graphs name
    groups: dict[Axis, dist.ProcessGroup | None]  # its group on each axis made (None: one process)
    pipeline: PipelineGroups | None
    experts: ExpertGroups | None = None  # with ep > 1: the ep and edp groups (MoE folding)

    def rank(self, axis: Axis) -> int:
        return self.ranks.get(axis, 0)

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        return self.groups.get(axis)

    @property
    def tp_rank(self) -> int:
        return self.rank(Axis.TP)

    @property
    def dp_rank(self) -> int:
        return self.rank(Axis.DP)

    @property
    def pp_rank(self) -> int:
        return self.rank(Axis.PP)

    @property
    def tp_key(self) -> str:
        return self.keys[Axis.TP]

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group(Axis.DP)


def make_groups(plan: ParallelPlan, timeout_s: float) -> Coords:
    """Create every process group of the plan's axes (collective: every rank runs this identically)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    keys = {axis: group_key(axis, plan.degree(axis)) for axis in GRAPH_AXES}
    if world == 1:
        return Coords({}, keys, {}, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = plan.rank_groups(world)
    mine = groups_of(rank, groups)
    made: dict[Axis, dist.ProcessGroup | None] = {}
    for axis, axis_groups in groups.items():
        if axis == Axis.PP or (axis != Axis.TP and axis != Axis.DP and len(axis_groups[0]) == 1):
            continue
        for ranks in axis_groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                made[axis] = group
                if axis in GRAPH_AXES:
                    collectives.register_group(keys[axis], group)
            _make_replica_groups(plan, axis, ranks, rank, timeout)
    pipeline = None
    for pp_ranks in groups[Axis.PP]:
        pp_groups = [dist.new_group(pp_ranks, timeout=timeout) for _ in range(3)]
        if rank in pp_ranks:
            pipeline = PipelineGroups(pp_ranks.index(rank), plan.pp, pp_groups[0], pp_groups[1], pp_groups[2], pp_ranks)
    assert pipeline is not None
    experts = None
    if plan.ep > 1:
        ep_ranks = mine[Axis.EP]
        experts = ExpertGroups(plan.ep, ep_ranks.index(rank), tuple(ep_ranks), made[Axis.EP], made.get(Axis.EDP))
    return Coords({axis: ranks.index(rank) for axis, ranks in mine.items()}, keys, made, pipeline, experts)


def _make_replica_groups(plan: ParallelPlan, axis: Axis, ranks: list[int], rank: int, timeout: datetime.timedelta) -> None:
    """The subgroups of ``ranks`` (one group of ``axis``) whose members hold the same slice of a parameter."""
    degree = len(ranks)
    sharded = (p.sharding for p in plan.params if p.axis == axis and not p.sharding.padded)
    sizes = sorted({max(degree // g, 1) for sharding in sharded for g in sharding.groups} - {1})
    for size in sizes:
        for start in range(0, degree, size):
            sub = ranks[start : start + size]
            sub_group = dist.new_group(sub, timeout=timeout)
            if rank in sub:
                collectives.register_group(replica_group_key(group_key(axis, degree), size), sub_group)


def all_pipelines(plan: ParallelPlan) -> list[list[int]]:
    """The ranks of every pipeline, one list per pipeline."""
    return plan.rank_groups(dist.get_world_size())[Axis.PP]
