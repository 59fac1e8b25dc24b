"""The one subgraph extractor: a standalone ``GraphModule`` computing some nodes of a graph.

``extract_chunks`` cuts a pipeline chunk out of the rank graph with it, and
``split_cudagraph_regions`` a CUDA-graph region out of a chunk graph.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from autotp.ir import meta_keys

_COLLECTIVE_TAGS = (meta_keys.COLLECTIVE, meta_keys.COLLECTIVE_RANKS)


def standalone(gm: GraphModule, nodes: Iterable[Node], inputs: list[tuple[Node, str]], outputs: Any, class_name: str) -> GraphModule:
    """A graph module that computes ``nodes`` (in the order given) of ``gm``: each of ``inputs``
    becomes a placeholder of the given name (keeping its meta, but for the tags of a
    collective: the placeholder only receives its value), a parameter or buffer read
    (``get_attr``) that ``nodes`` use is read again inside, and ``outputs`` (a node or a
    tuple/list of nodes) is what it returns. Attributes are shared with ``gm``."""
    graph = Graph()
    env: dict[Node, Node] = {}
    for node, name in inputs:
        env[node] = graph.placeholder(name)
        env[node].meta.update({k: v for k, v in node.meta.items() if k not in _COLLECTIVE_TAGS})

    def read(a: Node) -> Node:
        if a not in env:
            assert a.op == "get_attr", f"{a.name} is neither an input nor computed before its use"
            env[a] = graph.node_copy(a)
        return env[a]

    for n in nodes:
        if n not in env:
            env[n] = graph.node_copy(n, read)
    graph.output(map_arg(outputs, read))
    return GraphModule(gm, graph, class_name=class_name)
