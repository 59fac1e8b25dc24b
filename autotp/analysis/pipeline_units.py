"""Where a pipeline may be cut: the **units** of a graph, in the order its forward runs them.

* A unit is a decoder layer (``analysis.layers``) or a **block**: outside the layers, the
  outermost module of a node's ``nn_module_stack`` that holds no layer and whose nodes read
  a parameter (``model.embed_tokens``, a cross-attention before a latent stack, ``lm_head``;
  not ``model``, which holds ``model.layers``, nor a rotary table that reads buffers only).
  A cut between two units moves only the values that flow from one to the next, and a block
  outside every module list can take a stage's share of its own.
* A node of no unit (the code of a module that holds the layers: a residual add, a pooling
  mean, the loss; a collective a pass inserted) runs with the **unit in progress**, the last
  unit before it in the graph: ``plan.embedding_chunk`` before the first unit and
  ``plan.head_chunk`` after the last (a pass may fuse a block away: the lm_head into the loss).
* A plan places the layers (``layer_chunks``) and the blocks it moved off their section's
  chunk (``module_chunks``; the section's is ``embedding_chunk`` before the last layer's last
  node, ``head_chunk`` after). ``chunk_bases`` reads them: the chunk each node runs in before
  data flow (``split_stages`` runs a node no earlier than the chunks of its inputs).
* A unit too large to balance (a hierarchical model's last stage, ``cost_model.pipeline``) is
  **split**: its nodes take the unit of its child module in their ``nn_module_stack`` instead
  (``layers.2`` -> ``layers.2.downsample``, ``layers.2.blocks``; a split ``layers.2.blocks``
  -> ``layers.2.blocks.0`` ...), a child that reads no parameter and the split module's own
  code belonging to the unit in progress. A plan records the children it moved off their
  parent's chunk in ``module_chunks``, so the split units are the modules around its paths
  (``split_units``), and a child it did not move runs in its parent's chunk.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from autotp.analysis.layers import HEAD, last_layer_position, layer_of, layer_path, outside_layers
from autotp.ir.plan import ParallelPlan

Unit = int | str
"""A layer index, or the module path of a block."""


def _outermost_block(node: Node, layer_paths: set[str]) -> str | None:
    """The outermost module of ``node`` that holds none of ``layer_paths`` (None: only the root does)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path and not any(p == path or p.startswith(path + ".") for p in layer_paths):
            return path
    return None


def _child(node: Node, path: str) -> str | None:
    """The module of ``node`` one level inside ``path`` (None: ``node`` is the code of ``path`` itself)."""
    return next((p for p, _ in (node.meta.get("nn_module_stack") or {}).values() if p.startswith(path + ".")), None)


def _enclosing(path: str) -> list[str]:
    """The modules around ``path``, innermost first: ``a.b.c`` -> ``a.b``, ``a``."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def layer_paths(gm: GraphModule) -> dict[int, str]:
    """The module path of every layer: 3 -> ``model.layers.3``."""
    return {
        index: found[0] for n in gm.graph.nodes
        if (found := layer_path(n)) is not None and (index := layer_of(n)) is not None
    }  # fmt: skip


def split_units(plan: ParallelPlan) -> frozenset[str]:
    """The units ``plan`` splits: the modules around the paths it places (module doc)."""
    return frozenset(p for path, _ in plan.module_chunks for p in _enclosing(path))


def units(gm: GraphModule, split: frozenset[str] = frozenset()) -> dict[Node, Unit]:
    """The unit of every ``call_function`` node that has one, in graph order; the units whose
    module paths are in ``split`` are split into their children (module doc)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    paths = {found[0] for n in calls if (found := layer_path(n)) is not None}
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    found: dict[Node, Unit] = {}
    for node in calls:
        layer = layer_path(node)
        path = layer[0] if layer is not None else _outermost_block(node, paths)
        unit: Unit | None = layer_of(node) if layer is not None else path
        while path is not None and path in split:
            unit = path = _child(node, path)
        if unit is not None:
            found[node] = unit
    reading = {
        unit for node, unit in found.items()
        if isinstance(unit, str) and any(a.op == "get_attr" and str(a.target) in params for a in node.all_input_nodes)
    }  # fmt: skip
    return {n: u for n, u in found.items() if isinstance(u, int) or u in reading}


def placed_chunk(path: str, moved: dict[str, int], layers: dict[str, int]) -> int | None:
    """The chunk of the module ``path`` that a plan places by itself or by the innermost module
    around it: in ``moved`` (``module_chunks``) or a layer (``layers``: path -> its chunk);
    None: by neither (its section's chunk)."""
    for p in [path, *_enclosing(path)]:
        if p in moved:
            return moved[p]
        if p in layers:
            return layers[p]
    return None


def chunk_bases(gm: GraphModule, plan: ParallelPlan) -> dict[Node, int]:
    """The chunk ``plan`` runs each ``call_function`` node of ``gm`` in, before data flow (module doc)."""
    nodes = list(gm.graph.nodes)
    if plan.num_chunks == 1:
        return {n: 0 for n in nodes if n.op == "call_function"}
    of = units(gm, split_units(plan))
    moved = dict(plan.module_chunks)
    layers = {path: plan.layer_chunks[i] for i, path in layer_paths(gm).items()}
    last_layer_at = last_layer_position(nodes)
    last_unit = next((n for n in reversed(nodes) if n in of), None)
    current = plan.embedding_chunk
    bases: dict[Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        unit = of.get(node)
        if isinstance(unit, int):
            current = plan.layer_chunks[unit]
        elif unit is not None:
            placed = placed_chunk(unit, moved, layers)
            section = plan.head_chunk if outside_layers(i, last_layer_at) == HEAD else plan.embedding_chunk
            current = section if placed is None else placed
        bases[node] = current
        if node is last_unit:
            current = plan.head_chunk
    return bases
