"""Layout rules of ops that move dims around without regrouping them: expands,
transposes, permutes, squeezes, slices, selects, splits, pads and concatenation
(reshapes are ``reshape_rules``, indexing ``index_rules``).

A slice within a sharded dim selects a segment of it (``select_range``), recorded in
``slice_fixups``; one that drops the padding at the end of an even split is a padded dim of
those blocks (``padding_slices``); a strided slice (``[..., ::2]``, interleaved gate/up columns) keeps
whole blocks of ``step`` elements on each rank. An expand of a size-1 dim that a
replicated block fills (one KV head held by every rank) may take any split.
"""

from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.propagation_result import ParamView, Sliced
from autotp.analysis.shapes import adds_nothing_to_cat, norm_dim, schema_arg, shape_of, strided_walk
from autotp.ir.errors import describe
from autotp.ir.op_facts import is_matmul, op_name
from autotp.ir.layouts import (
    PARTIAL,
    REPLICATE,
    DimVar,
    Layout,
    ShardingConflict,
    follow,
    set_groups,
    select_range,
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


def expand(w: Walker, node: Node) -> Any:
    lay = w.get(node.args[0])
    src, dst = shape_of(node.args[0]), shape_of(node)
    assert src is not None and dst is not None
    off = len(dst) - len(src)
    if isinstance(lay, ParamView):
        return ParamView(lay.name, (None,) * off + lay.dim_map)
    if lay.partial or not lay.dims:
        return lay
    dims = {}
    for d, v in lay.dims:
        if src[d] == 1 and dst[d + off] != 1:
            # a size-1 dim every rank holds whole (one KV head), broadcast: any split fits
            dims[d + off] = DimVar(dst[d + off], v.find().origins)
        else:
            dims[d + off] = v
    return shard(dims)


def expand_as(w: Walker, node: Node) -> Any:
    """``x.expand_as(other)``: x's dims keep their split; a dim x broadcasts takes other's
    (the rank's ``other`` has its local shape, so no size needs rewriting)."""
    lay = w.concrete(node.args[0], node)
    like = w.get(node.args[1])
    src, dst = shape_of(node.args[0]) or (), shape_of(node) or ()
    off = len(dst) - len(src)
    if lay.partial:
        return lay
    dims = {d + off: v for d, v in lay.dims}
    if isinstance(like, Layout):
        for d, v in like.dims:
            if d - off < 0 or src[d - off] == 1:
                dims.setdefault(d, v)
    return shard(dims)


def dims_whole(w: Walker, node: Node) -> Any:
    """Ops that act along some dims and elementwise elsewhere (``tril``/``triu`` on the last
    two, ``flip``/``roll`` on ``dims``): those dims must be whole; linear in a partial input."""
    nd = len(shape_of(node.args[0]) or ())
    acting = schema_arg(node, "dims", [nd - 2, nd - 1])
    acting = [acting] if isinstance(acting, int) else list(acting) or list(range(nd))
    return _whole_along(w, node, acting, "acts along a sharded dim")


_FOURIER_1D = frozenset({"fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft"})
_FOURIER_2D = frozenset({"fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2", "fft_hfft2", "fft_ihfft2"})
_FOURIER_ND = frozenset({"fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn", "fft_hfftn", "fft_ihfftn", "fft_fftshift", "fft_ifftshift"})
FOURIER = _FOURIER_1D | _FOURIER_2D | _FOURIER_ND | {"_fft_r2c", "_fft_c2r", "_fft_c2c"}


def fourier_dims(node: Node) -> list[int]:
    """The dims a Fourier transform (or its shift) of ``node.args[0]`` acts along: its ``dim``, else the last
    one (1-D), the last two (2-D), the last ``len(s)`` or every dim (n-D)."""
    name, nd = op_name(node.target), len(shape_of(node.args[0]) or ())
    dims = schema_arg(node, "dim")
    if dims is None:
        size = schema_arg(node, "s")
        dims = [-1] if name in _FOURIER_1D else [-2, -1] if name in _FOURIER_2D else list(range(-len(size), 0)) if size else list(range(nd))
    return [norm_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims)]


def fourier(w: Walker, node: Node) -> Any:
    """A Fourier transform (FNet, Autoformer's auto-correlation, FEDformer's frequency blocks): along its
    dims it mixes every element, elsewhere each slice is transformed alone, so every other dim keeps its split."""
    return _whole_along(w, node, fourier_dims(node), "transforms along a sharded dim")


def _whole_along(w: Walker, node: Node, dims: list[int], why: str) -> Any:
    """The layout of ``node``'s input, which must be whole along ``dims`` (the op acts along
    them and elementwise elsewhere, so every other dim keeps its split)."""
    x = node.args[0]
    lay = w.concrete(x, node)
    nd = len(shape_of(x) or ())
    for d in dims:
        var = lay.var_at(norm_dim(d, nd))
        if var is not None:
            raise ShardingConflict(f"{describe(node)}: {why}", lay.origins(), (var,))
    return lay


# pooling and interpolation, by op name; the digit of "1d"/"2d"/"3d" counts the spatial dims
_PLANEWISE_LINEAR = frozenset({
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
})  # fmt: skip
_PLANEWISE_MAX = frozenset({
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
})  # fmt: skip
PLANEWISE = _PLANEWISE_LINEAR | _PLANEWISE_MAX


def planewise(w: Walker, node: Node) -> Any:
    """Pooling and interpolation (``avg_pool2d``, ``adaptive_max_pool1d``, ``upsample_bilinear2d``...):
    each plane of an input ``[(N,) C, *spatial]`` maps to its own output plane, so every dim
    before the spatial ones keeps its split and the spatial dims must be whole. Averaging and
    interpolating are linear in a partial input; a maximum is taken of the summed value."""
    name = op_name(node.target)
    if name in _PLANEWISE_MAX:
        w.summed(node.args[0], node)
    nd = len(shape_of(node.args[0]) or ())
    spatial = int(re.search(r"(\d)d", name).group(1))
    lay = _whole_along(w, node, list(range(nd - spatial, nd)), "pools or resizes along a sharded dim")
    val = node.meta.get("val")
    return tuple(lay for _ in val) if isinstance(val, (tuple, list)) else lay


def unfold(w: Walker, node: Node) -> Any:
    """``x.unfold(dim, size, step)`` (sliding windows): ``dim`` becomes the window count and a
    new last dim the positions within a window, so ``dim`` must be whole; every other dim
    keeps its split (a view: linear in a partial input)."""
    return _whole_along(w, node, [node.args[1]], "unfolds a sharded dim")


def as_strided(w: Walker, node: Node) -> Any:
    """``as_strided`` (sliding windows built by hand): where it reads ``x`` by summing output
    indices along input dims (``shapes.strided_walk``), a split input dim walked by exactly
    one output dim of its whole size keeps its split there (the rank's strides and sizes
    are rewritten, ``passes/rewrite_shapes``); any other split dim conflicts."""
    lay = w.concrete(node.args[0], node)
    if lay.partial or not lay.dims:
        return lay  # linear in a partial input
    walk = strided_walk(node)
    src = shape_of(node.args[0]) or ()
    dims = {}
    for d, var in lay.dims:
        steps = [j for j, i in enumerate(walk or ()) if i == d]
        if len(steps) != 1 or node.args[1][steps[0]] != src[d]:
            raise ShardingConflict(f"{describe(node)}: reads a sharded dim through strides that mix it", lay.origins(), (var,))
        dims[steps[0]] = var
    return shard(dims)


def unsqueeze(w: Walker, node: Node) -> Any:
    nd = len(shape_of(node) or ())
    d = norm_dim(node.args[1], nd)
    perm: list[int | None] = list(range(nd - 1))
    perm.insert(d, None)
    return _permute_like(w, node, perm)  # type: ignore[arg-type]


def appends_whole_dim(w: Walker, node: Node) -> Any:
    """``one_hot(indices, n)``: the indices' layout, the classes a whole last dim."""
    return w.summed(node.args[0], node)


def squeeze(w: Walker, node: Node) -> Any:
    src = shape_of(node.args[0]) or ()
    if len(node.args) > 1:
        ds = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        drop = {norm_dim(d, len(src)) for d in ds if src[norm_dim(d, len(src))] == 1}
    else:
        drop = {i for i, s in enumerate(src) if s == 1}
    drop_unit_dims(w.get(node.args[0]), node, drop)
    return _permute_like(w, node, [i for i in range(len(src)) if i not in drop])


def drop_unit_dims(lay: Any, node: Node, dims: set[int] | list[int]) -> None:
    """A split size-1 dim may not vanish (squeezed, reduced): every rank holds it whole
    and the split only says that each rank uses it for its own slice (one KV head for
    the rank's query heads), so its gradient is summed over the ranks. Once the dim is
    gone the tensor reads as replicated, used alike by every rank, and that sum would
    count its gradient tp times."""
    if isinstance(lay, ParamView) or lay.partial:
        return
    split = [v for d, v in lay.dims if d in dims]
    if split:
        raise ShardingConflict(f"{describe(node)}: drops a split size-1 dim", lay.origins(), tuple(split))


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
    src = shape_of(node.args[0]) or ()
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(src))
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else src[d]
    step = node.args[4] if len(node.args) > 4 else 1
    if not all(isinstance(b, int) for b in (start, end, step)):  # bounds computed at run time (BLT's patch lengths)
        return _whole_along(w, node, [d], "a slice with bounds known only at run time of a sharded dim")
    start, end = norm_dim(start, src[d]), min(norm_dim(end, src[d]) if end < 0 else end, src[d])
    view = w.get(node.args[0])
    if isinstance(view, ParamView) and (start, end, step) == (0, src[d], 1):
        return view  # ``bias[:, None, :]`` keeps a parameter undecided
    if isinstance(view, ParamView) and isinstance(view.dim_map[d], int) and step == 1 and start < end:
        return ParamView(view.name, view.dim_map[:d] + (Sliced(view.dim_map[d], start, end, node),) + view.dim_map[d + 1 :])
    lay = w.concrete(node.args[0], node)
    var = lay.var_at(d)
    if var is None:
        return lay
    if start >= end:  # an empty slice (an empty KV cache) holds nothing to split
        return shard({x: v for x, v in lay.dims if x != d})
    if step != 1:
        return shard({**dict(lay.dims), d: _strided(node, var, start, end, step)})
    if start == 0 and _drops_padding(var, end, w.tp):
        kept = DimVar(end, var.find().origins, padded=True, block=var.find().size // w.tp)
        w.out.padding_slices[node] = var
        return shard({**dict(lay.dims), d: kept})
    part = select_range(var, start, end, describe(node))
    if part is not var.find():
        w.out.slice_fixups[node] = (var, part, start)
    return shard({**dict(lay.dims), d: part})


def _drops_padding(var: DimVar, end: int, tp: int) -> bool:
    """Whether ``x[..., :end]`` of a split dim drops padding that no cut into segments can split
    (nanochat's logits over a vocabulary padded to 64, ``logits[..., :vocab]``): the dim splits in
    ``tp`` even blocks, the last of which holds the dropped end, and ``end`` or the rest is not a
    multiple of ``tp``. The slice is then a padded dim of those blocks (``DimSharding.block``): each
    rank keeps its block, the padding zeroed (``rewrite_shapes``), as a padded vocabulary's."""
    r = var.find()
    if r.padded or r.segments is not None or r.follows is not None or r.size % tp:
        return False
    if r.fixed is not None and (len(r.fixed.segments) != 1 or r.fixed.padded or r.fixed.groups[0] % tp):
        return False  # a plan's split (the rank graph's walk) of other than tp even blocks
    return r.size - r.size // tp < end < r.size and bool(end % tp or (r.size - end) % tp)


def sym_size(w: Walker, node: Node) -> Any:
    """``x.shape[d]`` where it is known only at run time: the same on every rank where dim
    ``d`` is whole; a rank's size of a split dim is not the model's."""
    lay = w.get(node.args[0])
    var = lay.var_at(norm_dim(node.args[1], len(shape_of(node.args[0]) or ()))) if isinstance(lay, Layout) else None
    if var is not None:
        raise ShardingConflict(f"{describe(node)}: reads the size of a sharded dim", var.find().origins, (var,))
    return REPLICATE


def _strided(node: Node, var: DimVar, start: int, end: int, step: int) -> DimVar:
    """``x[..., start::step]`` of a sharded dim: each rank keeps whole blocks of ``step``
    elements (interleaved gate/up columns), and takes element ``start`` of each."""
    size = var.find().size
    if start >= step or end != size or size % step:
        raise ShardingConflict(f"{describe(node)}: strided slice [{start}:{end}:{step}] of a sharded dim of {size}", var.find().origins, (var,))
    out = DimVar(size // step, var.find().origins)
    out.made_by = var.find().made_by
    set_groups(out, size // step, describe(node))
    follow(var, out, describe(node))  # var is [size/step blocks, step]: whole blocks per rank
    return out


def select(w: Walker, node: Node) -> Any:
    src = shape_of(node.args[0]) or ()
    d = norm_dim(node.args[1], len(src))
    view = w.get(node.args[0])
    if isinstance(view, ParamView) and view.dim_map[d] is not None:
        # one expert of a stacked weight (``weight[i]``): the parameter stays undecided, its first matmul decides
        return ParamView(view.name, view.dim_map[:d] + view.dim_map[d + 1 :])
    lay = w.concrete(node.args[0], node)
    if lay.var_at(d) is not None:
        raise ShardingConflict(f"{describe(node)}: selects along a sharded dim", lay.origins(), (lay.var_at(d),))
    return _permute_like(w, node, [i for i in range(len(src)) if i != d])


def pad(w: Walker, node: Node) -> Any:
    """``F.pad``: the padded dims (pairs from the last dim backwards) must be whole."""
    lay = w.summed(node.args[0], node)
    nd = len(shape_of(node) or ())
    widths = list(node.args[1])
    padded = {nd - 1 - i // 2 for i, p in enumerate(widths) if p}
    for d in padded:
        if lay.var_at(d) is not None:
            raise ShardingConflict(f"{describe(node)}: pads a sharded dim", lay.origins(), (lay.var_at(d),))
    return lay


def split(w: Walker, node: Node) -> Any:
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
    if target is not aten.unbind.int:
        _split_packed_parameter(w, node, d)
    lay = w.concrete(node.args[0], node)
    if lay.partial:
        return tuple(PARTIAL for _ in range(n_out))
    var = lay.var_at(d)
    if var is None:
        if target is aten.unbind.int:
            return tuple(_drop_dim(lay, d) for _ in range(n_out))
        return tuple(lay for _ in range(n_out))
    if target is aten.unbind.int:
        raise ShardingConflict(f"{describe(node)}: unbinds a sharded dim", lay.origins(), (var,))
    sizes = [int(o.shape[d]) for o in outs]
    segs = set_segments(var, sizes, describe(node))
    return tuple(shard({**dict(lay.dims), d: seg}) for seg in segs)


def _split_packed_parameter(w: Walker, node: Node, d: int) -> None:
    """An undecided parameter cut into parts along dim ``d``, every part read only by matmuls
    (``nn.MultiheadAttention``'s packed ``in_proj_weight`` and bias split into the query's
    and the key/value's for cross-attention): dim ``d`` is split, the parts its segments, so
    each matmul shards its part as it would a weight of its own (column-parallel over the
    heads). Read whole, the packed weight stays on every rank. A matmul that cannot use
    the split is a conflict naming the parameter, which the planner then keeps whole."""
    view = w.get(node.args[0])
    if not isinstance(view, ParamView) or not isinstance(view.dim_map[d], int) or not w.allowed(view.name, "column"):
        return
    parts = [p for p in node.users if p.target is operator.getitem]
    if len(parts) < 2 or len(parts) != len(node.users) or not all(u.users and all(is_matmul(r) for r in u.users) for u in parts):
        return
    size = (shape_of(node.args[0]) or ())[d]
    w.param_view_shard(view, d, DimVar(size, frozenset({view.name})), "column", node)


def glu(w: Walker, node: Node) -> Any:
    """``glu(x, dim)``: the first half of ``dim`` times the sigmoid of the second. A split
    ``dim`` is cut into the two halves, split alike (rank r holds part r of each, as a
    fused gate/up projection), so the rank's ``glu`` pairs its own parts."""
    lay = w.summed(node.args[0], node)
    src = shape_of(node.args[0]) or ()
    d = norm_dim(node.args[1] if len(node.args) > 1 else -1, len(src))
    var = lay.var_at(d)
    if var is None:
        return lay
    first, second = set_segments(var, [src[d] // 2, src[d] // 2], describe(node))
    return shard({**dict(lay.dims), d: unify(first, second, describe(node))})


def _drop_dim(lay: Layout, d: int) -> Layout:
    return shard({(i if i < d else i - 1): v for i, v in lay.dims if i != d})


def cat(w: Walker, node: Node) -> Any:
    """``cat`` and ``stack``: inputs sharded alike, along another dim."""
    nd = len(shape_of(node) or ())
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    stacking = node.target is aten.stack.default
    tensors = [t for t in node.args[0] if stacking or not adds_nothing_to_cat(t, d)]
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
        for (x, v1), (_, v2) in zip(first.dims, l.dims):
            if x != d or stacking:  # along the cat dim each input is its own segment
                unify(v1, v2, describe(node))
    if stacking:
        return shard({(i if i < d else i + 1): v for i, v in first.dims})
    if first.var_at(d) is not None:
        # along the sharded dim: each input is a segment of the output (a split undone)
        parts = [l.var_at(d) for l in lays]
        joined = DimVar(sum(v.find().size for v in parts), first.origins())
        joined.made_by = next((v.find().made_by for v in parts if v.find().made_by), None)
        for seg, part in zip(set_segments(joined, [v.find().size for v in parts], describe(node)), parts):
            if part.find().padded:
                raise ShardingConflict(f"{describe(node)}: concatenates a padded dim", part.find().origins)
            unify(seg, part, describe(node))
        return shard({**dict(first.dims), d: joined})
    return first
