"""Route training-mode dropout through the tp RNG streams (Megatron's rule, see rng.py)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from autotp.ir import meta_keys
from autotp.ir.layouts import Layout
from autotp.passes.runner import PassContext
from autotp.runtime.rng import REPLICATED, SHARDED, tp_dropout as dropout_from_stream


def tp_dropout(gm: GraphModule, ctx: PassContext) -> GraphModule:
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.dropout.default or not node.args[2]:
            continue
        lay = node.meta.get(meta_keys.LAYOUT)
        stream = SHARDED if isinstance(lay, Layout) and lay.dims else REPLICATED
        node.target = dropout_from_stream
        node.args = (*node.args[:3], stream)
    return gm
