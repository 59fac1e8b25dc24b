"""Drop the graph outputs that the caller does not read, and what only they needed.

``PassContext.outputs_read`` names the output keys a caller reads (``train_step`` reads
``out["loss"]``); empty means all. The key of each output leaf comes from the graph's
output spec: the outputs are rebuilt from leaf indices and each named key is looked up.
Every other leaf becomes ``None`` (the caller gets e.g. ``logits=None``), and the nodes
left without users are erased, collectives included (the gather of the logits at tp > 1):
every tp rank compiles the same graph, so all drop the same ones. Nodes that draw random
numbers stay, so that the RNG streams advance as in the unmodified model. Outputs that
cannot be looked up by key (a tuple) are all kept.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule, Node

from autotp.ir import ops
from autotp.passes.runner import PassContext

log = logging.getLogger(__name__)


def drop_unread_outputs(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if not ctx.outputs_read:
        return gm
    spec = getattr(gm, "_out_spec", None)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, tree = torch.utils._pytree.tree_flatten(output.args[0])
    if spec is None or spec.num_leaves != len(leaves):
        return gm
    keep = _read_leaves(torch.utils._pytree.tree_unflatten(list(range(len(leaves))), spec), ctx.outputs_read)
    if keep is None:
        return gm
    dropped = [leaf for i, leaf in enumerate(leaves) if i not in keep and isinstance(leaf, Node)]
    output.args = (torch.utils._pytree.tree_unflatten([leaf if i in keep else None for i, leaf in enumerate(leaves)], tree),)
    erased = _erase_unused(gm, dropped)
    log.debug("dropped %d unread outputs and %d nodes only they needed", len(dropped), erased)
    return gm


def _read_leaves(outputs: object, keys: tuple[str, ...]) -> set[int] | None:
    """Leaf indices under ``keys`` of the rebuilt outputs, or None where one cannot be looked up."""
    keep: set[int] = set()
    for key in keys:
        try:
            value = outputs[key]  # type: ignore[index]
        except (KeyError, TypeError, IndexError):
            return None
        keep.update(torch.utils._pytree.tree_leaves(value))
    return keep


def _erase_unused(gm: GraphModule, start: list[Node]) -> int:
    erased = 0
    stack = list(start)
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function" or not _removable(node):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        erased += 1
        stack.extend(inputs)
    return erased


def _removable(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags and node.target is not ops.TP_DROPOUT
