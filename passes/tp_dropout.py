"""Route training-mode dropout through the tp RNG streams (Megatron's rule, see ``autotp.runtime.execution.rng``)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from autotp.ir import meta_keys, ops
from autotp.ir.layouts import Layout
from autotp.passes.runner import PassContext


def tp_dropout(gm: GraphModule, ctx: PassContext) -> GraphModule:
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.dropout.default or not node.args[2]:
            continue
        lay = node.meta.get(meta_keys.LAYOUT)
        stream = ops.SHARDED if isinstance(lay, Layout) and lay.dims else ops.REPLICATED
        node.target = ops.TP_DROPOUT
        node.args = (*node.args[:3], stream)
    return gm
