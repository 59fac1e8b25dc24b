"""Recompute the activations of the plan's layers in the backward (``plan.recompute_layers``).

In every chunk graph, the call nodes of each layer of ``plan.recompute_layers``
(``analysis.layers.layer_of``) become submodule ``recompute_layer_<i>``
(``subgraphs.standalone``), called through ``autotp.ir.recompute.run_recomputed``: torch's
non-reentrant ``checkpoint``, which keeps the layer's inputs (activations, and the parameters
it reads, passed in so ``insert_param_waits`` still sees them read) and runs the layer again
in the backward, its dropout masks replayed. Its inputs are the values it reads from outside,
in order of first use; its outputs the values read after it. A node between the layer's
first and last node that no module owns (a collective a pass inserted) and that lies on a
path from the layer back into it is part of the layer; one that reads the layer's values and
that the layer does not read runs after the call.

Refused with a ``UserInputError`` (the plan asks for something this pass cannot make
correct): a layer that writes in place into a tensor it did not make (the recomputation
would write it twice), a layer index the graph does not have, and CUDA-graph capture
(``plan.cudagraphs``): a captured region replays its kernels and cannot hold a checkpoint.
"""

from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from autotp.analysis.layers import layer_of, num_layers
from autotp.ir.errors import UserInputError
from autotp.ir.op_facts import mutated_base
from autotp.ir.program import CHUNK_PREFIX
from autotp.ir.recompute import run_recomputed
from autotp.passes.runner import PassContext
from autotp.passes.subgraphs import standalone

RECOMPUTE_PREFIX = "recompute_layer_"


def _sandwiched_and_after(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """Of the nodes between the layer's first and last node that are not its own (collectives and
    other nodes the passes inserted carry no module): those on a path from the layer back into it,
    which are part of its computation, and those that read its values and that it does not read,
    which run after its call."""
    inside = set(nodes)
    window: list[Node] = []
    n = nodes[0].next
    while n is not nodes[-1]:
        if n not in inside:
            window.append(n)
        n = n.next
    between = set(window)
    reads_layer = set(inside)
    for n in window:
        if any(a in reads_layer for a in n.all_input_nodes):
            reads_layer.add(n)
    read_by_layer: set[Node] = set()
    stack = [a for n in nodes for a in n.all_input_nodes if a in between]
    while stack:
        a = stack.pop()
        if a not in read_by_layer:
            read_by_layer.add(a)
            stack.extend(x for x in a.all_input_nodes if x in between)
    sandwiched = [n for n in window if n in reads_layer and n in read_by_layer]
    after = [n for n in window if n in reads_layer and n not in read_by_layer]
    return sandwiched, after


def _outline(chunk: GraphModule, layer: int, nodes: list[Node]) -> None:
    sandwiched, moved = _sandwiched_and_after(nodes)
    inside = set(nodes) | set(sandwiched)
    nodes = [n for n in chunk.graph.nodes if n in inside]
    for n in nodes:
        base = mutated_base(n)
        if base is not None and base not in inside:
            raise UserInputError(
                f"plan.recompute_layers: layer {layer} writes in place into {base.name} (node {n.name}, {n.target}), a tensor "
                "made outside the layer: recomputing it would write twice; drop the layer from recompute_layers"
            )
    inputs: list[Node] = []
    for n in nodes:
        inputs.extend(a for a in n.all_input_nodes if a not in inside and a not in inputs)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    name = f"{RECOMPUTE_PREFIX}{layer}"
    chunk.add_submodule(name, standalone(chunk, nodes, [(a, a.name) for a in inputs], tuple(outputs), name))
    graph = chunk.graph
    with graph.inserting_before(nodes[-1].next):
        region = graph.get_attr(name)
        call = graph.call_function(run_recomputed, (region, *inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        anchor = call
        for i, o in enumerate(outputs):
            got = graph.call_function(operator.getitem, (call, i))
            got.meta.update(o.meta)
            o.replace_all_uses_with(got, delete_user_cb=lambda user: user not in inside)
            anchor = got
    for n in moved:
        anchor.append(n)
        anchor = n
    for n in reversed(nodes):
        graph.erase_node(n)


def recompute_layers(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Outline every recomputed layer of every chunk graph (module docstring)."""
    layers = set(ctx.plan.recompute_layers)
    if not layers:
        return gm
    if ctx.plan.cudagraphs:
        raise UserInputError(
            "plan.recompute_layers with cuda_graphs=True: a captured region cannot recompute in the backward; "
            "use recompute without CUDA graphs (or compile=True), or CUDA graphs without recompute"
        )
    missing = sorted(layers - set(range(num_layers(gm))))
    if missing:
        raise UserInputError(f"plan.recompute_layers names layers {missing}, but the model has {num_layers(gm)} decoder layers")
    for name, chunk in gm.named_children():
        if not (name.startswith(CHUNK_PREFIX) and isinstance(chunk, GraphModule)):
            continue
        by_layer: dict[int, list[Node]] = {}
        for n in chunk.graph.nodes:
            if n.op == "call_function" and (layer := layer_of(n)) in layers:
                by_layer.setdefault(layer, []).append(n)
        for layer, nodes in by_layer.items():
            _outline(chunk, layer, nodes)
        chunk.graph.lint()
    return gm
