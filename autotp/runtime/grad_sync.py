"""Gradients and losses across ranks: shared-parameter sums, dp buckets, the mean loss."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotp.ir.plan import ParallelPlan
from autotp.runtime.groups import Coords, all_pipelines


def shared_param_groups(plan: ParallelPlan, coords: Coords, owners: dict[str, list[int]]) -> dict[str, dist.ProcessGroup]:
    """Per parameter held by several pipeline stages (``owners``: canonical name ->
    sorted pipeline ranks; a tied embedding and lm_head), the group of this pipeline's
    owners."""
    groups: dict[str, dist.ProcessGroup] = {}
    if plan.pp == 1:
        return groups
    assert coords.pipeline is not None
    for name, ranks in owners.items():
        if len(ranks) < 2:
            continue
        # new_group is collective: every rank creates every group, in the same order.
        for stage_ranks in all_pipelines(plan):
            group = dist.new_group([stage_ranks[o] for o in ranks])
            if stage_ranks == coords.pipeline.pp_ranks:
                groups[name] = group
    return groups


def sync_grads(
    plan: ParallelPlan,
    coords: Coords,
    shared: dict[str, torch.Tensor | None],
    shared_groups: dict[str, dist.ProcessGroup],
    grads: list[torch.Tensor],
    carried: dict[str, torch.Tensor],
) -> None:
    """Sum the grads of parameters shared by pipeline stages (``shared``: name -> this
    rank's grad of it) over what this step added to ``carried`` (their grads before the
    step, already summed); average ``grads`` (every local grad) over dp ranks."""
    for name, grad in shared.items():
        if grad is None:
            continue
        before = carried.get(name)
        if before is not None:
            grad -= before
        dist.all_reduce(grad, group=shared_groups[name])
        if before is not None:
            grad += before
    if plan.dp > 1:
        all_reduce_buckets(grads, coords.dp_group, plan.dp, plan.dp_bucket_bytes)


def all_reduce_buckets(grads: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int, bucket_bytes: int) -> None:
    """Average ``grads`` over the dp group, about ``bucket_bytes`` per all-reduce."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads + [None]:  # type: ignore[list-item]
        if g is not None and (not bucket or (size + g.numel() * g.element_size() <= bucket_bytes and g.dtype == bucket[0].dtype)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            flat /= dp
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


def mean_loss(plan: ParallelPlan, coords: Coords, local: torch.Tensor) -> torch.Tensor:
    """This dp rank's loss (known on the last stage) -> the global mean on every rank."""
    pipe = coords.pipeline
    if pipe is not None and plan.pp > 1:
        is_last = coords.pp_rank == plan.pp_rank_of_chunk(plan.num_chunks - 1)
        local = local if is_last else torch.zeros_like(local)
        dist.all_reduce(local, group=pipe.pp_group)
    if plan.dp > 1:
        dist.all_reduce(local, group=coords.dp_group)
        local = local / plan.dp
    return local
