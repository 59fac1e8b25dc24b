"""Rewrite the shape constants that sharding changes (views, expands, split sizes,
slice bounds).

``torch.export`` bakes concrete sizes into ``view``/``reshape``/``expand`` arguments,
some of which count heads or hidden features. Every dim that the layout pass marked as
sharded gets its per-rank size; ``-1`` entries are left to be inferred.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from autotp.ir import meta_keys
from autotp.ir.layouts import Layout, local_offset, local_size
from autotp.passes.runner import PassContext

aten = torch.ops.aten
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def rewrite_shapes(gm: GraphModule, ctx: PassContext) -> GraphModule:
    tp = ctx.plan.tp
    for node in gm.graph.nodes:
        lay = node.meta.get(meta_keys.LAYOUT)
        if node.target in _SHAPE_OPS:
            fixups = node.meta.get(meta_keys.EXPAND_FIXUPS, [])
            if not (isinstance(lay, Layout) and lay.dims) and not fixups:
                continue
            shape = list(node.args[1])
            for d, var in lay.dims if isinstance(lay, Layout) else ():
                if shape[d] != -1:
                    shape[d] = local_size(var, tp)
            for d, merged, outer in fixups:
                shape[d] = local_size(merged, tp) // local_size(outer, tp)
            node.args = (node.args[0], shape, *node.args[2:])
        elif meta_keys.SLICE_FIXUP in node.meta:
            whole, part = node.meta[meta_keys.SLICE_FIXUP]
            start = local_offset(whole, part, tp)
            node.args = (node.args[0], node.args[1], start, start + local_size(part, tp), *node.args[4:])
        elif node.target in _SPLIT_OPS and isinstance(lay, tuple):
            src = node.args[0].meta.get(meta_keys.LAYOUT)
            ndim = node.args[0].meta["val"].dim()
            d = node.args[2] if len(node.args) > 2 else 0
            d = d + ndim if d < 0 else d
            if not isinstance(src, Layout) or src.var_at(d) is None:
                continue
            sizes = [local_size(out.var_at(d), tp) for out in lay]
            if len(set(sizes)) == 1 and node.target is aten.split.Tensor:
                node.args = (node.args[0], sizes[0], d)
            elif len(set(sizes)) == 1 and node.target is aten.chunk.default:
                continue
            else:
                node.target = aten.split_with_sizes.default
                node.args = (node.args[0], sizes, d)
    return gm
