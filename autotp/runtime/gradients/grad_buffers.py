"""Contiguous gradient and parameter buffers, reduce-scattered and all-gathered in buckets (seed 004).

Per model chunk of this rank and per parameter dtype, one flat gradient buffer and one
flat parameter buffer with the same layout: the parameters in reverse order of their
first use in the chunk's forward (the order backward produces their gradients), cut into
buckets of about ``bucket_bytes`` of gradients at parameter boundaries, each padded to a
multiple of ``dp * ALIGN`` elements. Parameters' ``.data`` are views into the parameter
buffer. Where the gradient dtype is the parameter's, ``.grad`` is a view into the
gradient buffer and autograd accumulates into it in place; otherwise (bf16 params with
fp32 main grads) a hook adds each new ``.grad`` into the parameter's fp32 ``main_grad``
view and frees it.

**Reduce-scatter as buckets fill.** ``begin(m)`` arms a step of m microbatches: a
parameter's gradient is final after ``m * uses`` accumulations (``uses``: the chunks of
this rank that read it, each a separate backward). A hook counts them; when every
parameter of a bucket is final, the bucket is reduce-scattered over the dp group
asynchronously (``async_op``), so the communication overlaps the rest of the backward.
Buckets are launched strictly in index order, so every dp rank issues the same
collectives in the same order even when a parameter gets no gradient (its bucket then
waits for ``finish``). Parameters held by several pipeline stages (a tied embedding)
are in buckets of their own, launched by ``finish`` after their gradient is summed over
the stages. After ``finish`` each dp rank holds the dp-mean of its 1/dp slice of every
bucket (``shard``); the rest of the buffer is stale until ``zero_grad``.

**All-gather, overlapped with the next forward.** After the optimizer wrote this rank's
slice of the parameter buffer, ``gather_params`` all-gathers every bucket (one async
collective per bucket, in order of first use in the forward). With ``overlap`` it
returns at once: the compiler put a wait into each graph that runs
(``passes/insert_param_waits``, for the ``bucket_layout``), right before the first node
that reads a bucket's parameters, whose callback is ``wait_bucket``, so the forward waits
for bucket k while buckets k+1, ... are still in flight (Megatron's forward pre-hooks, at
graph-node granularity). Whatever else reads the parameters (checkpoints, unsharding,
the next step) calls ``wait_params`` first. Without ``overlap`` it waits for every
bucket before returning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autotp.ir.program import BucketLayout
from autotp.runtime.gradients.grad_sync import GradSync

ALIGN = 64  # elements per dp slice of a bucket are a multiple of this (aligned NCCL buffers)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ParamUse:
    """A trainable parameter of this rank, as the buffers lay it out."""

    name: str
    param: nn.Parameter
    chunk: int  # the pipeline chunk its gradient lives with (the lowest of its chunks on this rank)
    uses: int  # backward passes per microbatch that accumulate into it
    order: int  # position of its first use in the chunk's forward
    shared: bool  # held by several pipeline stages: its gradient is summed over them first


@dataclass
class Slot:
    """Where one parameter lives in its buffers."""

    use: ParamUse
    bucket: int
    start: int  # offset in the bucket
    grad: Tensor  # view into the gradient buffer, the parameter's shape

    @property
    def numel(self) -> int:
        return self.use.param.numel()


@dataclass
class Bucket:
    index: int
    grads: Tensor  # flat view into a gradient buffer, padded length
    params: Tensor  # flat view into a parameter buffer, same layout
    slots: list[Slot] = field(default_factory=list)
    deferred: bool = False
    expected: int = 0
    seen: int = 0
    work: dist.Work | None = None
    launched: bool = False
    gather: dist.Work | None = None  # the parameters' all-gather in flight

    @property
    def first_use(self) -> tuple[int, int]:
        return min((s.use.chunk, s.use.order) for s in self.slots)

    def shard(self, t: Tensor, dp: int, dp_rank: int) -> Tensor:
        size = t.numel() // dp
        return t[dp_rank * size : (dp_rank + 1) * size]


class GradBuffers(GradSync):
    """This rank's gradient/parameter buffers and their dp collectives (module docstring)."""

    holds_grads = True

    def __init__(self, uses: list[ParamUse], dp: int, dp_rank: int, group: dist.ProcessGroup | None,
                 bucket_bytes: int, grad_dtype: torch.dtype | None,
                 shared_groups: dict[str, dist.ProcessGroup], overlap: bool = False, mean_over: int | None = None) -> None:  # fmt: skip
        """``grad_dtype``: of 16-bit parameters' gradients (None: the parameter's dtype; fp32 params keep fp32).
        ``overlap``: leave the parameters' all-gather in flight for the graphs' waits (module docstring).
        ``mean_over``: what the summed gradients are divided by (default ``dp``, the group's size; expert
        parameters sharded over edp divide by the dense dp)."""
        self.dp, self.dp_rank, self.group = dp, dp_rank, group
        self.mean_over = mean_over or dp
        self.overlap = overlap
        self.shared_groups = shared_groups
        self.buckets: list[Bucket] = []
        self.slots: dict[str, Slot] = {}
        self.main_grad_mode: dict[str, bool] = {}
        self._reduced = False
        self._armed = False
        self._next = 0  # first bucket not launched yet
        self.generation = 0  # zero_grad calls so far
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        keys = sorted({(u.shared, -u.chunk, str(u.param.dtype)) for u in uses})
        for shared, neg_chunk, dtype_name in keys:
            group_uses = [u for u in uses if (u.shared, -u.chunk, str(u.param.dtype)) == (shared, neg_chunk, dtype_name)]
            group_uses.sort(key=lambda u: -u.order)  # reverse order of use
            self._lay_out(group_uses, bucket_bytes, grad_dtype, deferred=shared)
        self.gather_order = sorted(self.buckets, key=lambda b: b.first_use)
        for slot in self.slots.values():
            self._hooks.append(slot.use.param.register_post_accumulate_grad_hook(self._hook(slot)))

    def _lay_out(self, uses: list[ParamUse], bucket_bytes: int, grad_dtype: torch.dtype | None, deferred: bool) -> None:
        param_dtype = uses[0].param.dtype
        gdtype = grad_dtype if grad_dtype is not None and param_dtype.itemsize < 4 else param_dtype
        spans: list[tuple[list[ParamUse], int]] = []  # (params, padded numel) per bucket
        current: list[ParamUse] = []
        size = 0
        for u in uses:
            current.append(u)
            size += u.param.numel()
            if size * gdtype.itemsize >= bucket_bytes:
                spans.append((current, size))
                current, size = [], 0
        if current:
            spans.append((current, size))
        multiple = self.dp * ALIGN
        padded = [-(-n // multiple) * multiple for _, n in spans]
        device = uses[0].param.device
        grads = torch.zeros(sum(padded), dtype=gdtype, device=device)
        params = torch.zeros(sum(padded), dtype=param_dtype, device=device)
        offset = 0
        for (members, _), length in zip(spans, padded):
            bucket = Bucket(len(self.buckets), grads[offset : offset + length], params[offset : offset + length], deferred=deferred)
            start = 0
            for u in members:
                n = u.param.numel()
                view = bucket.params[start : start + n].view_as(u.param)
                view.copy_(u.param.detach())
                u.param.data = view
                slot = Slot(u, bucket.index, start, bucket.grads[start : start + n].view_as(u.param))
                self.main_grad_mode[u.name] = gdtype != param_dtype
                if not self.main_grad_mode[u.name]:
                    u.param.grad = slot.grad
                bucket.slots.append(slot)
                self.slots[u.name] = slot
                start += n
            self.buckets.append(bucket)
            offset += length

    # ---- backward ------------------------------------------------------------------

    def _hook(self, slot: Slot) -> Callable[[Tensor], None]:
        name = slot.use.name

        def hook(p: Tensor) -> None:
            if self._reduced:
                raise RuntimeError(
                    f"a gradient of {name} arrived after the step's gradients were reduce-scattered; "
                    "call opt.zero_grad() after opt.step() and before the next backward"
                )
            if self.main_grad_mode[name]:
                slot.grad.add_(p.grad)
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != slot.grad.data_ptr():
                raise RuntimeError(
                    f"the .grad of {name} is no longer the DistributedOptimizer's gradient buffer (it was set to None "
                    "or replaced, e.g. by zero_grad(set_to_none=True) on the parameters); zero gradients with "
                    "opt.zero_grad() or pm.zero_grad()"
                )
            if self._armed:
                bucket = self.buckets[slot.bucket]
                if bucket.launched:
                    raise RuntimeError(
                        f"a gradient of {name} arrived after its bucket was reduce-scattered: the step ran more "
                        "backward passes than train_step planned (do not call backward inside train_step's loss_fn)"
                    )
                bucket.seen += 1
                self._launch_ready()

        return hook

    def begin(self, microbatches: int) -> None:
        """Arm a step of ``microbatches`` microbatches: launch buckets as their gradients become final."""
        if self._reduced:
            raise RuntimeError("the gradients of the last step were not zeroed: call opt.zero_grad() after opt.step()")
        for b in self.buckets:
            b.expected = microbatches * sum(s.use.uses for s in b.slots)
            b.seen = 0
        self._armed = True

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.deferred or b.seen < b.expected:
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        assert b.index == self._next
        if self.dp > 1:
            b.work = _reduce_scatter(b.shard(b.grads, self.dp, self.dp_rank), b.grads, group=self.group, async_op=True)
        b.launched = True
        self._next += 1

    def finish(self) -> None:
        """Sum shared parameters' gradients over their stages, reduce-scatter what is left, wait, average."""
        if self._reduced:
            return
        for name, group in self.shared_groups.items():
            if name in self.slots:
                dist.all_reduce(self.slots[name].grad, group=group)
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if self.mean_over > 1:
                b.shard(b.grads, self.dp, self.dp_rank).div_(self.mean_over)
        self._reduced = True
        self._armed = False

    @property
    def reduced(self) -> bool:
        return self._reduced

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grads.zero_()
            b.launched = False
            b.seen = 0
        for name, slot in self.slots.items():
            if self.main_grad_mode[name]:
                slot.use.param.grad = None
            else:
                slot.use.param.grad = slot.grad
        self._reduced = False
        self._armed = False
        self._next = 0
        self.generation += 1

    # ---- parameters ----------------------------------------------------------------

    def gather_params(self) -> None:
        """All-gather every bucket's parameters from the rank that owns each slice, one async
        all-gather per bucket in order of first use; without ``overlap``, wait for them all."""
        if self.dp == 1:
            return
        self.wait_params()
        for b in self.gather_order:
            b.gather = _all_gather(b.params, b.shard(b.params, self.dp, self.dp_rank), group=self.group, async_op=True)
        if not self.overlap:
            self.wait_params()

    def wait_bucket(self, index: int) -> None:
        """Wait for bucket ``index``'s all-gather, if one is in flight."""
        b = self.buckets[index]
        if b.gather is not None:
            work, b.gather = b.gather, None
            work.wait()

    def wait_params(self) -> None:
        """Wait for every all-gather in flight: the parameters are then up to date."""
        for b in self.gather_order:
            self.wait_bucket(b.index)

    @property
    def gathering(self) -> bool:
        return any(b.gather is not None for b in self.buckets)

    def param_buckets(self, aliases: dict[str, list[str]]) -> BucketLayout | None:
        """With ``overlap``: the bucket of every name of every parameter here (``aliases``:
        canonical name -> its names) and the buckets of each chunk, which the graphs wait for."""
        if not self.overlap or self.dp == 1:
            return None
        bucket_of = {alias: slot.bucket for name, slot in self.slots.items() for alias in aliases.get(name, [name])}
        chunks: dict[int, set[int]] = {}
        for slot in self.slots.values():
            chunks.setdefault(slot.use.chunk, set()).add(slot.bucket)
        return BucketLayout(bucket_of, {c: tuple(sorted(b)) for c, b in chunks.items()})

    def shard_pieces(self) -> list[tuple[Slot, int, int]]:
        """(slot, start, stop): the flat ranges of each parameter inside this rank's slices."""
        out = []
        for b in self.buckets:
            size = b.grads.numel() // self.dp
            lo, hi = self.dp_rank * size, (self.dp_rank + 1) * size
            for slot in b.slots:
                start, stop = max(lo, slot.start), min(hi, slot.start + slot.numel)
                if start < stop:
                    out.append((slot, start - slot.start, stop - slot.start))
        return out

    def padding(self) -> int:
        """Padding elements of this rank's slices, summed over buckets."""
        return sum(b.grads.numel() // self.dp for b in self.buckets) - sum(stop - start for _, start, stop in self.shard_pieces())

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
