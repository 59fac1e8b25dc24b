"""Which decoder layer a graph node (or a parameter) belongs to, read from its module path.

* A node's **layer** is the first integer component of the innermost module path of its
  ``nn_module_stack`` that has one: ``model.layers.3.mlp`` -> 3, ``transformer.h.3`` -> 3.
  A parameter name is read the same way (``layer_index``). Where the layers come from
  several module lists (``encoder.0`` ... ``decoder.0`` ..., Swin's ``stage1.0`` ...
  ``stage2.0``), each list's indices would name the same layer twice: the layers are
  numbered instead in the order the graph first runs them.
* Nodes outside every layer belong to the **embedding** section before the last node of
  the last layer and to the **head** after it (``outside_layers``).

A pipeline cuts between these layers and the modules around them (``pipeline_units``).
"""

from __future__ import annotations

import re

from torch.fx import Graph, GraphModule, Node

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


def layer_path(node: Node) -> tuple[str, int] | None:
    """(the module path through its first integer component, that integer) of the innermost
    module of ``node`` that has one: ``model.layers.3.mlp`` -> (``model.layers.3``, 3)."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        match = _LAYER_INDEX.search(path)
        if match:
            return path[: match.end(1)], int(match.group(1))
    return None


def _ordinals(graph: Graph) -> dict[str, int]:
    """Layer numbers of a graph whose layers come from several module lists (an encoder's
    and a decoder's, the stages of a hierarchical vision model): every layer path numbered
    in the order the graph first runs it. Empty for one list: its indices number it."""
    cached = getattr(graph, "_autotp_layer_ordinals", None)
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    seen: dict[str, int] = {}
    for node in graph.nodes:
        found = layer_path(node)
        if found is not None and found[0] not in seen:
            seen[found[0]] = len(seen)
    lists = {path.rsplit(".", 1)[0] if "." in path else "" for path in seen}
    ordinals = seen if len(lists) > 1 else {}
    graph._autotp_layer_ordinals = (len(graph.nodes), ordinals)  # type: ignore[attr-defined]
    return ordinals


def layer_of(node: Node) -> int | None:
    found = layer_path(node)
    if found is None:
        return None
    return _ordinals(node.graph).get(found[0], found[1])


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


def repeated_modules(graph: Graph) -> dict[str, int]:
    """Module paths the forward calls more than once (``torch.export`` keys each further call
    ``path@1``, ``path@2``...): path -> number of calls, outermost first (ALBERT's one
    shared layer run ``N`` times)."""
    calls: dict[str, set[str]] = {}
    for node in graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path:
                calls.setdefault(path, set()).add(key)
    return {path: len(keys) for path, keys in calls.items() if len(keys) > 1 and not any(
        path.startswith(outer + ".") and len(calls[outer]) > 1 for outer in calls)}
