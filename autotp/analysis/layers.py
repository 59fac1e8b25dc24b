"""Which decoder layer a graph node belongs to, read from its module path."""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node

# The first integer component of a module path: model.layers.3.mlp -> 3, transformer.h.3 -> 3.
_LAYER_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


def layer_of(node: Node) -> int | None:
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        match = _LAYER_INDEX.search(path)
        if match:
            return int(match.group(1))
    return None


def num_layers(gm: GraphModule) -> int:
    layers = [layer_of(n) for n in gm.graph.nodes]
    return max((l for l in layers if l is not None), default=-1) + 1
