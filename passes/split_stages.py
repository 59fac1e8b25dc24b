"""Assign every node to a pipeline chunk and put ``stage_boundary`` nodes on the values
that cross from one chunk to the next (reads ``plan.layer_chunks`` and friends).

Cheap values computed from the inputs alone (attention masks, position ids, rotary
tables) and parameter reads are not assigned: every chunk that needs them repeats them,
so only activations cross the boundaries. A value used several chunks later crosses each
boundary in between, so a chunk only ever talks to its neighbours.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.analysis.layers import HEAD, last_layer_position, layer_of, num_layers, outside_layers
from autotp.passes.runner import PassContext
from autotp.ir.errors import UserInputError

_NEVER_REPEATED = ops.COLLECTIVES | {ops.TP_DROPOUT}


def repeatable(node: Node, repeat: set[Node]) -> bool:
    """Whether every chunk may recompute ``node``: it reads only nodes in ``repeat`` (the
    repeatable ones before it), needs no gradient, and is no collective or tp dropout."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function" or node.target in _NEVER_REPEATED or node.meta.get(meta_keys.NEEDS_GRAD):
        return False
    return all(a in repeat for a in node.all_input_nodes)


def split_stages(gm: GraphModule, ctx: PassContext) -> GraphModule:
    plan = ctx.plan
    if plan.num_chunks == 1:
        return gm
    layers = num_layers(gm)
    if len(plan.layer_chunks) != layers:
        raise UserInputError(
            f"the plan places {len(plan.layer_chunks)} layers but the graph has {layers}; plan for this model"
        )
    nodes = list(gm.graph.nodes)
    last_layer_at = last_layer_position(nodes)
    repeat: set[Node] = set()
    chunk_of: dict[Node, int] = {}
    for i, node in enumerate(nodes):
        if repeatable(node, repeat):
            repeat.add(node)
            node.meta[meta_keys.CHUNK] = None
            continue
        layer = layer_of(node)
        node.meta[meta_keys.LAYER] = layer
        if layer is not None:
            base = plan.layer_chunks[layer]
        elif outside_layers(i, last_layer_at) == HEAD:
            base = plan.head_chunk
        else:
            base = plan.embedding_chunk
        inputs = [chunk_of[a] for a in node.all_input_nodes if a in chunk_of]
        chunk_of[node] = max([base, *inputs])
        if node.op == "output":
            chunk_of[node] = plan.num_chunks - 1
        node.meta[meta_keys.CHUNK] = chunk_of[node]
    graph = gm.graph
    for node in nodes:
        if node not in chunk_of:
            continue
        crossings: dict[int, Node] = {chunk_of[node]: node}
        for user in list(node.users):
            target = chunk_of.get(user)
            if target is None or target <= chunk_of[node]:
                continue
            for c in range(chunk_of[node] + 1, target + 1):
                if c not in crossings:
                    with graph.inserting_after(crossings[c - 1]):
                        boundary = graph.call_function(ops.STAGE_BOUNDARY, (crossings[c - 1], c), name="stage_boundary")
                    boundary.meta.update({k: v for k, v in node.meta.items() if k in ("val", meta_keys.LAYOUT, meta_keys.NEEDS_GRAD)})
                    boundary.meta[meta_keys.CHUNK] = c
                    crossings[c] = boundary
            user.replace_input_with(node, crossings[target])
    return gm

