"""Give every chunk graph a copy whose CUDA-graph regions are submodules, for capture.

Runs when ``plan.cudagraphs`` is set. In a copy of each chunk graph, the nodes of each
region that ``mark_cudagraph_regions`` tagged become submodule ``cudagraph_region_<id>``
(``subgraphs.standalone``: its inputs are the values it reads from outside, in order of
first use; its outputs the values read after it), called where the region's last node was:
with pp > 1 a region may skip input-derived nodes in its midst, which it can read. The nodes
between regions stay in the copy and run eagerly (partial capture). The copy is the chunk
graph's submodule ``cudagraph_split`` (``autotp.ir.program.CAPTURED``), which
``autotp.runtime.execution.cudagraphs`` captures.
"""

from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from autotp.ir import meta_keys
from autotp.ir.program import CAPTURED, CHUNK_PREFIX, REGION_PREFIX
from autotp.passes.extract_chunks import whole_copy
from autotp.passes.runner import PassContext
from autotp.passes.subgraphs import standalone


def _extract(parent: GraphModule, nodes: list[Node], name: str) -> None:
    """Replace ``nodes`` (a region, in graph order) with a call of submodule ``name``."""
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
