"""Assign every node to a pipeline chunk and put ``stage_boundary`` nodes on the values
that cross from one chunk to the next (reads ``plan.layer_chunks``, ``plan.module_chunks``
and friends through ``autotp.analysis.pipeline_units.chunk_bases``: a node runs in its
unit's chunk, or a later one that one of its inputs runs in).

Cheap values computed from the inputs alone (attention masks, position ids, rotary
tables) and parameter reads are not assigned: every chunk that needs them repeats them,
so only activations cross the boundaries. A value used several chunks later crosses each
boundary in between, so a chunk only ever talks to its neighbours.

A value that activations are written into in place through a view (running statistics in a
buffer made from the input's shape) is never repeated: it is computed once and crosses the
boundaries, every read of it runs in the chunk of its last write or later, and its views
are made in each chunk that uses them, so that every write reaches every later reader.
"""

from __future__ import annotations

from torch.fx import Graph, GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.analysis.layers import layer_of, num_layers
from autotp.analysis.pipeline_units import chunk_bases
from autotp.ir.op_facts import is_alias, mutated_base, view_root
from autotp.passes.runner import PassContext
from autotp.ir.errors import UserInputError

_NEVER_REPEATED = ops.COLLECTIVES | {ops.TP_DROPOUT}


def repeatable(node: Node, repeat: set[Node], pinned: frozenset[Node] = frozenset()) -> bool:
    """Whether every chunk may recompute ``node``: it reads only nodes in ``repeat`` (the
    repeatable ones before it), needs no gradient, is no collective or tp dropout, and is
    not ``pinned`` (written in place by a node that is not repeatable)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function" or node.target in _NEVER_REPEATED or node.meta.get(meta_keys.NEEDS_GRAD):
        return False
    return node not in pinned and all(a in repeat for a in node.all_input_nodes)


def _repeated(nodes: list[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes every chunk repeats, and the values written through a view by nodes that
    are not repeated (never repeated themselves: one chunk's copy would miss the others' writes)."""
    pinned: set[Node] = set()
    while True:
        repeat: set[Node] = set()
        for node in nodes:
            if repeatable(node, repeat, frozenset(pinned)):
                repeat.add(node)
        written = {
            base
            for node in nodes
            if node.op == "call_function" and node not in repeat
            and (base := mutated_base(node)) is not None and base is not node.args[0]
        }
        if written <= pinned:
            return repeat, written
        pinned |= written


def _place_views_with_users(graph: Graph, written: set[Node], chunk_of: dict[Node, int]) -> None:
    """Make each view of a value in ``written`` in every chunk that uses it (a copy per
    chunk), so the value itself, not a copy of the view, crosses the boundaries with its writes."""
    for node in reversed(list(graph.nodes)):
        if node not in chunk_of or mutated_base(node) is not None or not is_alias(node) or view_root(node) not in written:
            continue
        by_chunk: dict[int, list[Node]] = {}
        for user in node.users:
            if user in chunk_of:
                by_chunk.setdefault(chunk_of[user], []).append(user)
        if not by_chunk:
            continue
        first, *later = sorted(by_chunk)
        chunk_of[node] = first
        for c in later:
            with graph.inserting_after(node):
                copy = graph.node_copy(node)
            chunk_of[copy] = c
            for user in by_chunk[c]:
                user.replace_input_with(node, copy)


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
    bases = chunk_bases(gm, plan)
    repeat, written = _repeated(nodes)
    for node in nodes:
        if mutated_base(node) in written:
            node.replace_all_uses_with(node.args[0])  # its readers read what it wrote, in order
    chunk_of: dict[Node, int] = {}
    written_in: dict[Node, int] = {}  # value in ``written`` -> the last chunk that wrote it so far
    for node in nodes:
        if node in repeat:
            node.meta[meta_keys.CHUNK] = None
            continue
        node.meta[meta_keys.LAYER] = layer_of(node)
        base = bases.get(node, plan.embedding_chunk)
        inputs = [chunk_of[a] for a in node.all_input_nodes if a in chunk_of]
        # a read of a written value comes after its writes: in their chunk or a later one
        writes = [written_in[view_root(a)] for a in node.all_input_nodes if view_root(a) in written_in]
        chunk_of[node] = max([base, *inputs, *writes])
        if node.op == "output":
            chunk_of[node] = plan.num_chunks - 1
        if (target := mutated_base(node)) in written:
            written_in[target] = chunk_of[node]
    graph = gm.graph
    _place_views_with_users(graph, written, chunk_of)
    for node, chunk in chunk_of.items():
        node.meta[meta_keys.CHUNK] = chunk
    for node in list(graph.nodes):
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

