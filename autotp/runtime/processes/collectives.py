"""The process-group registry and the kernels (CPU and CUDA) of autotp's collective ops.

The ops, their fake kernels and autograd formulas are in ``autotp.ir.ops``; graphs name
a group by a string key (``autotp.ir.axes.group_key(axis, size)``, ``replica_group_key``)
that the runtime registers here. An unregistered key raises; a registered group of one
rank makes every op local. The registry is per process, as torch's own functional
collectives resolve their group names: a kernel has only the key. A key names one set of
ranks: registering it again for other ranks raises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.library import Library

from autotp.ir import fp8, memory_order, ops
from autotp.ir.errors import UserInputError
from autotp.ir.vocab_logits import local_logits, target_in_range
from autotp.runtime.execution import overlap

_GROUPS: dict[str, dist.ProcessGroup] = {}
_KERNELS = Library(ops.NAMESPACE, "IMPL")
_DEVICES = ("CPU", "CUDA")


def register_group(key: str, group: dist.ProcessGroup) -> None:
    old = _GROUPS.get(key)
    if isinstance(old, dist.ProcessGroup) and isinstance(group, dist.ProcessGroup):
        before, now = dist.get_process_group_ranks(old), dist.get_process_group_ranks(group)
        if before != now:
            raise UserInputError(
                f"group key '{key}' names ranks {before} for a model built earlier in this process and ranks {now} "
                "now; graphs of both would share one key: build models of one layout per process"
            )
    _GROUPS[key] = group


def get_group(key: str) -> dist.ProcessGroup | None:
    """The process group registered as ``key``, or None when it has one rank."""
    group = _GROUPS.get(key)
    if group is None:
        known = ", ".join(sorted(_GROUPS)) or "none"
        raise UserInputError(
            f"no process group is registered as '{key}' (registered: {known}); run the graph on ranks set up "
            "by autotp.parallelize, or register the group with autotp.runtime.processes.collectives.register_group"
        )
    return None if dist.get_world_size(group) == 1 else group


def group_of_size(key: str, group_size: int) -> dist.ProcessGroup | None:
    """``get_group(key)``, checked to have ``group_size`` ranks."""
    group = get_group(key)
    actual = 1 if group is None else dist.get_world_size(group)
    if actual != group_size:
        raise UserInputError(f"the graph expects {group_size} ranks in group '{key}', but it has {actual}; compile it for {actual}")
    return group


def _all_reduce_(x: Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _parts(x: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _gathered(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    return torch.cat(_parts(x, group), dim=dim)


def _reduced(x: Tensor, group: str, op: dist.ReduceOp.RedOpType) -> Tensor:
    """x summed (or maxed) over the group, in x's memory order (``memory_order.empty_in_memory_order``);
    a tensor of its own, not a view."""
    out = memory_order.reduced_like(x)
    out.copy_(x)
    _all_reduce_(out.permute(memory_order.memory_order(x)), get_group(group), op)
    return out


def _reduce_from_tp(x: Tensor, group: str) -> Tensor:
    return _reduced(x, group, dist.ReduceOp.SUM)


def _all_reduce_max(x: Tensor, group: str) -> Tensor:
    return _reduced(x, group, dist.ReduceOp.MAX)


def _gather_from_tp(x: Tensor, dim: int, size: int, group: str) -> Tensor:
    """x's parts along ``dim``, the first ``size`` of them kept, in x's memory order: a tensor of
    its own, never a view (autograd forbids writing in place into a custom op's view output, a
    MoE's ``out[mask] = ...``)."""
    pg = get_group(group)
    order = memory_order.memory_order(x)
    at = order.index(dim % x.dim())
    out = memory_order.empty_in_memory_order(x, dim, size)
    dense = out.permute(order)  # contiguous: the parts are laid in it as in one tensor of x's order
    if pg is None:
        dense.copy_(x.permute(order).narrow(at, 0, size))
    elif x.shape[dim] * dist.get_world_size(pg) == size:
        torch.cat(_parts(x.permute(order), pg), dim=at, out=dense)
    else:
        dense.copy_(torch.cat(_parts(x.permute(order), pg), dim=at).narrow(at, 0, size))
    return out


def _scatter_to_tp(x: Tensor, dim: int, local: int, group: str) -> Tensor:
    pg = get_group(group)
    start = 0 if pg is None else dist.get_rank(pg) * local
    have = max(min(x.shape[dim] - start, local), 0)
    out = x.new_zeros([local if d == dim % x.dim() else s for d, s in enumerate(x.shape)])
    out.narrow(dim, 0, have).copy_(x.narrow(dim, start, have))
    return out


def _all_gather(x: Tensor, dim: int, group_size: int, group: str) -> Tensor:
    pg = group_of_size(group, group_size)
    return x.clone() if pg is None else _gathered(x, dim, pg)


def _reduce_scatter(x: Tensor, dim: int, group_size: int, group: str) -> Tensor:
    pg = group_of_size(group, group_size)
    local = ops.reduce_scatter_size(x.shape[dim], group_size, group)
    if pg is None:
        return x.clone()
    rank = dist.get_rank(pg)
    if dist.get_backend(pg) == dist.Backend.GLOO:  # gloo has no reduce-scatter
        return _all_reduce_(x.clone(memory_format=torch.contiguous_format), pg).narrow(dim, rank * local, local).clone()
    out = x.new_empty([local if d == dim % x.dim() else s for d, s in enumerate(x.shape)])
    dist.reduce_scatter(out, [p.contiguous() for p in x.split(local, dim=dim)], group=pg)
    return out


def _all_gather_matmul(x: Tensor, weights: list[Tensor], dim: int, group_size: int, group: str, impl: str) -> list[Tensor]:
    pg = group_of_size(group, group_size)
    if pg is None:
        return [x.clone(), *(torch.matmul(x, w) for w in weights)]
    return overlap.all_gather_matmul(x, weights, dim, pg, impl)


def _matmul_reduce_scatter(xs: list[Tensor], weights: list[Tensor], dim: int, group_size: int, group: str, impl: str) -> Tensor:
    pg = group_of_size(group, group_size)
    local = ops.reduce_scatter_size(xs[0].shape[dim], group_size, group)
    if pg is None:
        return sum(torch.matmul(x, w) for x, w in zip(xs, weights))  # type: ignore[return-value]
    return overlap.matmul_reduce_scatter(xs, weights, dim, local, pg, impl)


def _vocab_parallel_nll(logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, group: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``logsumexp - target logit`` over the whole vocabulary, with the global
    row max and sum of exps (which the backward reuses)."""
    pg = get_group(group)
    x = local_logits(logits, vocab_start, vocab_size)
    row_max = _all_reduce_(x.max(dim=-1).values, pg, dist.ReduceOp.MAX)
    shifted = x - row_max.unsqueeze(-1)
    in_range, local_target = target_in_range(target, vocab_start, x.shape[-1])
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
    sum_exp, target_logit = _all_reduce_(torch.stack([shifted.exp().sum(dim=-1), picked]), pg)
    return sum_exp.log() - target_logit, row_max, sum_exp


_IMPLEMENTATIONS: dict[torch._ops.OpOverload, Callable[..., object]] = {
    ops.REDUCE_FROM_TP: _reduce_from_tp,
    ops.ALL_REDUCE_MAX: _all_reduce_max,
    ops.GATHER_FROM_TP: _gather_from_tp,
    ops.SCATTER_TO_TP: _scatter_to_tp,
    ops.ALL_GATHER: _all_gather,
    ops.REDUCE_SCATTER: _reduce_scatter,
    ops.ALL_GATHER_MATMUL: _all_gather_matmul,
    ops.MATMUL_REDUCE_SCATTER: _matmul_reduce_scatter,
    ops.VOCAB_PARALLEL_NLL: _vocab_parallel_nll,
}
for _op, _fn in _IMPLEMENTATIONS.items():
    for _device in _DEVICES:
        _KERNELS.impl(_op._schema.name.split("::")[1], _fn, _device)
# FP8 GEMMs: plain torch ops around the amax all-reduces, on every device and through autograd.
_KERNELS.impl("fp8_linear", fp8.fp8_linear, "CompositeImplicitAutograd")
