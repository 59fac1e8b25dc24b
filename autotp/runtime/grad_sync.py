"""Gradients and losses across ranks: shared-parameter sums, dp buckets, the mean loss.

Without a pipeline (one chunk per rank), ``OverlappedDpMean`` averages the gradients over
dp while the backward runs: a hook counts each parameter's accumulations and, once every
parameter of a bucket has its last one, all-reduces the bucket asynchronously. Buckets
hold parameters in reverse order of ``parameters()`` (roughly the order backward produces
their gradients) and launch strictly in index order, so every dp rank issues the same
collectives in the same order; a bucket with a parameter that got no gradient waits for
``finish``. With a pipeline, ``sync_grads`` all-reduces the buckets after the step
(``all_reduce_buckets``); ``autotp.DistributedOptimizer`` overlaps its reduce-scatters
with the backward for every layout (``autotp.runtime.grad_buffers``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` cut into runs of one dtype and about ``bucket_bytes`` each."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if out and size + nbytes <= bucket_bytes and tensors[out[-1][0]].dtype == t.dtype:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def _mean_into(grads: list[torch.Tensor], flat: torch.Tensor, dp: int) -> None:
    flat /= dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class OverlappedDpMean:
    """The dp mean of every gradient, all-reduced in buckets from backward hooks (module docstring)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, dp: int, bucket_bytes: int) -> None:
        self.params = [p for p in reversed(params) if p.requires_grad]
        self.group, self.dp = group, dp
        self.buckets = _buckets(self.params, bucket_bytes)
        self._bucket_of = {id(p): b for b, members in enumerate(self.buckets) for p in (self.params[i] for i in members)}
        self._expected = 0
        self._counts: dict[int, int] = {}
        self._filled: list[int] = []
        self._next = 0
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
        self.armed = False
        self.launched_in_backward = 0  # buckets of the last step launched before ``finish``
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        self._ids = [id(p) for p in params]

    def serves(self, params: list[nn.Parameter]) -> bool:
        """Whether its hooks sit on exactly these parameters (not on ones since replaced)."""
        return self._ids == [id(p) for p in params]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def begin(self, backwards: int) -> None:
        """Arm a step in which every parameter's gradient accumulates ``backwards`` times."""
        self._expected, self._counts = backwards, {}
        self._filled, self._next, self._pending = [0] * len(self.buckets), 0, []
        self.armed, self.launched_in_backward = True, 0

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        n = self._counts[id(p)] = self._counts.get(id(p), 0) + 1
        if n == self._expected:
            self._filled[self._bucket_of[id(p)]] += 1
            while self._next < len(self.buckets) and self._filled[self._next] == len(self.buckets[self._next]):
                self._launch()
                self.launched_in_backward += 1

    def _launch(self) -> None:
        grads = [g for g in (self.params[i].grad for i in self.buckets[self._next]) if g is not None]
        self._next += 1
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._pending.append((grads, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """Launch the buckets still waiting, wait for all, write the means into ``.grad``."""
        while self._next < len(self.buckets):
            self._launch()
        for grads, flat, work in self._pending:
            work.wait()
            _mean_into(grads, flat, self.dp)
        self._pending, self.armed = [], False


def all_reduce_buckets(grads: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int, bucket_bytes: int) -> None:
    """Average ``grads`` over the dp group, about ``bucket_bytes`` per all-reduce."""
    for members in _buckets(grads, bucket_bytes):
        bucket = [grads[i] for i in members]
        flat = torch.cat([b.reshape(-1) for b in bucket])
        dist.all_reduce(flat, group=group)
        _mean_into(bucket, flat, dp)


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
