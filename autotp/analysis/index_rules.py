"""Layout rules of indexing ops: ``index`` (``x[idx]``), ``index_select``, ``gather``,
and the writes ``index_put`` (``y[idx] += v``), ``index_add``, ``scatter`` and
``scatter_add``.

The indexed dim (``dim``, or the dims ``indices`` cover) must be whole on every rank,
unless the index is a constant run of consecutive positions: that is a slice of it
(``select_range``). Every other dim keeps its split. Operands that meet along a dim agree on it: a sharded
dim of one is the same split in the others (``unify``), a replicated operand of full size
is read through the rank's slice (``Propagation.local_slices``) and a size-1 dim
broadcasts. Index tensors are never sharded by a layout of their own, only sliced.

An undecided parameter indexed along whole dims by replicated indices (``w1[expert_ids]``,
each token's expert weights) stays undecided: a view whose gathered dims split nothing and
whose other dims its first matmul may split, as ``select`` does for one expert.

An integer index of a 2-D parameter's rows made from the inputs and constants alone
(``table[ids]``, ``index_select(table, 0, ids)``: position tables, relative-position
buckets, token types) is an embedding lookup: the table may become vocab-parallel
(``sharding_policy.row_lookup``).

Advanced indexing is elementwise over the indices' broadcast shape: an index tensor split
along one of its dims splits the result's matching dim, the indexed tensor whole along the
dims indexed (Informer's top queries per head, ``q[b, h, top]`` with ``top`` split on the
heads). An index that enumerates a dim in order (``arange(n)`` laid along one broadcast dim,
``x[arange(B)[:, None, None], arange(H)[None, :, None], top]``) reads that dim in place: a
split there carries into the result, the index becomes the rank's local ``arange``
(``meta_keys.IDENTITY_INDICES``).

Writes are linear in the written tensor and the values jointly: both partial give a
partial result; any other partial operand is all-reduced first.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from autotp.analysis.propagation_result import ParamView
from autotp.analysis.shapes import norm_dim, schema_arg, shape_of, sources
from autotp.analysis.sharding_policy import row_lookup
from autotp.ir.errors import describe
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, Layout, ShardingConflict, select_range, shard, unify
from autotp.ir.op_facts import op_name

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

aten = torch.ops.aten
_COPIES = (aten.lift_fresh_copy.default, aten.clone.default, aten._to_copy.default, aten.detach.default, aten.alias.default)
_SHAPE_ONLY = (*_COPIES, aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _index_positions(src: tuple[int, ...], indexed: list[int], out_ndim: int) -> dict[int, int]:
    """Where advanced indexing puts each non-indexed dim of ``src`` in its result."""
    index_ndim = out_ndim - (len(src) - len(indexed))
    kept = [d for d in range(len(src)) if d not in indexed]
    if indexed == list(range(indexed[0], indexed[-1] + 1)):  # adjacent: the index dims stay in place
        return {d: (d if d < indexed[0] else d - len(indexed) + index_ndim) for d in kept}
    return {d: index_ndim + kept.index(d) for d in kept}  # apart: the index dims go first


def _indices_replicated(w: Walker, node: Node, indices: list[Any]) -> None:
    for i in indices:
        if isinstance(i, Node) and not w.concrete(i, node).replicated:
            raise ShardingConflict(f"{describe(node)}: sharded index tensor", w.get(i).origins())


def align(w: Walker, node: Node, dims: dict[int, DimVar], operands: list[tuple[Node, dict[int, int]]]) -> None:
    """Make each operand agree with the split ``dims`` (output dim -> var); ``dim_map`` maps
    an output dim to the operand's dim (aligned dims absent from it are not read)."""
    for t, dim_map in operands:
        if not isinstance(t, Node):
            continue
        lay = w.concrete(t, node)
        shape = shape_of(t) or ()
        for od, var in dims.items():
            d = dim_map.get(od)
            if d is None or d >= len(shape) or shape[d] == 1:
                continue
            if lay.var_at(d) is not None:
                unify(lay.var_at(d), var, describe(node))
            elif lay.replicated and not var.find().padded and shape[d] == var.find().size:
                w.out.local_slices.setdefault(node, []).append((t, d, var))
            else:
                raise ShardingConflict(f"{describe(node)}: an operand of {describe(t)} is whole along a sharded dim", var.find().origins, (var,))
        covered = {dim_map.get(od) for od in dims}
        for d, v in lay.dims:
            if d not in covered:
                raise ShardingConflict(f"{describe(node)}: {describe(t)} is sharded along a dim the result does not keep", v.find().origins, (v,))


def _sharded_dims(lays: list[Layout], maps: list[dict[int, int]], where: str) -> dict[int, DimVar]:
    """The output dims that some operand shards (through each operand's output->own dim map)."""
    dims: dict[int, DimVar] = {}
    for lay, dim_map in zip(lays, maps):
        back = {d: od for od, d in dim_map.items()}
        for d, v in lay.dims:
            if d in back:
                od = back[d]
                dims[od] = unify(dims[od], v, where) if od in dims else v
    return dims


def _constant_range(w: Walker, idx: Any, size: int) -> tuple[int, int] | None:
    """``[start, stop)`` when ``idx`` is a constant 1-D index of consecutive positions
    (Falcon's ``fused[..., [-2], :]``), else None."""
    while isinstance(idx, Node) and idx.op == "call_function" and idx.target in _COPIES:
        idx = idx.args[0]
    if not isinstance(idx, Node) or idx.op != "get_attr":
        return None
    try:
        value = functools.reduce(getattr, str(idx.target).split("."), w.gm)
    except AttributeError:
        return None
    if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.is_meta or value.dim() != 1 or value.is_floating_point():
        return None
    positions = [int(v) % size for v in value.tolist()]
    if not positions or positions != list(range(positions[0], positions[0] + len(positions))):
        return None
    return positions[0], positions[0] + len(positions)


def _as_slice(w: Walker, node: Node, lay: Layout, dim: int, idx: Any) -> Layout | None:
    """An index of a sharded dim by a constant run of positions: a slice of it (the rank
    graph takes the local slice, ``meta_keys.INDEX_AS_SLICE``)."""
    var = lay.var_at(dim)
    found = _constant_range(w, idx, var.find().size) if var is not None else None
    if found is None:
        return None
    part = select_range(var, found[0], found[1], describe(node))
    w.out.slice_fixups[node] = (var, part, found[0])
    w.out.index_slices[node] = dim
    return shard({**dict(lay.dims), dim: part})


def _table_rows(w: Walker, x: Any, idx: Any) -> bool:
    """Whether ``x[idx]`` along dim 0 looks up rows of a 2-D parameter by an integer tensor
    made from the inputs and constants alone (token, position, bucket ids; not the rows of
    the experts a router picked, whose consumer wants them split as the experts are), the
    table undecided or vocab-parallel: an embedding lookup (``row_lookup``)."""
    if not (isinstance(x, Node) and x.op == "get_attr" and str(x.target) in w.params and isinstance(idx, Node)):
        return False
    name, ids = str(x.target), idx.meta.get("val")
    if w.params[name].dim() != 2 or not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        return False
    if any(n.op == "get_attr" and str(n.target) in w.params for n in sources(idx)):
        return False
    if isinstance(w.get(x), ParamView):
        return True
    decided = w.plan.layout_of(name) if w.plan is not None else w.out.decisions.get(name)
    return decided is not None and decided.kind == "vocab"


def _gathered_view(w: Walker, node: Node, view: Any, indexed: list[int], indices: list[Any]) -> ParamView | None:
    """An undecided parameter's entries gathered along whole dims by replicated indices (each
    token's expert weights, ``w1[expert_ids]``): a view of the parameter whose other dims
    its first matmul may still split; the gathered dims split nothing."""
    if not isinstance(view, ParamView) or not indexed or any(not isinstance(view.dim_map[d], int) for d in indexed):
        return None
    _indices_replicated(w, node, indices)
    out_ndim = len(shape_of(node) or ())
    where = _index_positions(tuple(range(len(view.dim_map))), indexed, out_ndim)
    dim_map: list[Any] = [None] * out_ndim
    for d, p in enumerate(view.dim_map):
        if d not in indexed:
            dim_map[where[d]] = p
    return ParamView(view.name, tuple(dim_map))


def index(w: Walker, node: Node) -> Any:
    """``x[..., idx, ...]`` (``None`` entries are whole dims)."""
    x, indices = node.args[0], list(node.args[1])
    if len(indices) == 1 and _table_rows(w, x, indices[0]):
        return row_lookup(w, node, x, indices[0])
    gathered = _gathered_view(w, node, w.get(x), [d for d, i in enumerate(indices) if i is not None], indices)
    if gathered is not None:
        return gathered
    lay = w.concrete(x, node)
    indexed = [d for d, i in enumerate(indices) if i is not None]
    if lay.partial or not indexed:
        _indices_replicated(w, node, indices)
        return lay
    if len(indexed) == 1 and lay.var_at(indexed[0]) is not None and w.concrete(indices[indexed[0]], node).replicated:
        sliced = _as_slice(w, node, lay, indexed[0], indices[indexed[0]])
        if sliced is not None:
            return sliced
    where = _index_positions(shape_of(x) or (), indexed, len(shape_of(node) or ()))
    dims = {where[d]: v for d, v in lay.dims if d not in indexed}
    dims.update(_selected_dims(w, node, x, lay, indices))
    return shard(dims)


def _selected_dims(w: Walker, node: Node, x: Node, lay: Layout, indices: list[Any], in_place: bool = False) -> dict[int, DimVar]:
    """The splits of the index dims of ``x[indices]`` (the indices' broadcast shape, placed
    as advanced indexing places it): an index tensor's own splits, and the split of a dim of
    ``x`` that an enumerating index reads in place. A split dim of ``x`` any other index
    reads raises a conflict; so does, for a write (``in_place``), an index tensor split where
    ``x`` is not: each rank would write its own positions of a whole tensor."""
    indexed = [d for d, i in enumerate(indices) if i is not None]
    broadcast = max(len(shape_of(indices[d]) or ()) for d in indexed)
    first = indexed[0] if indexed == list(range(indexed[0], indexed[-1] + 1)) else 0
    enumerating = {d: _enumerated_position(indices[d], (shape_of(x) or ())[d], broadcast) for d in indexed}
    dims: dict[int, DimVar] = {}
    placed: set[int] = set()
    for d in indexed:
        var, p = lay.var_at(d), enumerating[d]
        if var is None:
            continue
        if p is None:
            raise ShardingConflict(f"{describe(node)}: indexes a sharded dim", lay.origins(), (var,))
        dims[first + p] = unify(dims[first + p], var, describe(node)) if first + p in dims else var
        placed.add(first + p)
        w.out.identity_indices.setdefault(node, []).append((d, var))
    for d in indexed:
        ilay = w.summed(indices[d], node)
        off = broadcast - len(shape_of(indices[d]) or ())
        for q, var in ilay.dims:
            at = first + off + q
            dims[at] = unify(dims[at], var, describe(node)) if at in dims else var
    unplaced = tuple(v for at, v in dims.items() if at not in placed)
    if in_place and unplaced:
        raise ShardingConflict(f"{describe(node)}: writes at a sharded index tensor's positions", frozenset().union(*(v.find().origins for v in unplaced)), unplaced)
    align(w, node, {at - first: v for at, v in dims.items()}, [(indices[d], _broadcast_map(indices[d], broadcast)) for d in indexed if enumerating[d] is None or lay.var_at(d) is None])
    return dims


def _broadcast_map(idx: Any, broadcast: int) -> dict[int, int]:
    """An index tensor's own dim for each dim of the indices' broadcast shape it spans."""
    ndim = len(shape_of(idx) or ()) if isinstance(idx, Node) else 0
    return {broadcast - ndim + q: q for q in range(ndim)}


def _enumerated_position(idx: Any, size: int, broadcast: int) -> int | None:
    """The dim of the indices' broadcast shape along which ``idx`` is ``arange(size)`` (every
    other dim of it of size 1), or None."""
    if not isinstance(idx, Node):
        return None
    shape = shape_of(idx) or ()
    spans = [q for q, n in enumerate(shape) if n != 1]
    if len(spans) != 1 or shape[spans[0]] != size:
        return None
    n = idx
    while n.op == "call_function" and n.target in _SHAPE_ONLY and isinstance(n.args[0], Node):
        n = n.args[0]
    if n.op != "call_function" or n.target not in _ARANGES:
        return None
    bounds = [a for a in n.args if not isinstance(a, Node)]
    if bounds not in ([size], [0, size], [0, size, 1]):
        return None
    return broadcast - len(shape) + spans[0]


def index_select(w: Walker, node: Node) -> Any:
    x, dim, idx = node.args[0], node.args[1], node.args[2]
    d = norm_dim(dim, len(shape_of(x) or ()))
    if d == 0 and _table_rows(w, x, idx):
        return row_lookup(w, node, x, idx)
    view = w.get(x)
    if isinstance(view, ParamView) and isinstance(view.dim_map[d], int):
        _indices_replicated(w, node, [idx])
        return ParamView(view.name, view.dim_map[:d] + (None,) + view.dim_map[d + 1 :])
    lay = w.concrete(x, node)
    _indices_replicated(w, node, [idx])
    if lay.var_at(d) is not None:
        sliced = _as_slice(w, node, lay, d, idx)
        if sliced is not None:
            return sliced
        raise ShardingConflict(f"{describe(node)}: selects rows of a sharded dim", lay.origins(), (lay.var_at(d),))
    return lay


def gather(w: Walker, node: Node) -> Any:
    """``torch.gather(x, dim, index)``: the result has the index's shape and reads x at the
    same position along every other dim."""
    x, dim, idx = node.args[0], node.args[1], node.args[2]
    nd = len(shape_of(node) or ())
    d = norm_dim(dim, nd)
    lays = [w.concrete(x, node), w.concrete(idx, node)]
    w.reduce_first(node, [x])
    lays[0] = REPLICATE if lays[0].partial else lays[0]
    if all(l.replicated for l in lays):
        return REPLICATE
    same = {i: i for i in range(nd) if i != d}
    dims = _sharded_dims(lays, [same, same], describe(node))
    if lays[0].var_at(d) is not None or lays[1].var_at(d) is not None:
        raise ShardingConflict(f"{describe(node)}: gathers along a sharded dim", lays[0].origins() | lays[1].origins())
    xs, out = shape_of(x) or (), shape_of(node) or ()
    for od, var in dims.items():
        if xs[od] != out[od]:
            raise ShardingConflict(f"{describe(node)}: the index covers part of a sharded dim", var.find().origins, (var,))
    align(w, node, dims, [(x, same), (idx, same)])
    return shard(dims)


def scatter(w: Walker, node: Node) -> Any:
    """``x.scatter(dim, index, src)`` (and ``scatter_add``, a scalar ``value``): the result
    is x's; index and src are read at the same position along every other dim."""
    return _scatter(w, node, linear=True)


def scatter_reduce(w: Walker, node: Node) -> Any:
    """``x.scatter_reduce(dim, index, src, reduce)``: scatter's layout (a softmax over each graph
    node's edges takes its max and sum so); partial sums stay partial only under ``sum``."""
    return _scatter(w, node, linear=schema_arg(node, "reduce") == "sum")


def _scatter(w: Walker, node: Node, linear: bool) -> Any:
    x, dim, idx = node.args[0], node.args[1], node.args[2]
    src = node.args[3] if len(node.args) > 3 and isinstance(node.args[3], Node) else None
    nd = len(shape_of(node) or ())
    d = norm_dim(dim, nd)
    operands = [t for t in (x, idx, src) if isinstance(t, Node)]
    if not linear:
        w.reduce_first(node, [t for t in (x, src) if isinstance(t, Node)])
    lays = [w.concrete(t, node) for t in operands]
    if linear and _linear_write(w, node, [x, src]):
        return PARTIAL
    lays = [REPLICATE if l.partial else l for l in lays]
    if all(l.replicated for l in lays):
        return REPLICATE
    same = {i: i for i in range(nd) if i != d}
    dims = _sharded_dims(lays, [same] * len(operands), describe(node))
    if any(l.var_at(d) is not None for l in lays):
        raise ShardingConflict(f"{describe(node)}: scatters along a sharded dim", frozenset().union(*(l.origins() for l in lays)))
    align(w, node, dims, [(t, same) for t in operands])
    return shard(dims)


def index_add(w: Walker, node: Node) -> Any:
    """``x.index_add(dim, index, source)``: rows of source added into rows of x (``index_reduce``:
    reduced into them; partial sums stay partial only when added)."""
    x, dim, idx, source = node.args[0], node.args[1], node.args[2], node.args[3]
    nd = len(shape_of(node) or ())
    d = norm_dim(dim, nd)
    _indices_replicated(w, node, [idx])
    if op_name(node.target) == "index_reduce":
        w.reduce_first(node, [x, source])
    elif _linear_write(w, node, [x, source]):
        return PARTIAL
    lays = [w.concrete(t, node) for t in (x, source)]
    lays = [REPLICATE if l.partial else l for l in lays]
    if all(l.replicated for l in lays):
        return REPLICATE
    same = {i: i for i in range(nd) if i != d}
    dims = _sharded_dims(lays, [same, same], describe(node))
    if any(l.var_at(d) is not None for l in lays):
        raise ShardingConflict(f"{describe(node)}: adds rows along a sharded dim", lays[0].origins() | lays[1].origins())
    align(w, node, dims, [(x, same), (source, same)])
    return shard(dims)


def index_put(w: Walker, node: Node) -> Any:
    """``x[indices] = values`` (``+=`` with ``accumulate``): values are laid out like
    ``x[indices]`` (``index``), aligned from the right."""
    x, indices, values = node.args[0], list(node.args[1]), node.args[2]
    if all(w.concrete(i, node).replicated for i in indices if isinstance(i, Node)) and _linear_write(w, node, [x, values]):
        return PARTIAL
    w.reduce_first(node, [x, values])
    lx, lv = (REPLICATE if l.partial else l for l in (w.concrete(x, node), w.concrete(values, node)))
    src = shape_of(x) or ()
    indexed = [d for d, i in enumerate(indices) if i is not None]
    selected = _selected_dims(w, node, x, lx, indices, in_place=True) if indexed else {}
    selected_ndim = len(src) - len(indexed) + max((len(shape_of(i) or ()) for i in indices if isinstance(i, Node)), default=0)
    where = _index_positions(src, indexed, selected_ndim) if indexed else {d: d for d in range(len(src))}
    off = selected_ndim - len(shape_of(values) or ())
    x_map = {d: d for d in range(len(src))}
    v_map = {d: where[d] - off for d in where if where[d] - off >= 0}
    dims = _sharded_dims([lx, lv], [x_map, v_map], describe(node))
    align(w, node, dims, [(x, x_map)])
    value_dims = {where[d] - off: v for d, v in dims.items() if d in where and where[d] >= off}
    value_dims.update({at - off: v for at, v in selected.items() if at >= off})
    align(w, node, value_dims, [(values, {d: d for d in value_dims})])
    return shard(dims)


def _linear_write(w: Walker, node: Node, operands: list[Any]) -> bool:
    """Whether a write of partial values into a partial tensor stays partial (a write, or an
    add, of the sums is the sum of the writes); otherwise partial operands are all-reduced
    first."""
    lays = [w.concrete(t, node) if isinstance(t, Node) else REPLICATE for t in operands]
    if all(l == PARTIAL for l in lays):
        return True
    w.reduce_first(node, [t for t in operands if isinstance(t, Node)])
    return False
