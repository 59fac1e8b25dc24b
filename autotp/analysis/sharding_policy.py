"""Which use of a parameter makes it column-, row- or vocab-parallel.

* ``matmul``: a weight met by a replicated activation becomes column-parallel (a fresh
  ``DimVar`` on its out features); met by an activation sharded on the contracted dim
  it becomes row-parallel, and the output is partial. A bias follows its weight's out
  features, or, under a row-parallel matmul, stays replicated and is added after the
  all-reduce (``NodeRole.ROW_WITH_BIAS``). Expert weights (``grouped_mm``) take the
  ``expert_column``/``expert_row`` kinds. A weight on the left (``W @ x``) is row-parallel
  over its last dim or column-parallel over its rows, as the activation on its right asks.
* ``embedding``, and a parameter's rows read by an integer index (``row_lookup``): a 2-D
  table becomes vocab-parallel (padded rows allowed); the lookup is partial
  (``NodeRole.VOCAB_EMBEDDING``).
* convolutions: ``convolution_rules``.
* ``cross_entropy``: logits sharded on the classes give a vocab-parallel loss
  (``NodeRole.VOCAB_CROSS_ENTROPY``).

``policy`` (``Walker.allowed``) may forbid the column and vocab kinds; the row kind
follows from an already sharded activation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.padded_dims import record_mask
from autotp.analysis.propagation_result import NodeRole, ParamDecision, ParamView
from autotp.analysis.shapes import shape_of, sources
from autotp.ir.errors import describe
from autotp.ir.op_facts import is_pointwise
from autotp.ir.axes import Axis
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, Layout, ShardingConflict, shard, unify

aten = torch.ops.aten
_SAME_DIMS = (aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype, aten.lift_fresh_copy.default)

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker


def matmul(w: Walker, node: Node, a: Node, b: Any, b_t: bool, bias: Any, b_batch_free: bool = False) -> Layout:
    """``a @ op(b) (+ bias)``: ``b_t`` means b is stored [N, K] (``aten.linear``).

    ``b_batch_free``: b has leading dims that a does not (MoE experts).
    """
    la = w.get(a)
    if isinstance(la, ParamView):
        if not b_t and not b_batch_free:
            _left_weight(w, node, la, a, b)
        la = w.concrete(a, node)
    if la == PARTIAL:
        w.reduce_first(node, [a])
        la = REPLICATE
    a_shape = shape_of(a)
    b_shape = shape_of(b) if isinstance(b, Node) else None
    if a_shape is None or b_shape is None:
        return w.opaque(node)
    a_nd, b_nd = len(a_shape), len(b_shape)
    b_k, b_n = (b_nd - 1, b_nd - 2) if b_t else (b_nd - 2, b_nd - 1)
    if b_nd == 1:
        return w.opaque(node)
    ak = la.var_at(a_nd - 1)
    lb = w.get(b)
    kind_col = "expert_column" if b_batch_free else "column"
    kind_row = "expert_row" if b_batch_free else "row"
    grouped = isinstance(lb, ParamView) and ak is None and not b_batch_free and w.allowed(lb.name, "column")
    batch_split = _batch_split(la, lb, a_shape, b_shape, (b_k, b_n)) if grouped else None
    if w.plan is None and not b_batch_free and isinstance(lb, Layout) and lb.replicated and isinstance(b, Node):
        hint_reparametrized(w, b, (b_k, kind_row) if ak is not None else (b_n, kind_col))
    if isinstance(lb, ParamView):
        if batch_split is not None:  # grouped weights met by groups split in the activation
            w.param_view_shard(lb, batch_split[0], batch_split[1], kind_col, node)
        elif ak is not None:
            w.param_view_shard(lb, b_k, ak, kind_row, node)
        elif w.allowed(lb.name, "column"):
            if any(v.find().axis == Axis.TP for _, v in la.dims):
                # an activation split on a dim the matmul keeps (Informer's heads viewed into its time steps) meets the
                # whole weight: its out features split too would leave each rank one block of a two-way split output.
                # The planner weighs gathering the activation here against keeping the split's origins whole.
                raise ShardingConflict(f"{describe(node)}: its input is split on a dim the matmul keeps", la.origins())
            var = DimVar(b_shape[b_n], frozenset({lb.name}))
            w.param_view_shard(lb, b_n, var, kind_col, node)
        else:
            w.decide(lb.name, ParamDecision("replicate"), node)
        lb = w.get(b)
    if lb == PARTIAL:
        w.reduce_first(node, [b])
        lb = REPLICATE
    assert isinstance(lb, Layout)
    bk, bn = lb.var_at(b_k), lb.var_at(b_n)
    out_nd = len(shape_of(node) or ())
    if (ak is None) != (bk is None):
        # the side split on the contracted dim goes whole; the other keeps its own split
        # (a tied vocab-parallel head behind a column-parallel transform)
        split_side = (la if ak is not None else lb).origins()
        raise ShardingConflict(
            f"{describe(node)}: only one side of the contraction is sharded", split_side or (la.origins() | lb.origins())
        )
    dims: dict[int, DimVar] = {}
    for d, v in la.dims:
        if d != a_nd - 1:
            dims[d + out_nd - a_nd] = v
    if not b_batch_free:
        for d, v in lb.dims:
            if d not in (b_k, b_n):
                od = d + out_nd - b_nd
                dims[od] = unify(dims[od], v, describe(node)) if od in dims else v
    elif any(d not in (b_k, b_n) for d, _ in lb.dims):
        raise ShardingConflict(f"{describe(node)}: expert dim cannot be sharded here", lb.origins())
    if not b_batch_free:
        batch = [(a, la, a_nd, {a_nd - 1}), (b, lb, b_nd, {b_k, b_n})]
        _slice_replicated_batch(w, node, dims, out_nd, batch)
    if bn is not None:
        if any(v.find().axis == bn.find().axis for v in dims.values()):
            raise ShardingConflict(f"{describe(node)}: the output would be split on its out features and on another dim", lb.origins())
        dims[out_nd - 1] = bn
    if ak is not None:
        unify(ak, bk, describe(node))
        record_mask(w.out, node, a, a_nd - 1, ak)
        if dims:
            raise ShardingConflict(f"{describe(node)}: contraction and output both sharded", la.origins())
        out: Layout = PARTIAL
    else:
        out = shard(dims)
    if bias is not None and isinstance(bias, Node):
        if out == PARTIAL:
            w.concrete(bias, node)
            if w.get(bias) != REPLICATE:
                raise ShardingConflict(f"{describe(node)}: bias of a row-parallel matmul is sharded", lb.origins())
            w.out.roles[node] = NodeRole.ROW_WITH_BIAS
            return REPLICATE
        output_bias(w, node, bias, bn)
    return out


def _left_weight(w: Walker, node: Node, la: ParamView, a: Node, b: Any) -> None:
    """``W @ x`` with the weight on the left (Zamba's per-head ``x_proj_weight[:, None] @ x``):
    row-parallel over its last dim where x is split on the contracted dim, column-parallel
    over its rows (the output's rows) where x is whole. Otherwise it stays undecided."""
    lb, a_shape, b_shape = w.get(b), shape_of(a) or (), shape_of(b) or ()
    if not isinstance(lb, Layout) or len(a_shape) < 2 or len(b_shape) < 2:
        return
    bk, rows, cols = lb.var_at(len(b_shape) - 2), la.dim_map[-2], la.dim_map[-1]
    if bk is not None and cols is not None and bk.find().size == a_shape[-1]:
        w.param_view_shard(la, len(a_shape) - 1, bk, "row", node)
    elif (lb.partial or lb.replicated) and rows is not None and w.allowed(la.name, "column"):
        w.param_view_shard(la, len(a_shape) - 2, DimVar(a_shape[-2], frozenset({la.name})), "column", node)


def hint_reparametrized(w: Walker, weight: Node, split: tuple[int, str]) -> None:
    """A replicated tensor computed from parameters (weight norm's ``v * g / ‖v‖``, Mamba's
    ``-exp(A_log)``, a fast weight: a parameter plus a delta made from the activations, a KAN
    layer's ``(spline_weight * scaler[..., None]).view(out, -1)``) that meets a split: hint
    the parameters behind that dim (``params_behind``) and those of the tensor's own shape, read
    whole by their first use, to be split as that op asks (``Propagation.hints``: a matmul's
    weight, or a per-head vector read through the rank's slice); the planner walks again with
    them. Only the first such op of a walk hints: later splits depend on it."""
    if w.out.hints:
        return
    dim, kind = split
    behind = params_behind(weight, dim, w.params)
    shape = shape_of(weight)
    for name in (str(n.target) for n in sources(weight)):  # of the weight's shape, through any op (a fake quantizer)
        if name in w.params and tuple(w.params[name].shape) == shape:
            behind.setdefault(name, dim)
    numel = math.prod(shape or ())
    for name, param_dim in behind.items():
        dec = w.out.decisions.get(name)
        if dec is not None and dec.dim is None:  # a parameter broadcast into the weight scales it, as a bias would
            w.out.hints.setdefault(name, (kind if w.params[name].numel() == numel else "bias", param_dim))


def params_behind(node: Node, dim: int, params: dict[str, Any]) -> dict[str, int]:
    """The parameters whose dim becomes ``dim`` of ``node`` through casts, views that keep it
    the outermost factor of its dim, transposes, broadcasts and pointwise ops: parameter ->
    its dim. A path through any other op ends there."""
    found: dict[str, int] = {}
    stack, seen = [(node, dim)], set()
    while stack:
        n, d = stack.pop()
        if (n, d) in seen:
            continue
        seen.add((n, d))
        if n.op == "get_attr" and str(n.target) in params:
            if params[str(n.target)].dim() > d:
                found.setdefault(str(n.target), d)
            continue
        if n.op == "call_function":
            stack.extend(_dim_sources(n, d))
    return found


_MATMULS = frozenset({aten.mm.default, aten.bmm.default, aten.matmul.default})


def _dim_sources(n: Node, d: int) -> list[tuple[Node, int]]:
    """The inputs of ``n`` and their dims that make dim ``d`` of its output (``params_behind``)."""
    out = shape_of(n)
    args = n.args
    if out is None or not args or not isinstance(args[0], Node):
        return []
    src = shape_of(args[0]) or ()
    target = n.target
    if target in _SAME_DIMS:
        return [(args[0], d)]
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        back = _outer_factor(src, out, d)
        return [] if back is None else [(args[0], back)]
    if target is aten.unsqueeze.default:
        at = args[1] % len(out)
        return [] if d == at else [(args[0], d - (d > at))]
    if target is aten.expand.default:
        back = d - (len(out) - len(src))
        return [(args[0], back)] if back >= 0 and src[back] == out[d] else []
    if target is aten.t.default:
        return [(args[0], 1 - d)] if len(out) == 2 else [(args[0], d)]
    if target is aten.transpose.int:
        a, b = (x % len(out) for x in args[1:3])
        return [(args[0], b if d == a else a if d == b else d)]
    if target is aten.permute.default:
        return [(args[0], list(args[1])[d] % len(out))]
    if is_pointwise(target):
        found = []
        for a in n.all_input_nodes:
            shp = shape_of(a) or ()
            back = d - (len(out) - len(shp))
            if back >= 0 and shp[back] == out[d]:
                found.append((a, back))
        return found
    if target in _MATMULS and len(args) > 1 and isinstance(args[1], Node) and len(src) >= 2 and len(shape_of(args[1]) or ()) >= 2:
        if d == len(out) - 2:  # the left operand's rows
            return [(args[0], len(src) - 2)]
        if d == len(out) - 1:  # the right operand's columns
            return [(args[1], len(shape_of(args[1])) - 1)]
    return []


def _outer_factor(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> int | None:
    """The dim of ``src`` that a view to ``dst`` keeps as the outermost factor of its dim
    ``d`` (dims merged or cut apart), or None when ``d`` is not the outermost of its group."""
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, a, b = i, j, src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                a *= src[i]
            else:
                j += 1
                b *= dst[j]
        if gj <= d <= j:
            outer_src = next((k for k in range(gi, i + 1) if src[k] != 1), None)
            outer_dst = next((k for k in range(gj, j + 1) if dst[k] != 1), None)
            return outer_src if d == outer_dst else None
        i, j = i + 1, j + 1
    return None


def _batch_split(la: Layout, lb: ParamView, a_shape: tuple[int, ...], b_shape: tuple[int, ...], own: tuple[int, int]) -> tuple[int, DimVar] | None:
    """A batch dim the activation splits where the undecided weight has a parameter dim of
    its own, of the same size: that dim of the weight and its split."""
    for d, var in la.dims:
        bd = d - len(a_shape) + len(b_shape)
        if d != len(a_shape) - 1 and 0 <= bd < len(b_shape) and bd not in own and lb.dim_map[bd] is not None and a_shape[d] == b_shape[bd]:
            return bd, var
    return None


def output_bias(w: Walker, node: Node, bias: Node, out_var: DimVar | None) -> None:
    """A bias over the output features (their split ``out_var``, None when whole): a parameter
    takes that split on its last dim or stays whole; another tensor follows (``_bias_follows``)."""
    lay = w.get(bias)
    if isinstance(lay, ParamView) and out_var is not None:
        w.param_view_shard(lay, len(lay.dim_map) - 1, out_var, "bias", node)
    elif isinstance(lay, ParamView):
        w.concrete(bias, node)
    else:
        _bias_follows(w, node, bias, out_var)


def _bias_follows(w: Walker, node: Node, bias: Node, out_var: DimVar | None) -> None:
    """A bias tensor (not a parameter read directly) meets the output features: sharded
    alike, or replicated and read through the rank's slice (BEiT's ``cat(q_bias, 0, v_bias)``)."""
    lay = w.get(bias)
    assert isinstance(lay, Layout)
    if lay.partial:
        w.reduce_first(node, [bias])
        lay = REPLICATE
    last = len(shape_of(bias) or ()) - 1
    var = lay.var_at(last)
    if out_var is not None and var is not None:
        unify(var, out_var, describe(node))
    elif out_var is not None and lay.replicated:
        w.out.local_slices.setdefault(node, []).append((bias, last, out_var))
    elif lay.dims:
        raise ShardingConflict(f"{describe(node)}: the bias is split where the output is not", lay.origins(), tuple(v for _, v in lay.dims))


def _slice_replicated_batch(
    w: Walker, node: Node, dims: dict[int, DimVar], out_nd: int, operands: list[tuple[Any, Layout, int, set[int]]]
) -> None:
    """A batch dim sharded in one operand of a matmul (heads of the values) and whole in
    the other (replicated attention probabilities): the whole one is read through its
    rank-local slice, as ``values.pointwise`` does for a broadcast operand."""
    for od, var in dims.items():
        for t, lay, nd, own in operands:
            d = od - (out_nd - nd)
            shape = shape_of(t) or ()
            if d < 0 or d in own or shape[d] == 1 or lay.var_at(d) is not None:
                continue
            if not lay.replicated or var.find().padded:
                raise ShardingConflict(f"{describe(node)}: a batch dim is sharded in one operand only", var.find().origins)
            w.out.local_slices.setdefault(node, []).append((t, d, var))


def grouped_matmul(w: Walker, node: Node) -> Layout:
    """``aten._grouped_mm`` and its fallbacks: tokens [T, K] against expert weights [E, K, N]."""
    a, b = node.args[0], node.args[1]
    return matmul(w, node, a, b, b_t=False, bias=None, b_batch_free=True)


def embedding(w: Walker, node: Node) -> Layout:
    return row_lookup(w, node, node.args[0], node.args[1])


def row_lookup(w: Walker, node: Node, weight: Node, ids: Any) -> Layout:
    """``weight[ids]``: rows of a 2-D table picked by an integer tensor (``embedding``, and
    ``index``/``index_select`` of a parameter's rows: position tables, bias buckets). An
    undecided table becomes vocab-parallel; each rank looks up the rows it holds, zero
    elsewhere, and the output is partial."""
    if not w.concrete(ids, node).replicated:
        raise ShardingConflict(f"{describe(node)}: sharded embedding indices", w.get(ids).origins())
    lw = w.get(weight)
    if isinstance(lw, ParamView):
        shape = tuple(w.params[lw.name].shape)
        if lw.dim_map == (0, 1) and w.allowed(lw.name, "vocab"):
            var = DimVar(shape[0], frozenset({lw.name}), padded=True)
            w.decide(lw.name, ParamDecision("vocab", 0, var), node)
        else:
            w.decide(lw.name, ParamDecision("replicate"), node)
        lw = w.get(weight)
    assert isinstance(lw, Layout)
    if lw.replicated:
        return REPLICATE
    if lw.partial or lw.var_at(0) is None:
        w.reduce_first(node, [weight])
        if lw.dims:
            raise ShardingConflict(f"{describe(node)}: embedding table sharded on its features", lw.origins())
        return REPLICATE
    w.out.roles[node] = NodeRole.VOCAB_EMBEDDING
    return PARTIAL


def embedding_bag(w: Walker, node: Node) -> tuple[Layout, ...]:
    """``embedding_bag(weight, indices, offsets, ...)``: each bag reduces its rows feature by
    feature (sum, mean or max), so a table split over its features gives the bags' outputs split
    alike; an undecided table goes column-parallel over them. The ids, offsets and
    ``per_sample_weights`` stay whole (each rank's gradient of the weights sums its own features:
    the all-reduce a whole input of a split op takes, ``insert_collectives``)."""
    weight = node.args[0]
    for t in node.all_input_nodes[1:]:
        if not w.summed(t, node).replicated:
            raise ShardingConflict(f"{describe(node)}: split bag ids or weights", w.get(t).origins())
    lw = w.get(weight)
    if isinstance(lw, ParamView):
        if lw.dim_map == (0, 1) and w.allowed(lw.name, "column"):
            w.param_view_shard(lw, 1, DimVar(w.params[lw.name].shape[1], frozenset({lw.name})), "column", node)
        else:
            w.decide(lw.name, ParamDecision("replicate"), node)
    lw = w.summed(weight, node)
    if lw.var_at(0) is not None:
        raise ShardingConflict(f"{describe(node)}: a bag table split over its rows", lw.origins())
    features = lw.var_at(1)
    out = shard({1: features}) if features is not None else REPLICATE
    vals = node.meta.get("val") or ()
    # the bags' outputs, the bag bookkeeping, and ``max_indices``, shaped as the outputs in mode "max"
    argmax = out if len(vals) == 4 and vals[3].shape == vals[0].shape else REPLICATE
    return (out, REPLICATE, REPLICATE, argmax)


def cross_entropy(w: Walker, node: Node) -> Layout:
    logits, target = node.args[0], node.args[1]
    lay = w.concrete(logits, node)
    w.concrete(target, node)
    if lay.partial:
        w.reduce_first(node, [logits])
        return REPLICATE
    if lay.replicated:
        return REPLICATE
    nd = len(shape_of(logits) or ())
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if nd < 2 or lay.var_at(1) is None or len(lay.dims) != 1 or weight is not None or smoothing:
        raise ShardingConflict(f"{describe(node)}: only a cross-entropy without class weights or label smoothing, over "
                               "logits [N, C, ...] split on C alone, is vocab-parallel", lay.origins())
    vocab = lay.var_at(1).find()
    if vocab.groups is None and vocab.segments is None and vocab.fixed is None:
        vocab.padded = True  # the loss masks padded classes, so V % tp may be nonzero
    w.out.roles[node] = NodeRole.VOCAB_CROSS_ENTROPY
    return REPLICATE
