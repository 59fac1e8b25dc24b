"""Which decoder layer a graph node (or a parameter) belongs to, read from its module path.

* A node's **layer** is the first integer component of the innermost module path of its
  ``nn_module_stack`` that has one: ``model.layers.3.mlp`` -> 3, ``transformer.h.3`` -> 3.
  A parameter name is read the same way (``layer_index``).
* Nodes outside every layer belong to the **embedding** section before the last node of
  the last layer and to the **head** after it (``outside_layers``).
"""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node

EMBEDDING, HEAD = "embedding", "head"
LayerKey = int | str
"""A layer index, or ``EMBEDDING`` / ``HEAD``."""

# The first integer component of a module path: model.layers.3.mlp -> 3, transformer.h.3 -> 3.
_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


def layer_index(path: str) -> int | None:
    """The layer of a module path or parameter name (None: outside the layers)."""
    match = _LAYER_INDEX.search(path)
    return int(match.group(1)) if match else None


def with_layer_index(path: str, index: int) -> str:
    """``path`` moved to layer ``index``: ``model.layers.0.mlp.weight`` -> ``model.layers.5.mlp.weight``."""
    match = _LAYER_INDEX.search(path)
    assert match is not None, f"{path} is in no layer"
    return path[: match.start(1)] + str(index) + path[match.end(1) :]


def layer_of(node: Node) -> int | None:
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        index = layer_index(path)
        if index is not None:
            return index
    return None


def num_layers(gm: GraphModule) -> int:
    layers = [layer_of(n) for n in gm.graph.nodes]
    return max((l for l in layers if l is not None), default=-1) + 1


def last_layer_position(nodes: list[Node]) -> int:
    """Position in ``nodes`` of the last op inside a layer (-1: none is)."""
    return max((i for i, n in enumerate(nodes) if n.op == "call_function" and layer_of(n) is not None), default=-1)


def outside_layers(position: int, last_layer_at: int) -> str:
    """The section of a node outside the layers at ``position``: ``HEAD`` after the last
    layer (``last_layer_position``), ``EMBEDDING`` before."""
    return HEAD if position > last_layer_at else EMBEDDING
