"""Compute reductions and norms over a sharded dim from tp-reduced statistics
(``NodeRole.SHARDED_REDUCTION`` / ``SHARDED_NORM``, ``autotp.analysis.statistic_rules``),
and contractions over a dim held in replicated blocks.

* A ``sum`` or ``mean`` over a sharded dim is partial: each rank reduces its part. A mean
  is scaled by local count / whole count, and a block that k ranks hold counts 1/k (a
  fused dim whose segments are held by different numbers of ranks is scaled segment by
  segment: ``_summand``).
* ``layer_norm`` / ``rms_norm`` become their formula around partial statistics (in fp32, fp64 for fp64):
  ``mean = sum(x)/n``, ``var = sum((x - mean)^2)/n`` (layer norm) or ``ms = sum(x^2)/n``
  (RMS norm), then ``x_hat * rsqrt(stat + eps) * weight (+ bias)``.
* ``linalg_vector_norm(x, p)`` becomes ``sum(|x|^p) ** (1/p)``.
* ``var`` / ``std`` become ``sum((x - mean)^2) / (n - correction)`` (``sqrt`` of it), the mean
  and the sum partial; ``var_mean`` / ``std_mean`` hand on that mean too.
* ``amax`` / ``amin`` (the values of ``max(dim)`` / ``min(dim)``) of a value whose gradient
  reaches no loss: the rank's extremum, then
  ``autotp::all_reduce_max`` over the group (of the negated minimum for ``amin``).
* A row-parallel matmul, convolution or einsum that contracts a dim ranks hold in replicated
  blocks (query heads of a KV group shared by two ranks, 2 channels at tp=4) would add each
  block ``replicas`` times: its sharded operand is scaled by 1/replicas (backward, each replica then computes its share
  of the grad of the blocks, which the replica group sums); with a bias too, which
  ``insert_collectives`` adds after the all-reduce.

The new nodes carry layouts: the statistics are partial and their consumers list them in
``REDUCE_INPUTS``, so ``insert_collectives`` all-reduces each statistic once forward
(and, through the f it puts where the replicated statistic meets the sharded values,
sums its gradient backward). The original node becomes the last op of its formula, so
its users and metadata stay. Runs after ``slice_replicated`` (a replicated norm weight is
already read through the rank's slice) and before ``insert_collectives``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autotp.ir.op_facts import CONVOLUTIONS, is_matmul
from autotp.analysis.contraction_rules import einsum_terms
from autotp.analysis.propagation_result import NodeRole
from autotp.analysis.shapes import schema_arg, shape_of
from autotp.analysis.statistic_rules import EXTREMA, VARIANCE_MEANS, VARIANCES, WITH_INDICES, reduced_dims
from autotp.ir import meta_keys, ops
from autotp.ir.layouts import PARTIAL, REPLICATE, Layout, resolve
from autotp.passes.runner import PassContext

aten = torch.ops.aten


def sharded_statistics(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if ctx.plan.tp == 1:
        return gm
    for node in list(gm.graph.nodes):
        role = node.meta.get(meta_keys.ROLE)
        if role is NodeRole.SHARDED_REDUCTION:
            _rescale(gm, node, ctx.plan.tp)
        elif role is NodeRole.SHARDED_NORM and node.target is aten.linalg_vector_norm.default:
            _vector_norm(gm, node, ctx.plan.tp)
        elif role is NodeRole.SHARDED_NORM and node.target in VARIANCES | VARIANCE_MEANS:
            _variance(gm, node, ctx.plan.tp)
        elif role is NodeRole.SHARDED_NORM:
            _norm(gm, node, ctx.plan.tp)
        elif role is NodeRole.SHARDED_EXTREMUM:
            _extremum(gm, node, ctx.group)
        elif node.meta.get(meta_keys.LAYOUT) == PARTIAL or role is NodeRole.ROW_WITH_BIAS:
            _contraction(gm, node, ctx.plan.tp)  # with a bias, insert_collectives adds it after the all-reduce
    return gm


def _contracted(node: Node) -> tuple[Any, list[int]]:
    """(an operand, its dims a contraction of ``node`` sums over); (None, []) for other ops. Scaling
    that one operand scales the product: every operand holding a contracted dim holds it split alike."""
    if is_matmul(node):
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        return x, [x.meta["val"].dim() - 1] if isinstance(x, Node) else []
    if node.target in CONVOLUTIONS:  # input channels, transposed or not
        return node.args[0], [1]
    if node.target is aten.einsum.default and (parsed := einsum_terms(node)) is not None:
        terms, out = parsed
        for x, term in zip(node.args[1], terms):
            lay = x.meta.get(meta_keys.LAYOUT) if isinstance(x, Node) else None
            dims = [d for d, c in enumerate(term) if c not in out and isinstance(lay, Layout) and lay.var_at(d) is not None]
            if dims:
                return x, dims
    return None, []


def _contraction(gm: GraphModule, node: Node, tp: int) -> None:
    """A partial sum over a dim ranks hold in replicated blocks counts each block once."""
    x, dims = _contracted(node)
    if not isinstance(x, Node) or not isinstance(x.meta.get(meta_keys.LAYOUT), Layout):
        return
    with gm.graph.inserting_before(node):
        scaled = _summand(gm, node, x, dims, tp, mean=False)
    node.replace_input_with(x, scaled)


def _replicas(x: Node, d: int, tp: int) -> list[tuple[int, int, int]] | None:
    """(size, local length, replicas) of each segment along dim ``d`` of ``x``; None if unsplit."""
    lay = x.meta.get(meta_keys.LAYOUT)
    var = lay.var_at(d) if isinstance(lay, Layout) else None
    if var is None:
        return None
    sharding = resolve(var, tp)
    if sharding.padded:
        return [(sharding.size, sharding.local_size(tp), 1)]
    return [(seg, seg // g * max(g // tp, 1), max(tp // g, 1)) for seg, g in zip(sharding.segments, sharding.groups)]


def _summand(gm: GraphModule, like: Node, x: Node, dims: list[int], tp: int, mean: bool, factor: float = 1.0) -> Node:
    """``x`` scaled so that summing (or, with ``mean``, averaging) it over ``dims`` on every
    rank and adding the ranks' results gives the whole sum (or mean) times ``factor``:
    each block held by k ranks counts 1/k, a mean divides by the whole count."""
    lay, shape = x.meta.get(meta_keys.LAYOUT), shape_of(x) or ()
    for d in dims:
        pieces = _replicas(x, d, tp)
        if pieces is None:
            continue
        if mean:
            factor *= sum(n for _, n, _ in pieces) / shape[d]
        if len({k for _, _, k in pieces}) == 1:
            factor /= pieces[0][2]
            continue
        # segments held by different numbers of ranks (query heads split, one KV head on all)
        split = _emit(gm, like, aten.split_with_sizes.default, (x, [size for size, _, _ in pieces], d), None)
        split.args = (x, [n for _, n, _ in pieces], d)  # the value is traced whole, the rank splits its part
        parts = [_emit(gm, like, operator.getitem, (split, i), None) for i in range(len(pieces))]
        weighted = [_emit(gm, like, aten.mul.Tensor, (p, 1.0 / k), None) if k > 1 else p for p, (_, _, k) in zip(parts, pieces)]
        x = _emit(gm, like, aten.cat.default, (weighted, d), lay)
    return x if factor == 1.0 else _emit(gm, like, aten.mul.Tensor, (x, factor), lay)


def _emit(gm: GraphModule, like: Node, target: Any, args: tuple, layout: Any, reduce: list[Node] = (), **kwargs: Any) -> Node:
    """A new node (at the graph's insert point) with its traced value and ``layout``."""
    new = gm.graph.call_function(target, args, kwargs)
    vals = torch.utils._pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, args)
    new.meta["val"] = target(*vals, **kwargs)
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta[meta_keys.LAYOUT] = layout
    new.meta[meta_keys.NEEDS_GRAD] = like.meta.get(meta_keys.NEEDS_GRAD, False)
    if reduce:
        new.meta[meta_keys.REDUCE_INPUTS] = list(reduce)
    return new


def _retarget(node: Node, target: Any, args: tuple) -> None:
    """Make ``node`` the last op of its formula; its users and metadata stay."""
    node.target, node.args, node.kwargs = target, args, {}
    node.meta.pop(meta_keys.ROLE, None)


def _rescale(gm: GraphModule, node: Node, tp: int) -> None:
    x = node.args[0]
    dims = reduced_dims(node, len(shape_of(x) or ()))
    with gm.graph.inserting_before(node):
        scaled = _summand(gm, node, x, dims, tp, node.target in (aten.mean.dim, aten.mean.default))
    node.replace_input_with(x, scaled)


def _partial_sum(gm: GraphModule, like: Node, x: Node, dims: list[int], tp: int, count: int) -> Node:
    """A rank's summand of ``sum(x, dims) / count``."""
    return _emit(gm, like, aten.sum.dim_IntList, (_summand(gm, like, x, dims, tp, False, 1.0 / count), dims, True), PARTIAL)


def _norm(gm: GraphModule, node: Node, tp: int) -> None:
    """``layer_norm(x, shape, w, b, eps)`` / ``rms_norm(x, shape, w, eps)``."""
    x = node.args[0]
    nd = len(shape_of(x) or ())
    dims = list(range(nd - len(node.args[1]), nd))
    count = math.prod((shape_of(x) or ())[d] for d in dims)
    lay = x.meta.get(meta_keys.LAYOUT)
    layer = node.target is aten.layer_norm.default
    weight, bias = schema_arg(node, "weight"), schema_arg(node, "bias") if layer else None
    eps = schema_arg(node, "eps")
    dtype = x.meta["val"].dtype
    if eps is None:
        eps = torch.finfo(dtype).eps
    reduce = list(node.meta.get(meta_keys.REDUCE_INPUTS, []))  # a partial weight or bias
    wide = torch.promote_types(dtype, torch.float32)  # the statistics in float32, or float64 for a float64 model
    with gm.graph.inserting_before(node):
        xf = x if dtype == wide else _emit(gm, node, aten._to_copy.default, (x,), lay, dtype=wide)
        if layer:
            mean = _partial_sum(gm, node, xf, dims, tp, count)
            xf = _emit(gm, node, aten.sub.Tensor, (xf, mean), lay, [mean])
        square = _emit(gm, node, aten.mul.Tensor, (xf, xf), lay)
        stat = _partial_sum(gm, node, square, dims, tp, count)
        shifted = _emit(gm, node, aten.add.Tensor, (stat, eps), REPLICATE, [stat])
        out = _emit(gm, node, aten.mul.Tensor, (xf, _emit(gm, node, aten.rsqrt.default, (shifted,), REPLICATE)), lay)
        if dtype != wide:
            out = _emit(gm, node, aten._to_copy.default, (out,), lay, dtype=dtype)
        if isinstance(weight, Node) and isinstance(bias, Node):
            out = _emit(gm, node, aten.mul.Tensor, (out, weight), lay, reduce)
    if isinstance(bias, Node):
        _retarget(node, aten.add.Tensor, (out, bias))
    elif isinstance(weight, Node):
        _retarget(node, aten.mul.Tensor, (out, weight))
    else:
        _retarget(node, aten.alias.default, (out,))


def _vector_norm(gm: GraphModule, node: Node, tp: int) -> None:
    """``linalg_vector_norm(x, p, dim, keepdim, dtype)`` = ``sum(|x|^p, dim) ** (1/p)``."""
    x = node.args[0]
    order = float(schema_arg(node, "ord", 2))
    dims = reduced_dims(node, len(shape_of(x) or ()))
    keep = bool(schema_arg(node, "keepdim", False))
    dtype = schema_arg(node, "dtype")
    lay = x.meta.get(meta_keys.LAYOUT)
    with gm.graph.inserting_before(node):
        source = x if dtype is None else _emit(gm, node, aten._to_copy.default, (x,), lay, dtype=dtype)
        powered = _emit(gm, node, aten.mul.Tensor, (source, source), lay) if order == 2 else _emit(
            gm, node, aten.pow.Tensor_Scalar, (_emit(gm, node, aten.abs.default, (source,), lay), order), lay
        )
        total = _emit(gm, node, aten.sum.dim_IntList, (_summand(gm, node, powered, dims, tp, False), dims, keep), PARTIAL)
    _retarget(node, aten.pow.Tensor_Scalar, (total, 1.0 / order))
    node.meta[meta_keys.REDUCE_INPUTS] = [total]


def _variance(gm: GraphModule, node: Node, tp: int) -> None:
    """``var`` / ``std`` (``var_mean`` / ``std_mean``) over every sharded dim of ``x``."""
    x = node.args[0]
    shape = shape_of(x) or ()
    dims = reduced_dims(node, len(shape))
    keep = bool(schema_arg(node, "keepdim", False))
    count = math.prod(shape[d] for d in dims)
    if node.target in (aten.var.dim, aten.std.dim):
        correction = 1 if schema_arg(node, "unbiased", True) else 0
    else:
        found = schema_arg(node, "correction")
        correction = 1 if found is None else found
    root = node.target in (aten.std.dim, aten.std.correction, aten.std_mean.correction)
    lay = x.meta.get(meta_keys.LAYOUT)
    with gm.graph.inserting_before(node):
        whole = _emit(gm, node, aten.alias.default, (_partial_sum(gm, node, x, dims, tp, count),), REPLICATE)
        whole.meta[meta_keys.REDUCE_INPUTS] = [whole.args[0]]  # the mean, all-reduced once for both its readers
        centered = _emit(gm, node, aten.sub.Tensor, (x, whole), lay)
        square = _emit(gm, node, aten.mul.Tensor, (centered, centered), lay)
        total = _emit(gm, node, aten.sum.dim_IntList, (_summand(gm, node, square, dims, tp, False), dims, keep), PARTIAL)
        if not root and node.target in VARIANCES:
            _retarget(node, aten.div.Tensor, (total, count - correction))
            node.meta[meta_keys.REDUCE_INPUTS] = [total]
            return
        spread = _emit(gm, node, aten.div.Tensor, (total, count - correction), REPLICATE, [total])
        if node.target in VARIANCES:
            _retarget(node, aten.sqrt.default, (spread,))
            return
        if root:
            spread = _emit(gm, node, aten.sqrt.default, (spread,), REPLICATE)
        whole_mean = whole if keep else _emit(gm, node, aten.squeeze.dims, (whole, dims), REPLICATE)
    for user in list(node.users):  # getitem 0 (var or std) and 1 (mean)
        user.replace_all_uses_with(spread if user.args[1] == 0 else whole_mean)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _extremum(gm: GraphModule, node: Node, group: str) -> None:
    """The rank's ``amax`` / ``amin``, max-reduced over ``group`` for every user (of ``max(dim)`` /
    ``min(dim)``: of its values, the only output read)."""
    node.meta.pop(meta_keys.ROLE, None)
    kind = EXTREMA[node.target]
    for value in [u for u in node.users if u.target is operator.getitem] if node.target in WITH_INDICES else [node]:
        _max_reduced(gm, value, kind, group)


def _max_reduced(gm: GraphModule, node: Node, kind: str, group: str) -> None:
    users = list(node.users)
    with gm.graph.inserting_after(node):
        if kind == "max":
            whole = _emit(gm, node, ops.ALL_REDUCE_MAX, (node, group), REPLICATE)
        else:
            negated = _emit(gm, node, aten.neg.default, (node,), REPLICATE)
            with gm.graph.inserting_after(negated):
                reduced = _emit(gm, node, ops.ALL_REDUCE_MAX, (negated, group), REPLICATE)
            with gm.graph.inserting_after(reduced):
                whole = _emit(gm, node, aten.neg.default, (reduced,), REPLICATE)
    for user in users:
        user.replace_input_with(node, whole)
