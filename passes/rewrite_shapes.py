"""Rewrite the shape constants that sharding changes (views, expands, ``new_*`` and factory sizes, split sizes,
slice bounds, ``as_strided`` sizes and strides, ``repeat_interleave`` counts, the ``groups`` of a grouped convolution and
of a group norm).

``torch.export`` bakes concrete sizes into ``view``/``reshape``/``expand`` arguments,
some of which count heads or hidden features. Every dim that the layout pass marked as
sharded gets its per-rank size (``autotp.analysis.local_shapes``); ``-1`` entries are
left to be inferred.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autotp.analysis.local_shapes import local_sizes, local_slice_bounds, local_tensors
from autotp.ir import meta_keys
from autotp.ir.op_facts import CONVOLUTIONS
from autotp.analysis.shapes import adds_nothing_to_cat, contiguous_strides, schema_arg, shape_of, strided_walk
from autotp.analysis.value_rules import UNIFORM_FACTORIES
from autotp.ir.layouts import Layout, local_size
from autotp.passes.mask_padding import zero_spans
from autotp.passes.runner import PassContext

aten = torch.ops.aten
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
              aten.broadcast_to.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
              aten.new_full.default}
_SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def rewrite_shapes(gm: GraphModule, ctx: PassContext) -> GraphModule:
    tp = ctx.plan.tp
    gathered = {g.tensor for g in ctx.plan.gathered}

    def read_layout(x: Node) -> object:
        """The layout in which a reader gets ``x``: whole where the plan gathers it
        (``passes/gather_activations``, later), else the layout ``x`` was computed in."""
        return None if x.name in gathered else x.meta.get(meta_keys.LAYOUT)

    for node in gm.graph.nodes:
        lay = node.meta.get(meta_keys.LAYOUT)
        if node.target in _SHAPE_OPS:
            local = local_sizes(node, tp, lay if isinstance(lay, Layout) else None)
            if not local:
                continue
            shape = [local[d] if d in local and s != -1 else s for d, s in enumerate(node.args[1])]
            node.args = (node.args[0], shape, *node.args[2:])
        elif node.target in UNIFORM_FACTORIES:
            local = local_sizes(node, tp, lay if isinstance(lay, Layout) else None)
            if local:
                node.args = ([local.get(d, s) for d, s in enumerate(node.args[0])], *node.args[1:])
        elif node.target is aten.unflatten.int:
            local = local_sizes(node, tp, lay if isinstance(lay, Layout) else None)
            x, dim, sizes = node.args[0], node.args[1], node.args[2]
            dim = dim + x.meta["val"].dim() if dim < 0 else dim
            node.args = (x, node.args[1], [local.get(dim + i, s) if s != -1 else s for i, s in enumerate(sizes)])
        elif meta_keys.REPEAT_FIXUP in node.meta:
            out, source = node.meta[meta_keys.REPEAT_FIXUP]
            repeats = local_size(out, tp) // local_size(source, tp)
            node.args = (node.args[0], repeats, *node.args[2:3])
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}
        elif node.target is aten.as_strided.default and isinstance(src := read_layout(node.args[0]), Layout) and src.dims:
            _local_strides(node, src, tp)
        elif node.target in CONVOLUTIONS:
            _local_groups(node, read_layout(node.args[0]), node.args[1].meta.get(meta_keys.LAYOUT), tp)
        elif node.target is aten.group_norm.default and isinstance(src := read_layout(node.args[0]), Layout) and src.var_at(1):
            # each rank holds whole groups of its channels (``statistic_rules.group_norm``)
            channels = node.args[0].meta["val"].shape[1]
            node.args = (node.args[0], node.args[1] * local_size(src.var_at(1), tp) // channels, *node.args[2:])
        elif meta_keys.INDEX_AS_SLICE in node.meta:
            start, end = local_slice_bounds(node, tp)
            node.target, node.args, node.kwargs = aten.slice.Tensor, (node.args[0], node.meta[meta_keys.INDEX_AS_SLICE], start, end), {}
        elif meta_keys.IDENTITY_INDICES in node.meta:
            _local_aranges(gm, node, tp)
        elif meta_keys.SLICE_FIXUP in node.meta:
            start, end = local_slice_bounds(node, tp)
            node.args = (node.args[0], node.args[1], start, end, *node.args[4:])
        elif meta_keys.PADDING_SLICE in node.meta:
            _zero_the_dropped_end(gm, node, ctx.tp_rank, tp)
        elif node.target is aten.cat.default and isinstance(lay, Layout) and lay.dims:
            _drop_empty_parts(node)
        elif node.target in _SPLIT_OPS and isinstance(lay, tuple):
            src = read_layout(node.args[0])
            ndim = node.args[0].meta["val"].dim()
            d = node.args[2] if len(node.args) > 2 else 0
            d = d + ndim if d < 0 else d
            if not isinstance(src, Layout) or src.var_at(d) is None:
                continue
            sizes = [t.shape[d] for t in local_tensors(node, tp)]
            if len(set(sizes)) == 1 and node.target is aten.split.Tensor:
                node.args = (node.args[0], sizes[0], d)
            elif len(set(sizes)) == 1 and node.target is aten.chunk.default:
                continue
            else:
                node.target = aten.split_with_sizes.default
                node.args = (node.args[0], sizes, d)
    return gm


def _drop_empty_parts(node: Node) -> None:
    """A split ``cat`` leaves out its inputs empty along the cat dim (an empty cache made by
    ``torch.empty(b, 0, dim)``): ``shape_rules.cat`` gave them no layout, so their other dims
    keep the model's sizes, which the rank's parts no longer have."""
    parts, d = list(node.args[0]), node.args[1] if len(node.args) > 1 else 0
    d = d + node.meta["val"].dim() if d < 0 else d
    dtype = node.meta["val"].dtype  # an empty input of a wider dtype still promotes the result: it stays
    kept = [t for t in parts if not (adds_nothing_to_cat(t, d) and t.meta["val"].dtype == dtype)]
    if kept and len(kept) < len(parts):
        node.args = (kept, *node.args[1:])


def _zero_the_dropped_end(gm: GraphModule, node: Node, rank: int, tp: int) -> None:
    """``x[..., :end]`` kept as a padded dim of ``x``'s even blocks: each rank keeps its whole
    block, and the one holding ``end`` sets the elements past it to zero (the padding a
    padded vocabulary has; a vocab-parallel loss masks those columns)."""
    x, d = node.args[0], node.args[1]
    val = x.meta["val"]
    d = d + val.dim() if d < 0 else d
    block = val.shape[d] // tp
    kept = min(max(node.meta["val"].shape[d] - rank * block, 0), block)  # the slice's global end, less the blocks before
    node.args = (x, d, 0, block)
    if kept == block:
        return
    with gm.graph.inserting_before(node.next):
        zeroed = zero_spans(gm.graph, node, d, block, [(kept, block)])
    node.replace_all_uses_with(zeroed, delete_user_cb=lambda u: u is not zeroed)
    zeroed.meta.update({k: v for k, v in node.meta.items() if k != meta_keys.PADDING_SLICE})


def _local_aranges(gm: GraphModule, node: Node, tp: int) -> None:
    """An index that enumerates a split dim in place (``index_rules._selected_dims``): the
    rank's ``arange`` of its local size, in the index's shape."""
    indices = list(node.args[1])
    for d, var in node.meta[meta_keys.IDENTITY_INDICES]:
        old = indices[d].meta["val"]
        n = local_size(var, tp)
        shape = [n if s != 1 else 1 for s in old.shape]
        with gm.graph.inserting_before(node):
            arange = gm.graph.call_function(aten.arange.default, (n,), {"dtype": old.dtype, "device": old.device})
            indices[d] = gm.graph.call_function(aten.view.default, (arange, shape))
        arange.meta["val"], indices[d].meta["val"] = torch.arange(n, dtype=old.dtype, device="meta"), torch.empty(shape, dtype=old.dtype, device="meta")
    node.args = (node.args[0], indices, *node.args[2:])


def _local_strides(node: Node, src: Layout, tp: int) -> None:
    """``as_strided`` of a split input (``shape_rules.as_strided``): the output dim walking a
    split input dim takes its local size, and every stride that of its input dim in the
    rank's contiguous input."""
    walk = strided_walk(node)
    assert walk is not None, f"{node.name}: as_strided of a split input without a plain walk"
    shape = list(shape_of(node.args[0]) or ())
    for d, size in local_sizes(node.args[0], tp, src).items():
        shape[d] = size
    strides = contiguous_strides(shape)
    sizes = [shape[i] if i is not None and src.var_at(i) is not None else n for n, i in zip(node.args[1], walk)]
    node.args = (node.args[0], sizes, [t if i is None else strides[i] for t, i in zip(node.args[2], walk)], *node.args[3:])


def _local_groups(node: Node, x: object, weight: object, tp: int) -> None:
    """A grouped convolution's local groups: its local input channels over its weight's local input
    channels per group. The input channels are the input's, or, where it reads the rank's groups of a
    whole input (``convolution_rules._grouped_channels``), those of the weight's rows (every group's
    rows whole on one rank); a whole input into a block of every group's rows keeps the groups.
    ``x``, ``weight``: their layouts."""
    groups = schema_arg(node, "groups", 1)
    if groups == 1:
        return
    per_group = node.args[1].meta["val"].shape[1]
    local_per_group = local_size(weight.var_at(1), tp) if isinstance(weight, Layout) and weight.var_at(1) is not None else per_group
    rows = weight.var_at(0) if isinstance(weight, Layout) else None
    if isinstance(x, Layout) and x.var_at(1) is not None:
        local_in = local_size(x.var_at(1), tp)
    elif rows is not None and not rows.find().segments:
        local_in = groups * local_size(rows, tp) // node.args[1].meta["val"].shape[0] * per_group
    else:
        return
    local = local_in // local_per_group
    position = [a.name for a in node.target._schema.arguments].index("groups")
    args = list(node.args) + [None] * (position + 1 - len(node.args))
    defaults = {a.name: a.default_value for a in node.target._schema.arguments}
    for i in range(len(node.args), position):
        args[i] = node.kwargs.get(node.target._schema.arguments[i].name, defaults[node.target._schema.arguments[i].name])
    args[position] = local
    node.args = tuple(args)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in {a.name for a in node.target._schema.arguments[: position + 1]}}
