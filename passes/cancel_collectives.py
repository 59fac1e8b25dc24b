"""Merge collectives that repeat the same operation on the same tensor.

``insert_collectives`` puts one collective on every use; when q, k and v read the same
normed activation, that is three f's on one tensor. Identical collectives (same op, same
input, same group) are merged into the earliest, which precedes every use. The result
is Megatron's count: one f and one g per attention block and per MLP.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from autotp.ir import meta_keys
from autotp.passes.runner import PassContext


def cancel_collectives(gm: GraphModule, ctx: PassContext) -> GraphModule:
    seen: dict[tuple, Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or meta_keys.COLLECTIVE not in node.meta:
            continue
        key = (node.target, node.args)
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(first)
        gm.graph.erase_node(node)
    return gm
