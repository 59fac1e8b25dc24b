"""Layout rules of reductions and norms, by the dims they reduce.

A reduction keeps the split of every dim it does not reduce. Over a sharded dim:

* ``sum`` (and ``nansum``) of every sharded dim is *partial*: each rank sums its part.
* ``mean`` likewise, once it divides by the whole dim's count, not the rank's
  (``NodeRole.SHARDED_REDUCTION``; ``passes/sharded_statistics`` rescales it).
* ``layer_norm``, ``rms_norm`` and ``linalg_vector_norm`` over a sharded dim are
  computed from a tp-reduced statistic: each rank sums its part of the statistic, one
  all-reduce adds them, and the normalized output keeps the split
  (``NodeRole.SHARDED_NORM``; the pass decomposes the op). A norm weight follows the
  split of the dim it scales (kind ``bias``). Megatron computes a norm over a
  sharded hidden dim this way; the planner weighs it against keeping the producer
  whole (``Walker.allow_statistic``).
* ``var`` / ``std`` (and ``var_mean`` / ``std_mean``) over a sharded dim likewise: a
  tp-reduced mean, then a tp-reduced sum of squared deviations (``NodeRole.SHARDED_NORM``),
  e.g. weight standardization over a row-parallel weight's input dim.
* ``amax`` / ``amin`` (``max()`` / ``min()`` of everything, and ``max(dim)`` / ``min(dim)``
  whose indices nothing reads) of a value whose gradient reaches no loss (a quantization
  scale, under ``detach`` before or after it) over a sharded dim: each rank's extremum,
  max-reduced over the group (``NodeRole.SHARDED_EXTREMUM``). With a gradient it would flow
  to the maxima of every rank that ties, so the dim stays whole.
* ``group_norm`` over channels split in whole groups; ``instance_norm`` over any split but a
  spatial one; per-channel affine ops
  (``fake_quantize_per_channel_affine``) whose scales follow the channel dim's split.
* Anything else (``prod``, ``any``...) needs the dim whole: a conflict.

A statistic over a dim that ranks hold in replicated blocks (KV heads at tp > heads)
would count those blocks several times; the pass divides by the replica count.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.padded_dims import record_mask
from autotp.analysis.propagation_result import NodeRole, ParamView
from autotp.analysis.shape_rules import drop_unit_dims
from autotp.analysis.shapes import norm_dim, schema_arg, shape_of
from autotp.analysis.value_rules import needs_whole_dim
from autotp.ir.errors import describe
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, ShardingConflict, shard, unify

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

aten = torch.ops.aten

SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.nansum.default}
MEANS = {aten.mean.dim, aten.mean.default}
VECTOR_NORMS = {aten.linalg_vector_norm.default}
WHOLE = {
    aten.prod.dim_int, aten.prod.default, aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim,
    aten.all.dims, aten.all.default, aten.count_nonzero.dim_IntList, aten.count_nonzero.default,
}  # fmt: skip
VARIANCES = {aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim}
VARIANCE_MEANS = {aten.var_mean.correction, aten.std_mean.correction}  # (var or std, mean)
REDUCTIONS = SUMS | MEANS | VECTOR_NORMS | VARIANCES | VARIANCE_MEANS | WHOLE
EXTREMA = {aten.amax.default: "max", aten.amin.default: "min", aten.max.default: "max", aten.min.default: "min", aten.max.dim: "max",
           aten.min.dim: "min"}  # fmt: skip
WITH_INDICES = {aten.max.dim, aten.min.dim}  # (values, indices)
PER_CHANNEL = {aten.fake_quantize_per_channel_affine.default, aten._fake_quantize_learnable_per_channel_affine.default}
PER_TENSOR = {aten.fake_quantize_per_tensor_affine.tensor_qparams, aten._fake_quantize_learnable_per_tensor_affine.default}
NORMS = {aten.layer_norm.default, aten.rms_norm.default}


def reduced_dims(node: Node, nd: int) -> list[int]:
    """The dims a reduction reduces (every dim when ``dim`` is None or empty)."""
    dims = schema_arg(node, "dim")
    if dims is None:
        return list(range(nd))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [norm_dim(d, nd) for d in dims] or list(range(nd))


def _statistic(w: Walker, node: Node, vars_: list[DimVar]) -> None:
    """A tp-reduced statistic over ``vars_`` at ``node``, if the walk allows it there."""
    for v in vars_:
        if v.find().padded:
            raise ShardingConflict(f"{describe(node)}: a statistic over a dim split with padding", v.find().origins, (v,))
    if not w.allow_statistic(node):
        origins = frozenset().union(*(v.find().origins for v in vars_))
        raise ShardingConflict(f"{describe(node)}: reduces over a sharded dim", origins, tuple(vars_), statistic=node.name)
    w.out.statistics.add(node.name)


def reduction(w: Walker, node: Node) -> Any:
    x = node.args[0]
    lay = w.concrete(x, node)
    target = node.target
    linear = target in SUMS or target in MEANS
    if lay.partial:
        if linear:
            return PARTIAL
        w.reduce_first(node, [x])
        lay = REPLICATE
    nd = len(shape_of(x) or ())
    reduced = reduced_dims(node, nd)
    keep = bool(schema_arg(node, "keepdim", False))
    kept = [d for d in range(nd) if d not in reduced]
    shape = shape_of(x) or ()
    drop_unit_dims(lay, node, [d for d in reduced if shape[d] == 1])
    sharded = [lay.var_at(d) for d in reduced if lay.var_at(d) is not None]
    pair = target in VARIANCE_MEANS
    if not sharded:
        out = lay if keep else shard({kept.index(d): v for d, v in lay.dims})
        return (out, out) if pair else out
    statistic = linear or target in VECTOR_NORMS or target in VARIANCES or pair
    if not statistic or len(sharded) != len(lay.dims):
        raise ShardingConflict(f"{describe(node)}: reduces over a sharded dim", lay.origins(), tuple(sharded))
    if target in SUMS:
        w.out.roles[node] = NodeRole.SHARDED_REDUCTION
        for d in reduced:
            if lay.var_at(d) is not None:
                record_mask(w.out, node, x, d, lay.var_at(d))
        return PARTIAL
    _statistic(w, node, sharded)  # type: ignore[arg-type]
    if target in MEANS:
        w.out.roles[node] = NodeRole.SHARDED_REDUCTION
        return PARTIAL
    if target in VARIANCES or pair:
        w.out.roles[node] = NodeRole.SHARDED_NORM
        return (REPLICATE, REPLICATE) if pair else REPLICATE
    order = schema_arg(node, "ord", 2)
    if not isinstance(order, (int, float)) or order <= 0 or math.isinf(order):
        raise ShardingConflict(f"{describe(node)}: a norm of order {order} over a sharded dim", lay.origins(), tuple(sharded))
    w.out.roles[node] = NodeRole.SHARDED_NORM
    return REPLICATE


def norm(w: Walker, node: Node) -> Any:
    """``layer_norm`` / ``rms_norm`` over the last ``len(normalized_shape)`` dims."""
    x = node.args[0]
    lay = w.summed(x, node)
    nd = len(shape_of(x) or ())
    first = nd - len(node.args[1])
    normed = [(d, v) for d, v in lay.dims if d >= first]
    weights = node.all_input_nodes[1:]
    if normed and node.target in NORMS:
        _statistic(w, node, [v for _, v in normed])
        w.out.roles[node] = NodeRole.SHARDED_NORM
        for a in weights:
            follow_split(w, node, a, {d - first: v for d, v in normed})
    elif normed:
        raise ShardingConflict(f"{describe(node)}: normalizes over a sharded dim", lay.origins(), tuple(v for _, v in normed))
    else:
        for a in weights:
            w.concrete(a, node)
            w.reduce_first(node, [a])
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return (lay,) + tuple(REPLICATE if not lay.dims else lay for _ in val[1:])
    return lay


def group_norm(w: Walker, node: Node) -> Any:
    """``group_norm(x [N, C, *], groups, weight, bias)``: each statistic is over one group of
    C/groups channels (and the spatial dims) of one sample. A split of C keeps every group
    on one rank when tp divides the groups (each rank holds C/tp contiguous channels, whole
    groups: RetNet's and Mamba's norm per head); the affine weight and bias take C's split.
    The batch dim may be split too; a spatial dim may not."""
    x = node.args[0]
    lay = w.summed(x, node)
    groups = int(node.args[1])
    var = lay.var_at(1)
    spatial = [v for d, v in lay.dims if d >= 2]
    weights = [a for a in node.args[2:4] if isinstance(a, Node)]
    if spatial:
        raise ShardingConflict(f"{describe(node)}: normalizes over a sharded dim", lay.origins(), tuple(spatial))
    if var is None:
        for a in weights:
            w.concrete(a, node)
            w.reduce_first(node, [a])
        return lay
    root = var.find()
    if groups % w.tp or root.padded or root.segments is not None:
        raise ShardingConflict(f"{describe(node)}: {groups} groups do not stay whole on tp={w.tp} ranks", lay.origins(), (var,))
    for a in weights:
        follow_split(w, node, a, {0: var})
    return lay


def instance_norm(w: Walker, node: Node) -> Any:
    """``instance_norm(x [N, C, *], weight, bias, running_mean, running_var, ...)``: each statistic is
    over the spatial dims of one channel of one sample, so a split of N or C stays and the
    per-channel vectors take C's split; a spatial dim may not be split."""
    x = node.args[0]
    lay = w.summed(x, node)
    spatial = [v for d, v in lay.dims if d >= 2]
    if spatial:
        raise ShardingConflict(f"{describe(node)}: normalizes over a sharded dim", lay.origins(), tuple(spatial))
    _per_channel(w, node, node.args[1:5], lay.var_at(1))
    return lay


def _per_channel(w: Walker, node: Node, vectors: Any, var: DimVar | None) -> None:
    """The per-channel vectors of a norm (weight, bias, running statistics) take the channels' split ``var``, or are read whole."""
    for a in vectors:
        if not isinstance(a, Node):
            continue
        if var is None:
            w.concrete(a, node)
            w.reduce_first(node, [a])
        else:
            follow_split(w, node, a, {0: var})


def batch_statistics(node: Node) -> bool:
    """Whether ``node`` is a training-mode ``batch_norm``: statistics of its input over every
    dim but the channels, which its rule leaves to the fallback (of a weight alone, the trace
    decomposes it: ``trace_decompose``)."""
    return node.target is aten.batch_norm.default and bool(schema_arg(node, "training", True))


def batch_norm(w: Walker, node: Node) -> Any:
    """``batch_norm(x [N, C, *], weight, bias, running_mean, running_var, training, ...)``
    in eval mode: a per-channel affine map from the running statistics, so any split
    stays, and the four per-channel vectors take C's split. Training mode (statistics of
    the batch) is left to the fallback."""
    x = node.args[0]
    lay = w.summed(x, node)
    if batch_statistics(node):
        return w.opaque(node)
    _per_channel(w, node, node.args[1:5], lay.var_at(1))
    return lay


def follow_split(w: Walker, node: Node, weight: Node, dims: dict[int, DimVar]) -> None:
    """A per-channel operand (a norm's weight or bias, a quantizer's scales: shaped like the
    dims it scales) takes their split."""
    lay = w.get(weight)
    if isinstance(lay, ParamView):
        if len(dims) > 1:
            raise ShardingConflict(f"{describe(node)}: {lay.name} meets two sharded dims", next(iter(dims.values())).find().origins)
        ((d, var),) = dims.items()
        w.param_view_shard(lay, d, var, "bias", node)
        return
    w.reduce_first(node, [weight])
    if lay.partial:
        lay = REPLICATE
    for d, var in dims.items():
        if lay.var_at(d) is not None:
            unify(lay.var_at(d), var, describe(node))
        elif lay.replicated:
            w.out.local_slices.setdefault(node, []).append((weight, d, var))
        else:
            raise ShardingConflict(f"{describe(node)}: the norm weight is split differently", lay.origins() | var.find().origins)


def extremum(w: Walker, node: Node) -> Any:
    """``amax`` / ``amin`` / ``max()`` / ``min()``, ``max(dim)`` / ``min(dim)`` whose indices are not
    read: the split of every dim it keeps; over a sharded dim, a tp-reduced statistic where the
    value's gradient reaches no loss."""
    if node.target in WITH_INDICES:
        if indices_read(node):  # a rank's index would be local, and its maximum not the whole one
            return needs_whole_dim(w, node)
        values = extremum_values(w, node)
        return values, values
    return extremum_values(w, node)


def indices_read(node: Node) -> bool:
    """Whether anything reads the indices output of ``max(dim)`` / ``min(dim)``."""
    return any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users)


def extremum_values(w: Walker, node: Node) -> Any:
    x = node.args[0]
    lay = w.summed(x, node)
    nd = len(shape_of(x) or ())
    reduced = reduced_dims(node, nd)
    shape = shape_of(x) or ()
    drop_unit_dims(lay, node, [d for d in reduced if shape[d] == 1])
    sharded = [lay.var_at(d) for d in reduced if lay.var_at(d) is not None]
    if not sharded:
        kept = [d for d in range(nd) if d not in reduced]
        return lay if schema_arg(node, "keepdim", False) else shard({kept.index(d): v for d, v in lay.dims})
    if w.grad_reaches_loss(node) or len(sharded) != len(lay.dims):
        raise ShardingConflict(f"{describe(node)}: needs a sharded dim whole", lay.origins(), tuple(sharded))
    _statistic(w, node, sharded)  # type: ignore[arg-type]
    w.out.roles[node] = NodeRole.SHARDED_EXTREMUM
    return REPLICATE


def per_channel(w: Walker, node: Node) -> Any:
    """``fake_quantize_per_channel_affine(x, scale, zero_point, axis, ...)``: elementwise in x,
    with ``scale`` and ``zero_point`` along ``axis``, which take that dim's split."""
    x = node.args[0]
    lay = w.summed(x, node)
    var = lay.var_at(norm_dim(schema_arg(node, "axis"), len(shape_of(x) or ())))
    for a in node.args[1:3]:
        if var is not None:
            follow_split(w, node, a, {0: var})
            continue
        w.reduce_first(node, [a])
        split = w.concrete(a, node)
        if split.dims:
            raise ShardingConflict(f"{describe(node)}: per-channel parameters split where the channels are whole", split.origins())
    return lay


def per_tensor(w: Walker, node: Node) -> Any:
    """``fake_quantize_per_tensor_affine(x, scale, zero_point, ...)``: elementwise in x with one
    scale for the whole tensor, which every rank holds whole."""
    for a in node.args[1:3]:
        w.concrete(a, node)
        w.reduce_first(node, [a])
    return w.summed(node.args[0], node)
