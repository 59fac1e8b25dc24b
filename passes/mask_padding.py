"""Zero the padding of a dim split with padding where an op sums over it
(``meta_keys.PADDING_MASKS``, ``autotp.analysis.padded_dims``).

The ranks whose block runs past the dim's end read the operand through ``where(index < kept,
x, 0)``: the padding adds nothing to the sum, and its gradient is zero, so the padding rows
of the parameters that computed it get none either and stay zero. The other ranks' graphs
are unchanged.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from autotp.ir import meta_keys
from autotp.ir.layouts import resolve
from autotp.passes.runner import PassContext

aten = torch.ops.aten


def mask_padding(gm: GraphModule, ctx: PassContext) -> GraphModule:
    tp = ctx.plan.tp
    for node in list(gm.graph.nodes):
        for operand, dim, var in node.meta.get(meta_keys.PADDING_MASKS, ()):
            sharding = resolve(var, tp)
            block = sharding.local_size(tp)
            start = sharding.ranges(ctx.tp_rank, tp)[0][0]
            kept = min(max(sharding.size - start, 0), block)
            if kept == block:
                continue
            with gm.graph.inserting_before(node):
                masked = zero_past(gm.graph, operand, dim, block, kept)
            masked.meta.update({k: v for k, v in operand.meta.items() if k in ("val", meta_keys.LAYOUT, meta_keys.NEEDS_GRAD)})
            node.replace_input_with(operand, masked)
    return gm


def zero_past(graph: Graph, x: Node, dim: int, block: int, kept: int) -> Node:
    """``x`` with the elements from ``kept`` on of its local ``dim`` (``block`` long) set to
    zero, inserted at the graph's insertion point. The caller sets the result's meta."""
    val = x.meta["val"]
    d = dim + val.dim() if dim < 0 else dim
    shape = [block] + [1] * (val.dim() - 1 - d)
    arange = graph.call_function(aten.arange.default, (block,), {"device": val.device})
    keep = graph.call_function(aten.lt.Scalar, (arange, kept))
    shaped = graph.call_function(aten.view.default, (keep, shape))
    zeroed = graph.call_function(aten.where.ScalarOther, (shaped, x, 0.0))
    arange.meta["val"] = torch.arange(block, device="meta")
    keep.meta["val"] = torch.empty(block, dtype=torch.bool, device="meta")
    shaped.meta["val"] = torch.empty(shape, dtype=torch.bool, device="meta")
    return zeroed
