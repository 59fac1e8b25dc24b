"""Layout rules of ops that regroup dims: reshapes and views, complex views and
``repeat_interleave``, by tracking which input dims become which output dims.

``reshape_chunks`` pairs runs of input dims with runs of output dims of equal product.
A sharded dim survives a reshape when it maps onto whole output factors:

* **split** ``[n] -> [f0, f1, ...]``: one factor carries the split; the dims outside it
  stay whole on every rank. The outermost factor that tp can split is tried first
  (``[H*D] -> [H, D]`` shards the heads); a factor ``fi`` further in cuts the dim into
  ``f0*...*f(i-1)`` segments, each split into ``fi`` blocks (timm's ``reshape(B, N, 3, H,
  D)`` shards H inside each of q, k and v). A later op that cannot keep the chosen
  factor sharded (``unbind`` of the 3) makes the planner walk again with that factor
  avoided (``ShardingConflict.retries``, ``Walker.avoid``).
* **merge** ``[n0, rest...] -> [m]`` with the split on the outer dim: the merged dim
  follows n0's blocks (``DimVar.follows``); when an expand made ``rest`` (``repeat_kv``)
  the expand is recorded instead, and a rank may hold part of the repeats. A merge
  of unsharded outer dims into a sharded inner one tiles it (``layouts.tile``: one segment per
  outer element), and splitting that tiled dim back gives the sharded inner dim, whether
  one or several outer factors index the tiles (``[B*T*H] -> [B, T, H]``), also through a
  common refinement (``[B*T*H, D] -> [B, T, H*D]``, the gated norm of linear attention).
* **regroup** ``[n0, ...] -> [m0, ...]`` (heads in pairs): the split moves to m0 when one
  of n0, m0 divides the other, and the finer dim follows the coarser one's blocks.

An input dim that a split cuts into output factors follows the factor that carries the
split (``layouts.follow``): the projection's features are split in whole heads, and
whatever a later op asks of the heads (a slice of the query heads, one KV head held
whole) is the projection's split too.

Complex views keep every dim but the pair of reals; ``repeat_interleave`` along a
sharded dim repeats each rank's own elements (``repeat_fixups``: the local repeat count).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.propagation_result import ParamView, Tiled
from autotp.analysis.shapes import norm_dim, reshape_chunks, shape_of
from autotp.ir.errors import describe
from autotp.ir.layouts import DimVar, Layout, ShardingConflict, follow, resolve, set_groups, set_segments, shard, tile, unify
from autotp.ir.dim_sharding import DimSharding

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

aten = torch.ops.aten


def reshape(w: Walker, node: Node) -> Any:
    src_lay = w.get(node.args[0])
    if isinstance(src_lay, ParamView):
        view = _unit_dims_view(src_lay, shape_of(node.args[0]) or (), shape_of(node) or ())
        view = view or _factor_view(src_lay, shape_of(node.args[0]) or (), shape_of(node) or ())
        view = view or _merged_view(src_lay, shape_of(node.args[0]) or (), shape_of(node) or ())
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
        assert var is not None
        units = _units_before(dst, cb[0], dims_taken=[c for _, b in chunks for c in b])
        if len(ca) == 1 and len(cb) == 1 and units:
            # ``[n] -> [1, n]`` (one KV head): the split may stay on n or go to the unit dim
            at, out = _split(w, node, var, [1] * len(units) + [dst[cb[0]]])
            dims[(units + cb)[at]] = out
        elif len(ca) == 1 and len(cb) == 1:
            dims[cb[0]] = var
        elif len(ca) == 1:
            at, out = _split(w, node, var, [dst[c] for c in cb])
            dims[cb[at]] = out
        elif len(cb) == 1 and d == ca[-1] and d != ca[0]:
            dims[cb[0]] = _carrying_choice(tile(var, math.prod(src[c] for c in ca[:-1]), describe(node)), var)
        elif len(cb) == 1 and d != ca[0] and not _tiled(var):
            # [outer..., split, inner...] -> one dim: the split with its inner elements, tiled by the outer ones
            at = ca.index(d)
            with_inner = DimVar(math.prod(src[c] for c in ca[at:]), var.find().origins)
            follow(with_inner, var, describe(node))
            dims[cb[0]] = _carrying_choice(tile(with_inner, math.prod(src[c] for c in ca[:at]), describe(node)), var)
        elif (d != ca[0] or _tiled(var)) and len(cb) > 1 and (refined := _refine_then_merge(w, node, src, dst, ca, cb, d, var)) is not None:
            dims[refined[0]] = refined[1]
        elif d != ca[0]:
            raise ShardingConflict(f"{describe(node)}: the sharded dim is not the outer one of a merge", lay.origins(), (var,))
        elif len(cb) == 1:
            merged = _carrying_choice(DimVar(dst[cb[0]], var.find().origins), var)
            dims[cb[0]] = merged
            if not _note_broadcast_merge(w, node.args[0], ca[1:], merged, var):
                follow(merged, var, describe(node))
            else:
                set_groups(merged, var.find().size, describe(node))
        else:
            dims[cb[0]] = _regroup(node, var, dst[cb[0]])
    dims.update(_unit_dims_kept(node, lay, src, dst, dims))
    return shard(dims)


def _carrying_choice(merged: DimVar, var: DimVar) -> DimVar:
    """A dim merged from split ``var`` carries the reshape choice that put the split on ``var``
    (``DimVar.made_by``): a conflict on the merged dim may be answered there."""
    if merged.find().made_by is None:
        merged.find().made_by = var.find().made_by
    return merged


def _unit_dims_kept(node: Node, lay: Layout, src: tuple[int, ...], dst: tuple[int, ...], taken: dict[int, DimVar]) -> dict[int, DimVar]:
    """A split size-1 dim (one KV head every rank holds whole) lands on the size-1 output
    dim with as many elements before it. None left is a conflict: every rank holds the
    whole tensor, but its gradient is summed over the ranks as if each used it for its
    own slice (``shape_rules.drop_unit_dims``)."""
    kept: dict[int, DimVar] = {}
    for d, var in lay.dims:
        if src[d] != 1:
            continue
        before = math.prod(src[:d])
        at = next((j for j, n in enumerate(dst) if n == 1 and j not in taken and j not in kept and math.prod(dst[:j]) == before), None)
        if at is None:
            raise ShardingConflict(f"{describe(node)}: drops a split size-1 dim", lay.origins(), (var,))
        kept[at] = var
    return kept


def _units_before(dst: tuple[int, ...], at: int, dims_taken: list[int]) -> list[int]:
    """The size-1 output dims right before ``at`` that no chunk of the reshape holds."""
    units = []
    d = at - 1
    while d >= 0 and dst[d] == 1 and d not in dims_taken:
        units.insert(0, d)
        d -= 1
    return units


def _split(w: Walker, node: Node, var: DimVar, sizes: list[int]) -> tuple[int, DimVar]:
    """``[n] -> sizes``: the factor that carries the split (see the module doc) and its var.
    A size-1 factor (every rank holds the whole, a replicated block) comes last. A tiled
    dim (``layouts.tile``) split back into its tiles keeps the split on its inner factors."""
    tiled = _tiled_inner(w, node, var, sizes)
    if tiled is not None:
        return tiled
    avoid = w.avoid.get(node.name, frozenset())
    allowed = [i for i, f in enumerate(sizes) if i not in avoid]
    if not allowed:
        raise ShardingConflict(f"{describe(node)}: no factor of the reshape can stay sharded", var.find().origins)
    fits = [i for i in allowed if sizes[i] % w.tp == 0 or w.tp % sizes[i] == 0]
    at = next((i for i in fits if sizes[i] > 1), fits[0] if fits else allowed[0])
    whole = False
    if w.plan is not None:  # the plan's split says which factor was chosen
        fixed = resolve(var, w.tp)
        at = next((i for i in allowed if _matches(fixed, sizes, i)), at)
        # held whole with no size-1 factor to carry it: whichever factor carries it is whole too
        whole = all(g == 1 for g in fixed.groups) and sizes[at] != 1
    where = describe(node)
    out = DimVar(sizes[at], var.find().origins)
    set_groups(out, 1 if whole else sizes[at], where)
    if whole:
        out.fixed = DimSharding(sizes[at], (sizes[at],), (1,), axis=var.find().axis)
    out.made_by = (node.name, at)
    outer = math.prod(sizes[:at])
    for part in set_segments(var, [var.find().size // outer] * outer, where) if outer > 1 else (var,):
        follow(part, out, where)
    return at, out


def _matches(fixed: DimSharding, sizes: list[int], at: int) -> bool:
    """Whether the plan's split ``fixed`` can come from splitting factor ``at`` of ``sizes``:
    the factors outside it whole on every rank (each of the outer ones a segment), blocks
    made of whole inner elements."""
    outer, inner = math.prod(sizes[:at]), math.prod(sizes[at + 1 :])
    if all(g == 1 for g in fixed.groups):  # every rank holds all of it: the size-1 factor
        return sizes[at] == 1
    if fixed.padded or (outer > 1 and list(fixed.segments) != [fixed.size // outer] * outer):
        return False
    return all(seg % g == 0 and (seg // g) % inner == 0 for seg, g in zip(fixed.segments, fixed.groups))


def _regroup(node: Node, var: DimVar, m0: int) -> DimVar:
    """``[n0, ...] -> [m0, ...]`` with the split on n0: the split moves to m0."""
    n0, where = var.find().size, describe(node)
    if n0 % m0 and m0 % n0:
        raise ShardingConflict(f"{where}: reshape regroups a sharded dim of {n0} into {m0}", var.find().origins, (var,))
    out = DimVar(m0, var.find().origins)
    out.made_by = var.find().made_by
    if n0 % m0 == 0:
        follow(var, out, where)  # each output element holds n0/m0 whole input elements
    else:
        set_groups(out, n0, where)
        follow(out, var, where)
    return out


def _refine_then_merge(
    w: Walker, node: Node, src: tuple[int, ...], dst: tuple[int, ...], ca: list[int], cb: list[int], d: int, var: DimVar
) -> tuple[int, DimVar] | None:
    """Runs of several dims on both sides (``[B, H*D] -> [B*H, D]``, torch's MultiheadAttention)
    as two reshapes through their common refinement (``[B, H, D]``): the sharded dim ``d`` splits
    into its factors, and the one carrying the split lands alone on an output dim or as the
    inner factor of a merge (``layouts.tile``). None where the runs have no common refinement."""
    where = describe(node)
    src_cuts, dst_cuts = (list(itertools.accumulate((shape[i] for i in run), operator.mul)) for shape, run in ((src, ca), (dst, cb)))
    cuts = [1, *sorted(set(src_cuts) | set(dst_cuts))]
    if any(b % a for a, b in zip(cuts, cuts[1:])):
        return None
    mid = [b // a for a, b in zip(cuts, cuts[1:])]
    k = ca.index(d)
    first, last = cuts.index(src_cuts[k - 1] if k else 1), cuts.index(src_cuts[k]) - 1  # d's factors in mid
    if first == last:
        g, out = first, var
    else:
        at, out = _split(w, node, var, mid[first : last + 1])
        g = first + at
    for j, upper in enumerate(dst_cuts):
        lo, hi = cuts.index(dst_cuts[j - 1] if j else 1), cuts.index(upper) - 1
        if lo <= g <= hi:
            if lo == g == hi:
                return cb[j], out
            if lo == g:  # the split factor is the outer one of the merge (heads into features)
                merged = DimVar(dst[cb[j]], out.find().origins)
                follow(merged, out, where)
                return cb[j], merged
            if g == hi:
                return cb[j], tile(out, math.prod(mid[lo:g]), where)
            raise ShardingConflict(f"{where}: the sharded factor is not the inner one of a merge", var.find().origins, (out,))
    return None


def _tiled(var: DimVar) -> bool:
    """Whether ``var`` is a ``layouts.tile``d dim: two or more segments that are all one sharded var."""
    r = var.find()
    return r.segments is not None and len(r.segments) > 1 and len({seg.find() for seg in r.segments}) == 1


def _tiled_inner(w: Walker, node: Node, var: DimVar, sizes: list[int]) -> tuple[int, DimVar] | None:
    """For a reshape of a ``layouts.tile``d dim (``count`` segments split alike) into factors whose
    outer ones multiply to ``count`` (``[B*T*H] -> [B, T, H]``, the inverse of the tiling
    merge): the output factor that carries the split and its var, else None. The outer
    factors index the tiles and stay whole; the inner ones split the shared var."""
    r = var.find()
    if not _tiled(var) or len(sizes) < 2:
        return None
    assert r.segments is not None
    shared = r.segments[0].find()
    outer = list(itertools.accumulate(sizes, operator.mul))
    if len(r.segments) not in outer[:-1]:
        return None
    k = outer.index(len(r.segments)) + 1
    if math.prod(sizes[k:]) != shared.size:
        return None
    if k == len(sizes) - 1:
        return k, shared
    at, out = _split(w, node, shared, sizes[k:])
    return k + at, out


def _unit_dims_view(view: ParamView, src: tuple[int, ...], dst: tuple[int, ...]) -> ParamView | None:
    """An undecided parameter reshaped by adding or dropping size-1 dims only
    (``scale.view(1, heads, 1, 1)``) stays undecided; None for any other reshape."""
    kept = [i for i, s in enumerate(src) if s != 1]
    if [src[i] for i in kept] != [s for s in dst if s != 1]:
        return None
    real = iter(kept)
    return ParamView(view.name, tuple(None if s == 1 else view.dim_map[next(real)] for s in dst))


def _factor_view(view: ParamView, src: tuple[int, ...], dst: tuple[int, ...]) -> ParamView | None:
    """An undecided parameter whose reshape cuts dims into factors (and keeps the others)
    stays undecided: the outermost factor stands for the parameter dim, in blocks of the
    inner factors; the inner factors are never split. None for any other reshape."""
    chunks = reshape_chunks(src, dst)
    if chunks is None or any(len(ca) != 1 or not isinstance(view.dim_map[ca[0]], (int, type(None))) for ca, _ in chunks):
        return None
    dim_map: list[int | tuple[int, int] | None] = [None] * len(dst)
    for (a,), cb in chunks:
        pdim = view.dim_map[a]
        if pdim is not None:
            dim_map[cb[0]] = pdim if len(cb) == 1 else (pdim, src[a] // dst[cb[0]])  # type: ignore[assignment]
    return ParamView(view.name, tuple(dim_map))


def _merged_view(view: ParamView, src: tuple[int, ...], dst: tuple[int, ...]) -> ParamView | None:
    """An undecided parameter whose reshape merges dims (``qkv_w.flatten(0, 1)`` of a stacked
    ``[3, H*D, D]`` weight, experts ``[E, I, H] -> [E*I, H]``) and keeps the others stays
    undecided: a merged dim may be split only on its innermost parameter dim, which it tiles
    (``Tiled``; the outer ones stay whole). None for any other reshape."""
    chunks = reshape_chunks(src, dst)
    if chunks is None or any(len(cb) != 1 or not all(isinstance(view.dim_map[a], int) for a in ca) for ca, cb in chunks if len(ca) > 1):
        return None
    if any(len(ca) == 1 and (len(cb) != 1 or isinstance(view.dim_map[ca[0]], tuple)) for ca, cb in chunks):
        return None
    dim_map: list[int | tuple[int, int] | Tiled | None] = [None] * len(dst)
    for ca, (b,) in chunks:
        inner = view.dim_map[ca[-1]]
        dim_map[b] = inner if len(ca) == 1 else Tiled(inner, math.prod(src[a] for a in ca[:-1]))  # type: ignore[arg-type]
    return ParamView(view.name, tuple(dim_map))


def _note_broadcast_merge(w: Walker, src: Node, inner_dims: list[int], merged: DimVar, outer: DimVar) -> bool:
    """``repeat_kv``: an expand whose broadcast dims are merged into a sharded dim; each
    rank may hold part of the repeats. False when the inner dims are data."""
    producer = src
    while producer.target in (aten.clone.default, aten.contiguous.default) and isinstance(producer.args[0], Node):
        producer = producer.args[0]
    if producer.target is aten.expand.default and len(inner_dims) == 1:
        w.out.expand_fixups.setdefault(producer, []).append((inner_dims[0], merged, outer))
        return True
    return False


def view_as_complex(w: Walker, node: Node) -> Any:
    """``[..., n, 2]`` reals -> ``[..., n]`` complex: the pair dim must be whole."""
    lay = w.concrete(node.args[0], node)
    nd = len(shape_of(node) or ())
    if lay.var_at(nd) is not None:
        raise ShardingConflict(f"{describe(node)}: the real/imaginary pair dim is sharded", lay.origins())
    return lay


def reshape_as(w: Walker, node: Node) -> Any:
    """``x.view_as(other)``, ``x.reshape_as(other)``: a reshape to other's shape. The rank's
    ``other`` has its local shape, so the output is split exactly where other is."""
    w.concrete(node.args[0], node)
    out = reshape(w, node)
    like = w.concrete(node.args[1], node)
    like_dims = {} if like.partial else dict(like.dims)
    out_dims = {} if out.partial else dict(out.dims)
    if like_dims.keys() != out_dims.keys():
        origins = frozenset().union(*(v.find().origins for v in [*like_dims.values(), *out_dims.values()]))
        raise ShardingConflict(f"{describe(node)}: the reshaped tensor and the one it takes its shape from are split on different dims", origins)
    for d, var in out_dims.items():
        unify(var, like_dims[d], describe(node))
    return out


def view_as_real(w: Walker, node: Node) -> Any:
    """``[..., n]`` complex -> ``[..., n, 2]`` reals: every dim keeps its split."""
    return w.concrete(node.args[0], node)


def repeat(w: Walker, node: Node) -> Any:
    """``x.repeat(*reps)`` tiles every dim ``r`` times (JetMoE's key heads repeated for each
    attention expert): along a split dim each rank tiles its own part, which is the output
    dim as ``r`` segments each split as the input (``layouts.tile``); the rank's repeat counts stay."""
    x = node.args[0]
    lay = w.summed(x, node)
    if not lay.dims:
        return lay
    reps = list(node.args[1])
    off = len(reps) - len(shape_of(x) or ())
    return shard({d + off: var if reps[d + off] == 1 else tile(var, reps[d + off], describe(node)) for d, var in lay.dims})


def repeat_interleave(w: Walker, node: Node) -> Any:
    """``x.repeat_interleave(r, dim)``: along a sharded dim each rank repeats its own
    elements (GQA's key/value heads), ``r * local(x) / local(out)`` times fewer when the
    output is split finer than the repeats (``Propagation.repeat_fixups``)."""
    x = node.args[0]
    lay = w.concrete(x, node)
    src = shape_of(x) or ()
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if lay.partial or not lay.dims:
        return lay
    if dim is None:
        raise ShardingConflict(f"{describe(node)}: repeat_interleave flattens a sharded tensor", lay.origins())
    d = norm_dim(dim, len(src))
    var = lay.var_at(d)
    if var is None:
        return lay
    out_size = (shape_of(node) or ())[d]
    merged = DimVar(out_size, var.find().origins)
    set_groups(merged, var.find().size, describe(node))
    w.out.repeat_fixups[node] = (merged, var)
    return shard({**dict(lay.dims), d: merged})
