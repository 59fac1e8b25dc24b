"""Tensor-parallel collectives that the passes insert as graph nodes.

Each is a plain function backed by an ``autograd.Function``, so it shows in graph dumps
under its own name and can be counted by target:

* ``copy_to_tp`` -- Megatron's *f*: identity forward, all-reduce of the grad backward.
* ``reduce_from_tp`` -- Megatron's *g*: all-reduce forward, identity backward.
* ``gather_from_tp`` -- all-gather along a dim (full logits for the user), backward
  keeps this rank's slice.
* ``vocab_parallel_embedding`` -- local lookup with out-of-range ids masked; the
  result is a partial sum.
* ``vocab_parallel_cross_entropy`` -- cross-entropy over vocab-sharded logits; only
  per-token max, sum-exp and target logit cross ranks.

Groups are referred to by a string key (``"tp2"``...) registered at runtime, so graphs
stay printable. An unregistered key or a group of size 1 makes every op local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

_GROUPS: dict[str, dist.ProcessGroup] = {}


def register_group(key: str, group: dist.ProcessGroup) -> None:
    _GROUPS[key] = group


def get_group(key: str) -> dist.ProcessGroup | None:
    group = _GROUPS.get(key)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _all_reduce(x: Tensor, key: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    group = get_group(key)
    if group is None:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x: Tensor, key: str) -> Tensor:  # type: ignore[override]
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad.clone(), ctx.key), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x: Tensor, key: str) -> Tensor:  # type: ignore[override]
        return _all_reduce(x.clone(), key)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


class _GatherFromTP(Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, size: int, key: str) -> Tensor:  # type: ignore[override]
        group = get_group(key)
        ctx.dim, ctx.local, ctx.rank = dim, x.shape[dim], dist.get_rank(group) if group else 0
        if group is None:
            return x.narrow(dim, 0, size)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, size)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        start = ctx.rank * ctx.local
        have = max(min(grad.shape[ctx.dim] - start, ctx.local), 0)
        local = grad.narrow(ctx.dim, start, have) if have else grad.narrow(ctx.dim, 0, 0)
        if have < ctx.local:
            pad_shape = list(grad.shape)
            pad_shape[ctx.dim] = ctx.local - have
            local = torch.cat([local, grad.new_zeros(pad_shape)], dim=ctx.dim)
        return local, None, None, None


def copy_to_tp(x: Tensor, key: str) -> Tensor:
    """Megatron f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, key)


def reduce_from_tp(x: Tensor, key: str) -> Tensor:
    """Megatron g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, key)


def gather_from_tp(x: Tensor, dim: int, size: int, key: str) -> Tensor:
    """All-gather ``x`` along ``dim`` and keep the first ``size`` entries (drops padding)."""
    return _GatherFromTP.apply(x, dim, size, key)


def vocab_parallel_embedding(weight: Tensor, ids: Tensor, vocab_start: int, vocab_stop: int, padding_idx: int) -> Tensor:
    """Rows ``[vocab_start, vocab_stop)`` live here; other ids give zeros (a partial sum)."""
    outside = (ids < vocab_start) | (ids >= vocab_stop)
    local_ids = (ids - vocab_start).masked_fill(outside, 0)
    local_pad = padding_idx - vocab_start if vocab_start <= padding_idx < vocab_stop else -1
    out = torch.embedding(weight, local_ids, local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, ignore_index: int, reduction: int, key: str
    ) -> Tensor:
        x = logits.float()
        n_local = x.shape[-1]
        if vocab_start + n_local > vocab_size:  # padded vocabulary rows never win
            pad = torch.arange(n_local, device=x.device) + vocab_start >= vocab_size
            x = x.masked_fill(pad, float("-inf"))
        row_max = _all_reduce(x.max(dim=-1).values, key, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)
        in_range = (target >= vocab_start) & (target < vocab_start + n_local)
        local_target = (target - vocab_start).masked_fill(~in_range, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), picked]), key)
        sum_exp, target_logit = sums[0], sums[1]
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp, sum_exp, local_target, in_range, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == 0:
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / count if reduction == 1 else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        exp, sum_exp, local_target, in_range, valid, count = ctx.saved_tensors
        g = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(g).scatter_(-1, local_target.unsqueeze(-1), 1.0) * in_range.unsqueeze(-1)
        g = (g - onehot) * valid.unsqueeze(-1)
        if ctx.reduction == 0:
            g = g * grad.float().unsqueeze(-1)
        elif ctx.reduction == 1:
            g = g * (grad.float() / count)
        else:
            g = g * grad.float()
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, ignore_index: int, reduction: int, key: str
) -> Tensor:
    """``aten.cross_entropy_loss`` on logits sharded on the last (class) dim.

    ``reduction`` uses aten's codes: 0 none, 1 mean, 2 sum.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, ignore_index, reduction, key)

