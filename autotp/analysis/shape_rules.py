"""Layout rules of ops that move dims around: views, reshapes, expands, transposes,
slices, splits, concatenation and row gathers (``index``).

A reshape that splits a sharded dim puts the sharding on the outer block dim; one that
merges a sharded dim with inner dims keeps it on the merged dim; one that merges
unsharded outer dims into a sharded one tiles it (``_tile``: one segment per outer
element), and splitting that tiled dim back gives the sharded inner dim. When the inner dims
come from an expand (``repeat_kv``), the expand is recorded in ``expand_fixups``; a
slice within a sharded dim is recorded in ``slice_fixups``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.propagation_result import ParamView
from autotp.analysis.shapes import norm_dim, reshape_chunks, shape_of
from autotp.ir.errors import describe
from autotp.ir.layouts import (
    PARTIAL,
    REPLICATE,
    DimVar,
    Layout,
    ShardingConflict,
    select_range,
    set_groups,
    set_segments,
    shard,
    unify,
)

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

aten = torch.ops.aten


def _permute_like(w: Walker, node: Node, perm: list[int]) -> Any:
    """Output dim i comes from input dim perm[i] (None: new dim)."""
    lay = w.get(node.args[0])
    if isinstance(lay, ParamView):
        return ParamView(lay.name, tuple(None if p is None else lay.dim_map[p] for p in perm))
    if lay.partial or not lay.dims:
        return lay
    return shard({i: lay.var_at(p) for i, p in enumerate(perm) if p is not None and lay.var_at(p) is not None})


def reshape(w: Walker, node: Node) -> Any:
    src_lay = w.get(node.args[0])
    if isinstance(src_lay, ParamView):
        view = _unit_dims_view(src_lay, shape_of(node.args[0]) or (), shape_of(node) or ())
        if view is not None:
            return view
    lay = w.concrete(node.args[0], node)
    if lay.partial or not lay.dims:
        return lay
    src, dst = shape_of(node.args[0]), shape_of(node)
    assert src is not None and dst is not None
    chunks = reshape_chunks(src, dst)
    if chunks is None:
        raise ShardingConflict(f"{describe(node)}: cannot map the reshape", lay.origins())
    dims: dict[int, DimVar] = {}
    for ca, cb in chunks:
        vars_in = [(d, lay.var_at(d)) for d in ca if lay.var_at(d) is not None]
        if not vars_in:
            continue
        if len(vars_in) > 1:
            raise ShardingConflict(f"{describe(node)}: reshape merges two sharded dims", lay.origins())
        d, var = vars_in[0]
        if len(ca) == 1 and len(cb) == 1:
            dims[cb[0]] = var
        elif len(ca) == 1 and _tiled_inner(var, [dst[c] for c in cb]) is not None:
            dims[cb[1]] = _tiled_inner(var, [dst[c] for c in cb])  # type: ignore[assignment]
        elif len(ca) == 1:
            # split: the sharded dim becomes [blocks, rest...]; blocks carry the split
            blocks = dst[cb[0]]
            set_groups(var, blocks, describe(node))
            out_var = DimVar(blocks, var.find().origins)
            set_groups(out_var, blocks, describe(node))
            dims[cb[0]] = out_var
        elif len(cb) == 1 and d == ca[-1] and d != ca[0]:
            dims[cb[0]] = _tile(var, math.prod(src[c] for c in ca[:-1]), describe(node))
        elif len(cb) == 1:
            if d != ca[0]:
                raise ShardingConflict(f"{describe(node)}: the sharded dim is not the outer one of a merge", lay.origins())
            merged = DimVar(dst[cb[0]], var.find().origins)
            merged.outer = var
            set_groups(merged, var.find().size, describe(node))
            dims[cb[0]] = merged
            _note_broadcast_merge(w, node.args[0], ca[1:], merged, var)
        else:
            raise ShardingConflict(f"{describe(node)}: reshape regroups a sharded dim", lay.origins())
    return shard(dims)


def _tile(var: DimVar, count: int, where: str) -> DimVar:
    """The dim that merges ``count`` unsharded outer elements with sharded ``var``
    (Bloom's ``[batch, heads] -> batch*heads``): ``count`` segments, each split as ``var``."""
    tiled = DimVar(count * var.find().size, var.find().origins)
    for seg in set_segments(tiled, [var.find().size] * count, where):
        unify(seg, var, where)
    return tiled


def _tiled_inner(var: DimVar, sizes: list[int]) -> DimVar | None:
    """For a reshape of a ``_tile``d dim into ``[count, size]``: the sharded inner var, else None."""
    r = var.find()
    if r.segments is None or len(sizes) != 2 or len(r.segments) != sizes[0]:
        return None
    roots = {seg.find() for seg in r.segments}
    inner = next(iter(roots))
    return inner if len(roots) == 1 and inner.size == sizes[1] else None


def _unit_dims_view(view: ParamView, src: tuple[int, ...], dst: tuple[int, ...]) -> ParamView | None:
    """An undecided parameter reshaped by adding or dropping size-1 dims only
    (``scale.view(1, heads, 1, 1)``) stays undecided; None for any other reshape."""
    kept = [i for i, s in enumerate(src) if s != 1]
    if [src[i] for i in kept] != [s for s in dst if s != 1]:
        return None
    real = iter(kept)
    return ParamView(view.name, tuple(None if s == 1 else view.dim_map[next(real)] for s in dst))


def _note_broadcast_merge(w: Walker, src: Node, inner_dims: list[int], merged: DimVar, outer: DimVar) -> None:
    """``repeat_kv``: an expand whose broadcast dims are merged into a sharded dim."""
    producer = src
    while producer.target in (aten.clone.default, aten.contiguous.default) and isinstance(producer.args[0], Node):
        producer = producer.args[0]
    if producer.target is aten.expand.default and len(inner_dims) == 1:
        w.out.expand_fixups.setdefault(producer, []).append((inner_dims[0], merged, outer))


def expand(w: Walker, node: Node) -> Any:
    lay = w.get(node.args[0])
    src, dst = shape_of(node.args[0]), shape_of(node)
    assert src is not None and dst is not None
    off = len(dst) - len(src)
    if isinstance(lay, ParamView):
        return ParamView(lay.name, (None,) * off + lay.dim_map)
    if lay.partial or not lay.dims:
        return lay
    return shard({d + off: v for d, v in lay.dims})


def unsqueeze(w: Walker, node: Node) -> Any:
    nd = len(shape_of(node) or ())
    d = norm_dim(node.args[1], nd)
    perm: list[int | None] = list(range(nd - 1))
    perm.insert(d, None)
    return _permute_like(w, node, perm)  # type: ignore[arg-type]


def squeeze(w: Walker, node: Node) -> Any:
    src = shape_of(node.args[0]) or ()
    if len(node.args) > 1:
        ds = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        drop = {norm_dim(d, len(src)) for d in ds if src[norm_dim(d, len(src))] == 1}
    else:
        drop = {i for i, s in enumerate(src) if s == 1}
    return _permute_like(w, node, [i for i in range(len(src)) if i not in drop])


def transpose(w: Walker, node: Node) -> Any:
    nd = len(shape_of(node) or ())
    if node.target is aten.t.default:
        d0, d1 = 0, nd - 1
    else:
        d0, d1 = norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute_like(w, node, perm)


def reverse_dims(w: Walker, node: Node) -> Any:
    """``x.T`` (``numpy_T``) reverses every dim; ``x.mT`` swaps the last two."""
    nd = len(shape_of(node) or ())
    perm = list(range(nd))
    if node.target is aten.numpy_T.default:
        perm.reverse()
    else:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return _permute_like(w, node, perm)


def permute(w: Walker, node: Node) -> Any:
    nd = len(shape_of(node) or ())
    return _permute_like(w, node, [norm_dim(d, nd) for d in node.args[1]])


def slice_(w: Walker, node: Node) -> Any:
    lay = w.concrete(node.args[0], node)
    src = shape_of(node.args[0]) or ()
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(src))
    var = lay.var_at(d)
    if var is None:
        return lay
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else src[d]
    step = node.args[4] if len(node.args) > 4 else 1
    start, end = norm_dim(start, src[d]), min(norm_dim(end, src[d]) if end < 0 else end, src[d])
    if step != 1:
        raise ShardingConflict(f"{describe(node)}: strided slice of a sharded dim", lay.origins())
    part = select_range(var, start, end, describe(node))
    if part is not var.find():
        w.out.slice_fixups[node] = (var, part)
    return shard({**dict(lay.dims), d: part})


def select(w: Walker, node: Node) -> Any:
    lay = w.concrete(node.args[0], node)
    src = shape_of(node.args[0]) or ()
    d = norm_dim(node.args[1], len(src))
    if lay.var_at(d) is not None:
        raise ShardingConflict(f"{describe(node)}: selects along a sharded dim", lay.origins())
    return _permute_like(w, node, [i for i in range(len(src)) if i != d])


def split(w: Walker, node: Node) -> Any:
    lay = w.concrete(node.args[0], node)
    src = shape_of(node.args[0]) or ()
    outs = node.meta.get("val")
    n_out = len(outs) if isinstance(outs, (list, tuple)) else 1
    target = node.target
    if target is aten.chunk.default:
        d = norm_dim(node.args[2] if len(node.args) > 2 else 0, len(src))
    elif target is aten.unbind.int:
        d = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(src))
    else:
        d = norm_dim(node.args[2] if len(node.args) > 2 else 0, len(src))
    if lay.partial:
        return tuple(PARTIAL for _ in range(n_out))
    var = lay.var_at(d)
    if var is None:
        if target is aten.unbind.int:
            return tuple(_drop_dim(lay, d) for _ in range(n_out))
        return tuple(lay for _ in range(n_out))
    if target is aten.unbind.int:
        raise ShardingConflict(f"{describe(node)}: unbinds a sharded dim", lay.origins())
    sizes = [int(o.shape[d]) for o in outs]
    segs = set_segments(var, sizes, describe(node))
    return tuple(shard({**dict(lay.dims), d: seg}) for seg in segs)


def _drop_dim(lay: Layout, d: int) -> Layout:
    return shard({(i if i < d else i - 1): v for i, v in lay.dims if i != d})


def cat(w: Walker, node: Node) -> Any:
    """``cat`` and ``stack``: inputs sharded alike, along another dim."""
    tensors = node.args[0]
    nd = len(shape_of(node) or ())
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    stacking = node.target is aten.stack.default
    lays = [w.concrete(t, node) for t in tensors]
    if all(l.replicated for l in lays):
        return REPLICATE
    if any(l.partial for l in lays):
        w.reduce_first(node, list(tensors))
        lays = [REPLICATE if l.partial else l for l in lays]
        if all(not l.dims for l in lays):
            return REPLICATE
    first_rank = next(len(shape_of(t) or ()) for t, l in zip(tensors, lays) if l.dims)
    first = next(l for l in lays if l.dims)
    for t, l in zip(tensors, lays):
        same_rank = len(shape_of(t) or ()) == first_rank
        if not l.dims and same_rank and all(x != d or stacking for x, _ in first.dims):
            # a replicated operand (an attention sink per head): each rank takes its slice
            for x, v in first.dims:
                if v.find().padded:
                    raise ShardingConflict(f"{describe(node)}: a replicated operand meets padded sharding", v.find().origins)
                w.out.local_slices.setdefault(node, []).append((t, x, v))
            continue
        if [x for x, _ in l.dims] != [x for x, _ in first.dims]:
            raise ShardingConflict(f"{describe(node)}: concatenates differently sharded tensors", first.origins() | l.origins())
        for (_, v1), (_, v2) in zip(first.dims, l.dims):
            unify(v1, v2, describe(node))
    if stacking:
        return shard({(i if i < d else i + 1): v for i, v in first.dims})
    if first.var_at(d) is not None:
        raise ShardingConflict(f"{describe(node)}: concatenates along a sharded dim", first.origins())
    return first


def index(w: Walker, node: Node) -> Any:
    """``x[..., idx, ...]`` (``None`` entries are whole dims): the indexed dims must not
    be sharded; the other dims keep their sharding where advanced indexing puts them."""
    x, indices = node.args[0], node.args[1]
    lay = w.concrete(x, node)
    for i in indices:
        if isinstance(i, Node) and not w.concrete(i, node).replicated:
            raise ShardingConflict(f"{describe(node)}: sharded index tensor", w.get(i).origins())
    if lay.replicated or lay.partial:
        return lay
    indexed = [d for d, i in enumerate(indices) if i is not None]
    if not indexed:
        return lay
    if any(lay.var_at(d) is not None for d in indexed):
        raise ShardingConflict(f"{describe(node)}: indexes a sharded dim", lay.origins())
    src, dst = shape_of(x) or (), shape_of(node) or ()
    index_ndim = len(dst) - (len(src) - len(indexed))
    kept = [d for d in range(len(src)) if d not in indexed]
    if indexed == list(range(indexed[0], indexed[-1] + 1)):  # adjacent: the index dims stay in place
        where = {d: (d if d < indexed[0] else d - len(indexed) + index_ndim) for d in kept}
    else:  # apart: the index dims go first
        where = {d: index_ndim + kept.index(d) for d in kept}
    return shard({where[d]: v for d, v in lay.dims})
