"""Give every chunk graph a copy whose CUDA-graph regions are submodules, for capture.

Runs when ``plan.cudagraphs`` is set. In a copy of each chunk graph, the nodes of each
region that ``mark_cudagraph_regions`` tagged become submodule ``cudagraph_region_<id>``
(``subgraphs.standalone``: its inputs are the values it reads from outside, in order of
first use; its outputs the values read after it), called where the region's last node was:
with pp > 1 a region may skip input-derived nodes in its midst, which it can read. The nodes
between regions stay in the copy and run eagerly (partial capture). A region never outputs a
value that may share memory with a parameter or buffer (a transposed expert weight that an
eager grouped matmul reads): the graph's gradient for it would be a view of the capture's
static gradient-output buffer, which autograd stores as the parameter's ``.grad`` and the
next backward replay overwrites (accumulation over microbatches would lose all but the
last). Such outputs are recomputed outside the region instead, from the parameter through
the same views, which launch nothing. The copy is the chunk
graph's submodule ``cudagraph_split`` (``autotp.ir.program.CAPTURED``), which
``autotp.runtime.execution.cudagraphs`` captures.
"""

from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, op_facts
from autotp.ir.program import CAPTURED, CHUNK_PREFIX, REGION_PREFIX
from autotp.passes.extract_chunks import whole_copy
from autotp.passes.runner import PassContext
from autotp.passes.subgraphs import standalone


def _parameter_alias_chain(node: Node) -> list[Node] | None:
    """The nodes from a ``get_attr`` to ``node`` when ``node``'s value may be (a view of) that
    parameter or buffer: every step a view, or a conversion that changes nothing; else None."""
    chain = [node]
    while chain[-1].op != "get_attr":
        step = chain[-1]
        if not op_facts.is_alias(step) or op_facts.is_inplace(step.target):
            return None
        source = step.args[0]
        assert isinstance(source, Node), step
        if op_facts.is_conversion(step.target) and _dtype(step) != _dtype(source):
            return None  # a conversion that converts copies: its result is the graph's own
        chain.append(source)
    return chain[::-1]


def _dtype(node: Node) -> object:
    return getattr(node.meta.get("val"), "dtype", None)


def _parameter_aliases_outside(parent: GraphModule, nodes: list[Node]) -> list[Node]:
    """Let the users outside the region of a value that may alias a parameter (module
    docstring) read an eager copy of its chain of views instead; the region's nodes left."""
    inside = set(nodes)
    for node in nodes:
        outside = [u for u in node.users if u not in inside]
        chain = _parameter_alias_chain(node) if outside else None
        if chain is None:
            continue
        copies: dict[Node, Node] = {}
        with parent.graph.inserting_before(node):
            for step in chain:
                copies[step] = parent.graph.node_copy(step, lambda n: copies[n])
                copies[step].meta.pop(meta_keys.CUDAGRAPH_REGION, None)
        for user in outside:
            user.replace_input_with(node, copies[node])
        for step in reversed(chain):
            if step in inside and not step.users:
                parent.graph.erase_node(step)
                inside.remove(step)
    return [n for n in nodes if n in inside]


def _extract(parent: GraphModule, nodes: list[Node], name: str) -> None:
    """Replace ``nodes`` (a region, in graph order) with a call of submodule ``name``."""
    nodes = _parameter_aliases_outside(parent, nodes)
    if not nodes:
        return  # views of parameters only: nothing to capture
    inside = set(nodes)
    inputs: list[Node] = []
    for n in nodes:
        inputs.extend(a for a in n.all_input_nodes if a not in inside and a.op != "get_attr" and a not in inputs)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    parent.add_submodule(name, standalone(parent, nodes, [(a, a.name) for a in inputs], tuple(outputs), name))
    with parent.graph.inserting_before(nodes[-1].next):
        call = parent.graph.call_module(name, tuple(inputs))
        for i, o in enumerate(outputs):
            got = parent.graph.call_function(operator.getitem, (call, i))
            got.meta.update(o.meta)
            o.replace_all_uses_with(got)
    for n in reversed(nodes):
        parent.graph.erase_node(n)


def region_split(chunk: GraphModule) -> GraphModule:
    """A copy of ``chunk`` whose tagged regions are submodules (module docstring)."""
    split = whole_copy(chunk, CAPTURED)
    regions: dict[int, list[Node]] = {}
    for node in split.graph.nodes:
        region = node.meta.get(meta_keys.CUDAGRAPH_REGION)
        if region is not None:
            regions.setdefault(region, []).append(node)
    for region, nodes in regions.items():
        _extract(split, nodes, f"{REGION_PREFIX}{region}")
    for node in list(split.graph.nodes):
        if node.op == "get_attr" and not node.users:
            split.graph.erase_node(node)
    split.graph.lint()
    split.recompile()
    return split


def split_cudagraph_regions(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Attach ``cudagraph_split`` to every chunk graph (module docstring)."""
    if not ctx.plan.cudagraphs:
        return gm
    for name, chunk in gm.named_children():
        if name.startswith(CHUNK_PREFIX) and isinstance(chunk, GraphModule):
            chunk.add_submodule(CAPTURED, region_split(chunk))
    return gm
