"""Layout rules of ops that compute values: elementwise ops with broadcasting, ops that
need a dim whole (softmax, topk...), dropout (reductions and norms are ``statistic_rules``,
attention ``attention_rules``).

``pointwise`` is also where a bias or norm weight follows the sharding of the operand
it meets (kind ``bias``), and where a replicated operand of full size that meets a
sharded dim is read through a rank-local slice (``Propagation.local_slices``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.partials import linear_in_partial
from autotp.analysis.propagation_result import ParamView
from autotp.analysis.shapes import norm_dim, shape_of
from autotp.analysis.sharding_policy import hint_reparametrized, matmul
from autotp.ir.errors import describe
from autotp.ir.op_facts import draws_random
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, Layout, ShardingConflict, shard, unify

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

aten = torch.ops.aten

DIM_OPS = {  # ops that need the given dim whole; (position of dim arg, default)
    aten.softmax.int: (1, None),
    aten._softmax.default: (1, None),
    aten.log_softmax.int: (1, None),
    aten._log_softmax.default: (1, None),
    aten.cumsum.default: (1, None),
    aten.cumprod.default: (1, None),
    aten.logcumsumexp.default: (1, None),
    aten.cummax.default: (1, None),
    aten.cummin.default: (1, None),
    aten.topk.default: (2, -1),
    aten.sort.default: (1, -1),
    aten.argmax.default: (1, None),
    aten.amax.default: (1, None),
    aten.max.dim: (1, None),
    aten.amin.default: (1, None),
    aten.argmin.default: (1, None),
    aten.min.dim: (1, None),
    aten.logsumexp.default: (1, None),
}


def pointwise(w: Walker, node: Node, tensor_args: list[Any] | None = None) -> Layout:
    """Elementwise op with broadcasting."""
    args = tensor_args if tensor_args is not None else [a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]
    out_shape = shape_of(node)
    if out_shape is None:
        return w.opaque(node)
    lays = [w.get(a) for a in args]
    partial = [a for a, l in zip(args, lays) if l == PARTIAL]
    sharded = [l for l in lays if isinstance(l, Layout) and l.dims]
    if partial:
        if not sharded and linear_in_partial(node, args, lays):
            for a, l in zip(args, lays):
                if isinstance(l, ParamView):
                    w.concrete(a, node)
            return PARTIAL
        w.reduce_first(node, args)
        lays = [REPLICATE if l == PARTIAL else l for l in lays]
    if not sharded:
        for a in args:
            w.concrete(a, node)
        return REPLICATE
    nd = len(out_shape)
    dims: dict[int, DimVar] = {}
    for lay in sharded:
        for d, v in lay.dims:
            # align from the right
            arg_shape = None
            for a, l in zip(args, lays):
                if l is lay:
                    arg_shape = shape_of(a) or ()
            od = d + nd - (len(arg_shape) if arg_shape is not None else nd)
            if arg_shape is not None and arg_shape[d] == 1 and out_shape[od] != 1:  # a split of a size-1 dim, broadcast over a larger one
                raise ShardingConflict(f"{describe(node)}: broadcasts a split dim of size 1", v.find().origins, (v,))
            dims[od] = unify(dims[od], v, describe(node)) if od in dims else v
    _split_elsewhere(node, args, lays, dims, nd)
    for a, lay in zip(args, lays):
        shp = shape_of(a) or ()
        off = nd - len(shp)
        for od, var in dims.items():
            d = od - off
            if d < 0 or shp[d] == 1:
                continue
            if isinstance(lay, ParamView):
                if lay.name in w.out.decisions:
                    continue
                if len([x for x in range(len(shp)) if x + off in dims and shp[x] != 1]) > 1:
                    raise ShardingConflict(f"{describe(node)}: {lay.name} meets two sharded dims", var.find().origins)
                w.param_view_shard(lay, d, var, "bias", node)
            elif lay.var_at(d) is None:
                if partial and var.find().size != shp[d]:
                    raise ShardingConflict(f"{describe(node)}: an operand of full size meets a sharded dim", var.find().origins, (var,))
                # a replicated operand (a per-head bias, a buffer; a partial one summed first):
                # each rank reads its own slice
                w.out.local_slices.setdefault(node, []).append((a, d, var))
                hint_reparametrized(w, a, (d, "bias"))
    for a in args:
        lay = w.get(a)
        if isinstance(lay, ParamView):
            w.concrete(a, node)
    return shard(dims)


def _split_elsewhere(node: Node, args: list[Any], lays: list[Any], dims: dict[int, DimVar], nd: int) -> None:
    """Raise where an operand split on other dims is of full size on a dim the op splits: the
    output would need both splits. The smallest such operand (the one broadcast into the
    others: Mamba2's ``B`` and ``C`` of one group against the per-head state) is blamed with
    its own split, which a reshape may put on this dim instead (``ShardingConflict.retries``)."""
    found = []
    for a, lay in zip(args, lays):
        if not isinstance(lay, Layout) or lay.replicated:
            continue
        shp = shape_of(a) or ()
        off = nd - len(shp)
        met = [var for od, var in dims.items() if od >= off and shp[od - off] != 1 and lay.var_at(od - off) is None]
        if met:
            found.append((math.prod(shp), met[0], lay))
    if found:
        _, var, lay = min(found, key=lambda f: f[0])
        raise ShardingConflict(f"{describe(node)}: an operand of full size meets a sharded dim", var.find().origins, tuple(v for _, v in lay.dims))


def needs_whole_dim(w: Walker, node: Node) -> Any:
    pos, default = DIM_OPS[node.target]
    x = node.args[0]
    lay = w.summed(x, node)
    nd = len(shape_of(x) or ())
    d = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
    if d is None:
        if lay.dims:
            raise ShardingConflict(f"{describe(node)}: reduces a sharded tensor", lay.origins(), tuple(v for _, v in lay.dims))
        reduced = list(range(nd))
    else:
        reduced = [norm_dim(dd, nd) for dd in ([d] if isinstance(d, int) else list(d))]
        for dd in reduced:
            if lay.var_at(dd) is not None:
                raise ShardingConflict(f"{describe(node)}: needs a sharded dim whole", lay.origins(), (lay.var_at(dd),))
    val = node.meta.get("val")
    vals = [v for v in (val if isinstance(val, (tuple, list)) else (val,)) if isinstance(v, torch.Tensor)]
    # outputs keep every dim (softmax, topk, keepdim) or drop the reduced ones (max.dim)
    outs = tuple(lay if v.dim() == nd else shard({i - sum(r < i for r in reduced): var for i, var in lay.dims}) for v in vals)
    if len(outs) != len(vals) or any(v.dim() not in (nd, nd - len(reduced)) for v in vals):
        if lay.dims:
            raise ShardingConflict(f"{describe(node)}: unsupported sharded reduction", lay.origins())
        return tuple(REPLICATE for _ in vals) if isinstance(val, (tuple, list)) else REPLICATE
    return outs if isinstance(val, (tuple, list)) else outs[0]


def random_draw(w: Walker, node: Node) -> Layout:
    """Ops that draw random numbers (``rand``, ``bernoulli``, ``normal``, ``multinomial``,
    ``x.uniform_()``...). A rank drawing only its part of a split result would draw the first
    numbers of the generator, the same on every rank, not the part of the whole draw the
    unmodified model makes. So the draw is whole: every tensor it reads is whole, every rank
    draws the same whole tensor, and a reader of a split takes its slice. A dropout in eval
    mode draws nothing: the identity."""
    if not draws_random(node):
        return dropout(w, node)
    for a in node.all_input_nodes:
        lay = w.summed(a, node)
        if lay.dims:
            raise ShardingConflict(f"{describe(node)}: draws random numbers shaped by a split tensor", lay.origins(), tuple(v for _, v in lay.dims))
    return REPLICATE


def like_factory(w: Walker, node: Node) -> Layout:
    lay = w.concrete(node.args[0], node)
    return REPLICATE if lay.partial else lay


def new_factory(w: Walker, node: Node) -> Layout:
    """``x.new_empty/new_zeros/new_ones/new_full(size)``: a constant that reads only x's dtype
    and device, so any split of it is sound. It takes x's split on each dim of x's size at
    the same place (the buffer a model fills with x's parts); ``rewrite_shapes`` makes the
    size the rank's."""
    lay = w.concrete(node.args[0], node)
    src, dst = shape_of(node.args[0]) or (), shape_of(node) or ()
    if lay.partial or len(src) != len(dst) or 0 in dst:  # an empty tensor holds no split (``cat`` ignores it)
        return REPLICATE
    return shard({d: v for d, v in lay.dims if src[d] == dst[d]})


UNIFORM_FACTORIES = (aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format)
"""Ops that make a tensor of one value (or none) from sizes alone: any split of it is the same
tensor at the rank's size (``rewrite_shapes`` makes the size the rank's)."""


def _unread_before(dst: Node, node: Node) -> bool:
    """Whether nothing reads ``dst`` between its making and ``node``."""
    step = node.prev
    while step is not dst and step.op != "root":
        if step in dst.users:
            return False
        step = step.prev
    return step is dst


def copy_into(w: Walker, node: Node) -> Layout:
    """``dst.copy_(src)``, ``copy(dst, src)``: src's values, broadcast, in dst's shape and
    storage, so the result is split where dst is. src must be split alike on those dims (a
    replicated src of full size is read through the rank's slice) and nowhere else. A dst
    made by a ``UNIFORM_FACTORIES`` op and unread so far (a state buffer of zeros that a
    forward fills: a convolution's cache) takes src's split instead of holding it whole."""
    dst, src = node.args[0], node.args[1]
    dlay, slay = w.concrete(dst, node), w.concrete(src, node)
    if slay.partial:
        w.reduce_first(node, [src])
        slay = REPLICATE
    shp = shape_of(src) or ()
    off = len(shape_of(node) or ()) - len(shp)
    if isinstance(dst, Node) and dst.target in UNIFORM_FACTORIES and dlay.replicated and _unread_before(dst, node):
        whole = shape_of(dst) or ()
        dlay = shard({d + off: var for d, var in slay.dims if shp[d] == whole[d + off]})
        w.out.layouts[dst] = dlay
    dims = {} if dlay.partial else dict(dlay.dims)  # a partial dst is overwritten whole
    for d, var in slay.dims:
        if d + off not in dims:
            raise ShardingConflict(f"{describe(node)}: copies a split tensor into a whole one", var.find().origins, (var,))
        unify(dims[d + off], var, describe(node))
    for od, var in dims.items():
        d = od - off
        if d >= 0 and shp[d] != 1 and slay.var_at(d) is None:
            w.out.local_slices.setdefault(node, []).append((src, d, var))
    return shard(dims)


def dropout(w: Walker, node: Node) -> Layout:
    x = node.args[0]
    lay = w.concrete(x, node)
    if lay.partial:
        w.reduce_first(node, [x])
        return REPLICATE
    return lay




def baddbmm(w: Walker, node: Node) -> Layout:
    """``beta * input + alpha * (batch1 @ batch2)``: the product's layout (``bmm``), which
    ``input`` (Bloom's ALiBi bias) meets like an elementwise operand."""
    product = matmul(w, node, node.args[1], node.args[2], b_t=False, bias=None)
    bias = node.args[0]
    lay = w.concrete(bias, node)
    if lay.partial or product.partial:
        raise ShardingConflict(f"{describe(node)}: a partial operand of baddbmm", lay.origins() | product.origins())
    shape = shape_of(bias) or ()
    off = len(shape_of(node) or ()) - len(shape)
    for od, var in product.dims:
        d = od - off
        if d < 0 or shape[d] == 1:
            continue
        if lay.var_at(d) is not None:
            unify(lay.var_at(d), var, describe(node))
        elif lay.replicated and not var.find().padded:
            w.out.local_slices.setdefault(node, []).append((bias, d, var))
        else:
            raise ShardingConflict(f"{describe(node)}: an operand of full size meets a sharded dim", var.find().origins)
    if any(product.var_at(d + off) is None for d, _ in lay.dims):
        raise ShardingConflict(f"{describe(node)}: the bias is sharded where the product is not", lay.origins())
    return product
