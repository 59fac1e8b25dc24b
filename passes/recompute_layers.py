"""Recompute the activations of the plan's layers in the backward (``plan.recompute_layers``).

In every chunk graph, the call nodes of each layer of ``plan.recompute_layers``
(``analysis.layers.layer_of``) become submodule ``recompute_layer_<i>``
(``subgraphs.standalone``), called through ``autotp.ir.recompute.run_recomputed``: torch's
non-reentrant ``checkpoint``, which keeps the layer's inputs (activations, and the parameters
it reads, passed in so ``insert_param_waits`` still sees them read) and runs the layer again
in the backward, its dropout masks replayed. Its inputs are the values it reads from outside,
in order of first use; its outputs the values read after it. A node between the layer's
first and last node that reads the layer's values runs after the call; one that the layer
reads and that reads the layer cannot, and the layer is refused.

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


def _after_layer(nodes: list[Node], inside: set[Node]) -> list[Node]:
    """The nodes between the layer's first and last node that read its values: they move after
    its call. Raises when the layer also reads one of them."""
    moved: list[Node] = []
    reached = set(inside)
    n = nodes[0]
    while n is not nodes[-1]:
        if n not in inside and any(a in reached for a in n.all_input_nodes):
            reached.add(n)
            moved.append(n)
        n = n.next
    for n in nodes:
        blocked = next((a for a in n.all_input_nodes if a in moved), None)
        if blocked is not None:
            raise UserInputError(
                f"plan.recompute_layers: layer {layer_of(n)} cannot be recomputed as one region: its node {n.name} "
                f"reads {blocked.name}, computed outside the layer from the layer's own values; drop the layer from "
                "recompute_layers"
            )
    return moved


def _outline(chunk: GraphModule, layer: int, nodes: list[Node]) -> None:
    inside = set(nodes)
    for n in nodes:
        base = mutated_base(n)
        if base is not None and base not in inside:
            raise UserInputError(
                f"plan.recompute_layers: layer {layer} writes in place into {base.name} (node {n.name}, {n.target}), a tensor "
                "made outside the layer: recomputing it would write twice; drop the layer from recompute_layers"
            )
    moved = _after_layer(nodes, inside)
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
