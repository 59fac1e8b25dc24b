"""Zero the padding of a dim split with padding where an op sums over it
(``meta_keys.PADDING_MASKS``, ``autotp.analysis.padded_dims``).

The ranks holding padding read the operand through ``where(keep, x, 0)``, ``keep`` false on
the padding at the end of each segment's block (``DimSharding.pieces``): the padding adds
nothing to the sum, and its gradient is zero, so the padding rows of the parameters that
computed it get none either and stay zero. The other ranks' graphs are unchanged.
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
            spans, offset = [], 0
            for _, have, length in resolve(var, tp).pieces(ctx.tp_rank, tp):
                if have < length:
                    spans.append((offset + have, offset + length))
                offset += length
            if not spans:
                continue
            with gm.graph.inserting_before(node):
                masked = zero_spans(gm.graph, operand, dim, offset, spans)
            masked.meta.update({k: v for k, v in operand.meta.items() if k in ("val", meta_keys.LAYOUT, meta_keys.NEEDS_GRAD)})
            node.replace_input_with(operand, masked)
    return gm


def zero_spans(graph: Graph, x: Node, dim: int, length: int, spans: list[tuple[int, int]]) -> Node:
    """``x`` with the local positions ``[a, b)`` of each span along ``dim`` (``length`` long) set
    to zero, inserted at the graph's insertion point. The caller sets the result's meta."""
    val = x.meta["val"]
    d = dim + val.dim() if dim < 0 else dim
    shape = [length] + [1] * (val.dim() - 1 - d)
    arange = graph.call_function(aten.arange.default, (length,), {"device": val.device})
    arange.meta["val"] = torch.arange(length, device="meta")
    keep = None
    for a, b in spans:
        outside = graph.call_function(aten.lt.Scalar, (arange, a))
        outside.meta["val"] = torch.empty(length, dtype=torch.bool, device="meta")
        if b < length:
            after = graph.call_function(aten.ge.Scalar, (arange, b))
            outside = graph.call_function(aten.logical_or.default, (outside, after))
            after.meta["val"] = outside.meta["val"] = torch.empty(length, dtype=torch.bool, device="meta")
        if keep is not None:
            outside = graph.call_function(aten.logical_and.default, (keep, outside))
            outside.meta["val"] = torch.empty(length, dtype=torch.bool, device="meta")
        keep = outside
    shaped = graph.call_function(aten.view.default, (keep, shape))
    shaped.meta["val"] = torch.empty(shape, dtype=torch.bool, device="meta")
    return graph.call_function(aten.where.ScalarOther, (shaped, x, 0.0))
