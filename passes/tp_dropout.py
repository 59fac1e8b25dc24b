"""Route training-mode dropout through the tp RNG streams (Megatron's rule, see ``autotp.runtime.execution.rng``):
``aten.dropout`` becomes ``tp_dropout``, and attention with dropout over heads split across
the ranks becomes ``tp_attention_dropout`` (SDPA draws its own dropout from the device's
default generator: every rank would drop the same positions of its own heads)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.ir.layouts import Layout
from autotp.ir.op_facts import draws_random
from autotp.passes.runner import PassContext

def tp_dropout(gm: GraphModule, ctx: PassContext) -> GraphModule:
    for node in gm.graph.nodes:
        split = _split(node)
        if node.target is torch.ops.aten.dropout.default and node.args[2]:
            node.target = ops.TP_DROPOUT
            node.args = (*node.args[:3], ops.SHARDED if split else ops.REPLICATED)
        elif node.target is torch.ops.aten.scaled_dot_product_attention.default and split and draws_random(node):
            schema = node.target._schema.arguments
            args = [node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value) for i, a in enumerate(schema)]
            node.target, node.args, node.kwargs = ops.TP_ATTENTION_DROPOUT, (*args, ops.SHARDED), {}
    return gm


def _split(node: Node) -> bool:
    lay = node.meta.get(meta_keys.LAYOUT)
    return isinstance(lay, Layout) and bool(lay.dims)
