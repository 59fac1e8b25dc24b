"""Gradients and losses across ranks: one interface (``GradSync``), three ways, and the mean loss.

A ``train_step`` calls ``begin(microbatches)`` before its backward passes and ``finish()``
after them; then every local ``.grad`` is the step's gradient: summed over the pipeline
stages that share a parameter (a tied embedding and lm_head) and averaged over dp. A
``ParallelModel`` runs one of:

* ``DpMean`` (one chunk per rank, dp > 1): averages the gradients over dp while the
  backward runs: a hook counts each parameter's accumulations and, once every parameter of
  a bucket has its last one, all-reduces the bucket asynchronously. Buckets hold
  parameters in reverse order of ``parameters()`` (roughly the order backward produces
  their gradients) and launch strictly in index order, so every dp rank issues the same
  collectives in the same order; a bucket with a parameter that got no gradient waits for
  ``finish``.
* ``PostStepSync`` (a pipeline, or dp = 1): after the step, sums the gradients of shared
  parameters over their stages and all-reduces every gradient over dp in buckets
  (``all_reduce_buckets``).
* ``GradBuffers`` (``autotp.runtime.gradients.grad_buffers``), which a ``DistributedOptimizer``
  installs (``ParallelModel.install_grad_sync``): contiguous buffers reduce-scattered over
  dp as the backward runs, for every layout; it ``holds_grads``.

With expert parallelism the expert parameters' gradients are summed over edp instead
(``autotp.runtime.state.expert_parallel``: ``ExpertGradMean`` beside one of the first two in a
``GradSyncs``, or ``GradBufferSet``, the buffers per axis).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from autotp.ir.plan import ParallelPlan
from autotp.ir.program import BucketLayout
from autotp.runtime.processes.groups import Coords, all_pipelines

if TYPE_CHECKING:
    from autotp.runtime.state.expert_parallel import ExpertShards


class GradSync(ABC):
    """How a step's gradients reach every rank that holds their parameters (module docstring)."""

    holds_grads = False
    """Whether the gradients live in its buffers (zeroed by it, reduce-scattered by ``finish``)."""
    reduced = False
    """Whether each rank holds only its slice of the last step's gradients (reduce-scattered)."""

    @abstractmethod
    def begin(self, microbatches: int) -> None:
        """Arm a step whose every parameter gets ``microbatches`` backward passes (per chunk reading it)."""

    @abstractmethod
    def finish(self) -> None:
        """After the step's backward passes: make the gradients the step's."""

    def param_buckets(self, aliases: dict[str, list[str]]) -> BucketLayout | None:
        """The buckets whose parameter all-gather the graphs wait for (None: no waits)."""
        del aliases
        return None

    def wait_bucket(self, index: int) -> None:
        """Wait for the all-gather of bucket ``index`` of ``param_buckets`` (the graphs' waits call it)."""

    def wait_params(self) -> None:
        """Wait for any parameter update still in flight (before the parameters are read)."""

    def zero_grad(self) -> None:
        """With ``holds_grads``: zero its buffers (``.grad`` stays a view of them)."""

    def close(self) -> None:
        """Remove the hooks it put on parameters."""


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


class PostStepSync(GradSync):
    """Sums shared parameters' gradients over their stages after the step, then averages the
    ``dense`` gradients over dp in buckets (module docstring). ``module``: the model, by a weak
    proxy (it holds this object); ``trained_shared``: shared parameters some stage trains (a
    stage that reads one without grad adds a zero gradient, so every holder steps it alike)."""

    def __init__(self, module: nn.Module, plan: ParallelPlan, coords: Coords, shared: dict[str, dist.ProcessGroup],
                 trained_shared: list[str], dense: Callable[[str], bool]) -> None:  # fmt: skip
        self.module, self.plan, self.coords = module, plan, coords
        self.shared, self.trained_shared, self.dense = shared, trained_shared, dense
        self._carried: dict[str, torch.Tensor] = {}

    def _grads(self, names: list[str]) -> dict[str, torch.Tensor | None]:
        if not names:  # most plans: no parameter shared between stages (a walk over every parameter per call)
            return {}
        local = dict(self.module.named_parameters())
        return {n: local[n].grad for n in names if n in local}

    def begin(self, microbatches: int) -> None:
        # Grads of stage-shared parameters already summed by an earlier step, when the caller accumulates.
        self._carried = {n: g.clone() for n, g in self._grads(list(self.shared)).items() if g is not None}

    def finish(self) -> None:
        for name, grad in self._grads(self.trained_shared).items():
            if grad is None:
                param = self.module.get_parameter(name)
                param.grad = torch.zeros_like(param)
        for name, grad in self._grads(list(self.shared)).items():
            if grad is None:
                continue
            before = self._carried.get(name)
            if before is not None:
                grad -= before
            dist.all_reduce(grad, group=self.shared[name])
            if before is not None:
                grad += before
        self._carried = {}
        if self.plan.dp > 1:
            grads = [p.grad for n, p in self.module.named_parameters() if p.grad is not None and self.dense(n)]
            all_reduce_buckets(grads, self.coords.dp_group, self.plan.dp, self.plan.dp_bucket_bytes)


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


class DpMean(GradSync):
    """The dp mean of every ``dense`` gradient, all-reduced in buckets from backward hooks (module
    docstring). The hooks sit on ``module``'s parameters of the last ``begin`` (made again if they
    changed); ``module`` is the model, by a weak proxy (it holds this object)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, dp: int, bucket_bytes: Callable[[], int],
                 dense: Callable[[str], bool]) -> None:  # fmt: skip
        """``bucket_bytes``: the plan's bucket size, read at each ``begin`` (the buckets follow it)."""
        self.module, self.group, self.dp, self.bucket_bytes, self.dense = module, group, dp, bucket_bytes, dense
        self._bucket_bytes = 0
        self.params: list[nn.Parameter] = []
        self.buckets: list[list[int]] = []
        self._ids: list[int] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._bucket_of: dict[int, int] = {}
        self._expected = 0
        self._counts: dict[int, int] = {}
        self._filled: list[int] = []
        self._next = 0
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
        self.armed = False
        self.launched_in_backward = 0  # buckets of the last step launched before ``finish``

    def _hook(self, params: list[nn.Parameter]) -> None:
        self.close()
        self.params = [p for p in reversed(params) if p.requires_grad]
        self.buckets = _buckets(self.params, self._bucket_bytes)
        self._bucket_of = {id(p): b for b, members in enumerate(self.buckets) for p in (self.params[i] for i in members)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        self._ids = [id(p) for p in params]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin(self, microbatches: int) -> None:
        params = [p for n, p in self.module.named_parameters() if self.dense(n)]
        size = self.bucket_bytes()
        if self._ids != [id(p) for p in params] or size != self._bucket_bytes:  # hooks on the parameters of now
            self._bucket_bytes = size
            self._hook(params)
        self._expected, self._counts = microbatches, {}
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
        if not self.armed:
            return
        while self._next < len(self.buckets):
            self._launch()
        for grads, flat, work in self._pending:
            work.wait()
            _mean_into(grads, flat, self.dp)
        self._pending, self.armed = [], False


class GradSyncs(GradSync):
    """Several syncs, each over its own parameters (the dense ones over dp, the experts' over
    edp), run in order."""

    def __init__(self, parts: list[GradSync]) -> None:
        self.parts = parts

    @property
    def holds_grads(self) -> bool:  # type: ignore[override]
        return any(part.holds_grads for part in self.parts)

    @property
    def reduced(self) -> bool:  # type: ignore[override]
        return any(part.reduced for part in self.parts)

    def _each(self, method: str, *args: int) -> None:
        for part in self.parts:
            getattr(part, method)(*args)

    def begin(self, microbatches: int) -> None:
        self._each("begin", microbatches)

    def finish(self) -> None:
        self._each("finish")

    def zero_grad(self) -> None:
        self._each("zero_grad")

    def wait_params(self) -> None:
        self._each("wait_params")

    def close(self) -> None:
        self._each("close")


class ExpertGradMean(GradSync):
    """After the step: sums the expert gradients over edp and divides them by dp (module
    docstring). ``module``: the model, by a weak proxy (it holds this object)."""

    def __init__(self, module: nn.Module, experts: ExpertShards, dp: int) -> None:
        self.module, self.experts, self.dp = module, experts, dp

    def begin(self, microbatches: int) -> None:
        del microbatches

    def finish(self) -> None:
        groups = self.experts.groups
        assert groups is not None
        for name, p in self.module.named_parameters():
            if p.grad is not None and self.experts.is_expert(name):
                if groups.edp_group is not None:
                    dist.all_reduce(p.grad, group=groups.edp_group)
                p.grad /= self.dp


def default_sync(module: nn.Module, plan: ParallelPlan, coords: Coords, shared: dict[str, dist.ProcessGroup],
                 trained_shared: list[str], experts: ExpertShards) -> GradSync:  # fmt: skip
    """What a ParallelModel syncs its gradients with until a DistributedOptimizer installs its
    buffers (module docstring). ``module``: the model, by a weak proxy (it holds the sync)."""
    dense = lambda name: not experts.is_expert(name)  # noqa: E731 (the expert gradients: over edp)
    sync: GradSync = (
        DpMean(module, coords.dp_group, plan.dp, lambda: module.plan.dp_bucket_bytes, dense)
        if plan.dp > 1 and plan.num_chunks == 1
        else PostStepSync(module, plan, coords, shared, trained_shared, dense)
    )
    return sync if coords.experts is None else GradSyncs([ExpertGradMean(module, experts, plan.dp), sync])


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
