"""Rewrite the shape constants that sharding changes (views, expands, split sizes,
slice bounds).

``torch.export`` bakes concrete sizes into ``view``/``reshape``/``expand`` arguments,
some of which count heads or hidden features. Every dim that the layout pass marked as
sharded gets its per-rank size (``autotp.analysis.local_shapes``); ``-1`` entries are
left to be inferred.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from autotp.analysis.local_shapes import local_sizes, local_slice_bounds, local_tensors
from autotp.ir import meta_keys
from autotp.ir.layouts import Layout
from autotp.passes.runner import PassContext

aten = torch.ops.aten
_SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
              aten.broadcast_to.default}
_SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def rewrite_shapes(gm: GraphModule, ctx: PassContext) -> GraphModule:
    tp = ctx.plan.tp
    for node in gm.graph.nodes:
        lay = node.meta.get(meta_keys.LAYOUT)
        if node.target in _SHAPE_OPS:
            local = local_sizes(node, tp, lay if isinstance(lay, Layout) else None)
            if not local:
                continue
            shape = [local[d] if d in local and s != -1 else s for d, s in enumerate(node.args[1])]
            node.args = (node.args[0], shape, *node.args[2:])
        elif meta_keys.SLICE_FIXUP in node.meta:
            start, end = local_slice_bounds(node, tp)
            node.args = (node.args[0], node.args[1], start, end, *node.args[4:])
        elif node.target in _SPLIT_OPS and isinstance(lay, tuple):
            src = node.args[0].meta.get(meta_keys.LAYOUT)
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
