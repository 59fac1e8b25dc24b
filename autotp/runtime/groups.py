"""This process's place in the tp x dp x pp grid and the process groups of its dimensions."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from autotp.ir.plan import ParallelPlan
from autotp.ir.rank_groups import groups_of, rank_groups
from autotp.ir.ops import replica_group_key, tp_group_key
from autotp.runtime import collectives
from autotp.runtime.expert_parallel import ExpertGroups, make_expert_groups
from autotp.runtime.pipeline import PipelineGroups


@dataclass(frozen=True)
class Coords:
    """Where this process sits in the tp x dp x pp grid, and its groups' keys."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_key: str
    dp_group: dist.ProcessGroup | None
    pipeline: PipelineGroups | None
    experts: ExpertGroups | None = None


def make_groups(plan: ParallelPlan, timeout_s: float) -> Coords:
    """Create every process group (collective: every rank runs this identically)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_key = tp_group_key(plan.tp)
    if world == 1:
        return Coords(0, 0, 0, tp_key, None, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = rank_groups(world, tp=plan.tp, pp=plan.pp)
    mine = groups_of(rank, groups)
    replica_sizes = sorted({max(plan.tp // g, 1) for p in plan.params if not p.sharding.padded for g in p.sharding.groups} - {1})
    for tp_ranks in groups["tp"]:
        group = dist.new_group(tp_ranks, timeout=timeout)
        if rank in tp_ranks:
            collectives.register_group(tp_key, group)
        for size in replica_sizes:
            for start in range(0, plan.tp, size):
                sub = tp_ranks[start : start + size]
                sub_group = dist.new_group(sub, timeout=timeout)
                if rank in sub:
                    collectives.register_group(replica_group_key(tp_key, size), sub_group)
    dp_group = None
    for dp_ranks in groups["dp"]:
        group = dist.new_group(dp_ranks, timeout=timeout)
        if rank in dp_ranks:
            dp_group = group
    pipeline = None
    for pp_ranks in groups["pp"]:
        made = [dist.new_group(pp_ranks, timeout=timeout) for _ in range(3)]
        if rank in pp_ranks:
            pipeline = PipelineGroups(pp_ranks.index(rank), plan.pp, made[0], made[1], made[2], pp_ranks)
    assert pipeline is not None
    return Coords(
        tp_rank=mine["tp"].index(rank),
        dp_rank=mine["dp"].index(rank),
        pp_rank=mine["pp"].index(rank),
        tp_key=tp_key,
        dp_group=dp_group,
        pipeline=pipeline,
        experts=make_expert_groups(plan, world, rank, timeout),
    )


def all_pipelines(plan: ParallelPlan) -> list[list[int]]:
    """The ranks of every pipeline, one list per pipeline."""
    return rank_groups(dist.get_world_size(), tp=plan.tp, pp=plan.pp)["pp"]
