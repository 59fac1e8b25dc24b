"""Mixture-of-experts layers, recognised from the graph (never from module or class names).

An MoE layer computes ``y[t] = sum_j w[t, j] * expert_{i[t, j]}(x[t])``. Expert
parallelism only needs to know which rows of which tensors each expert reads, which
nodes compute the experts, and which parameters belong to them. Two forms are found:

* **grouped** -- fused expert weights ``[E, ...]`` used through a grouped matmul
  (``aten._grouped_mm``, ``transformers::grouped_mm_fallback``): rows sorted by expert,
  ``offs`` their cumulative counts. The *body* is every node between the layer's grouped
  matmuls (they share one ``offs``); its *rows* are the row-aligned tensors it reads
  (the sorted tokens, per-row biases). By the grouped matmul's own semantics, rows
  ``[offs[e-1], offs[e])`` belong to expert e, whatever router chose them.
* **loop** -- one subgraph per expert module: ``idx = nonzero(choice == e)``, rows
  gathered with ``idx``, the expert's layers, and an ``index_add``/``index_put(accumulate)``
  of the result back at ``idx``.

A body must be *row-wise* (``row_ops``): every row of its output depends on the same row
of its inputs only, so it may run on any subset of the rows, on another rank. Anything
else blocks expert parallelism for that layer (``MoeLayer.blocker`` names the node); the
layer then keeps tensor-parallel experts. The router -- the ``topk`` (or ``max``) that
picks the experts, its score function, correction bias and group limit -- is read for
reports and the cost model (``moe_router``); a grouped layer whose expert choice does not
come from one is not recognised either.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from autotp.analysis.moe_router import Router, find_router
from autotp.analysis.moe_rows import RowCheck
from autotp.ir.op_facts import is_grouped_matmul, op_name
from autotp.analysis.shapes import shape_of
from autotp.ir.errors import describe

aten = torch.ops.aten
GROUPED, LOOP = "grouped", "loop"

# Ops a fused expert weight may pass through before its grouped matmul (dim 0 stays the expert dim).
_WEIGHT_VIEWS = frozenset({"transpose", "to", "_to_copy", "alias", "contiguous", "clone", "detach", "view", "reshape"})
_INDEX_VIEWS = frozenset({"squeeze", "view", "reshape", "flatten", "_unsafe_view", "select", "to", "_to_copy", "alias"})


@dataclass
class LoopExpert:
    """One expert of a loop-form layer: its index, the ``nonzero`` rows it takes, the
    gathers of those rows (source tensor -> gather node), its body and its combine."""

    index: int
    idx: Node
    gathers: dict[Node, Node]
    body: list[Node]
    result: Node
    combine: Node
    params: tuple[str, ...]


@dataclass
class MoeLayer:
    """One recognised MoE layer and the graph nodes that expert parallelism rewrites.

    ``name`` is the module holding the experts and their router (``model.layers.0.mlp``);
    ``expert_params`` are the per-expert parameters (fused ``[E, ...]`` ones for the grouped
    form, every parameter of every expert module for the loop form); ``shared_params`` the
    layer's other parameters (router, shared experts), which stay dense. ``blocker`` is
    empty when expert parallelism applies, else why not."""

    name: str
    form: str
    num_experts: int
    rows: int
    router: Router | None
    expert_params: tuple[str, ...]
    shared_params: tuple[str, ...]
    blocker: str = ""
    # grouped form
    offsets: Node | None = None
    grouped_mms: list[Node] = field(default_factory=list)
    body_inputs: list[Node] = field(default_factory=list)
    body: list[Node] = field(default_factory=list)
    exit: Node | None = None
    # loop form
    experts: list[LoopExpert] = field(default_factory=list)

    @property
    def top_k(self) -> int:
        return self.router.top_k if self.router is not None else 1

    def expert_of(self, param: str) -> int | None:
        """The expert a loop-form parameter belongs to (None for fused or other parameters)."""
        return next((e.index for e in self.experts if param in e.params), None)


def find_moe_layers(gm: GraphModule) -> list[MoeLayer]:
    """Every MoE layer of ``gm``, grouped form first, in graph order within each form."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    layers = _grouped_layers(gm, params, order) + _loop_layers(gm, params, order)
    nodes = {n.name: n for n in gm.graph.nodes}
    seen: dict[str, int] = {}
    for layer in layers:
        seen[layer.name] = seen.get(layer.name, 0) + 1
        if seen[layer.name] > 1:  # two MoE layers in one module
            layer.name = f"{layer.name}#{seen[layer.name]}"
        layer.shared_params = _shared_params(layer, nodes, params)
    return layers


def _shared_params(layer: MoeLayer, nodes: dict[str, Node], params: dict) -> tuple[str, ...]:
    """The dense parameters computing what is added to the routed experts' output from the
    router's input (shared experts and their gates), and the router's weight."""
    router = layer.router
    if router is None or not router.tokens:
        return ()
    end = layer.exit if layer.form == GROUPED else max((e.combine for e in layer.experts), key=lambda n: list(n.graph.nodes).index(n))
    while end is not None and len(end.users) == 1:
        user = next(iter(end.users))
        if op_name(user.target) == "add" and all(isinstance(a, Node) for a in user.args[:2]):
            other = user.args[1] if user.args[0] is end else user.args[0]
            tokens = _through(nodes[router.tokens], _INDEX_VIEWS)
            between = _reachable([tokens], forward=True) & (_reachable([other], forward=False) | {other})
            found = {str(a.target) for n in between for a in n.all_input_nodes if a.op == "get_attr" and str(a.target) in params}
            return tuple(sorted(found - set(layer.expert_params) - {router.weight}))
        end = user
    return ()


# ---- grouped form ------------------------------------------------------------------------


def _offsets_of(node: Node) -> Node | None:
    offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    return offs if isinstance(offs, Node) else None


def expert_weight(node: Node, params: dict[str, torch.nn.Parameter]) -> str | None:
    """The fused ``[E, ...]`` parameter a grouped matmul's weight reads (through views that
    keep dim 0 the expert dim), or None."""
    w = node.args[1]
    while isinstance(w, Node) and w.op == "call_function" and op_name(w.target) in _WEIGHT_VIEWS:
        if op_name(w.target) == "transpose" and 0 in {d % 3 for d in w.args[1:3]}:
            return None
        w = w.args[0]
    if isinstance(w, Node) and w.op == "get_attr" and str(w.target) in params and params[str(w.target)].dim() == 3:
        return str(w.target)
    return None


def _weight_chain(node: Node) -> set[Node]:
    chain = set()
    w = node.args[1]
    while isinstance(w, Node) and w.op == "call_function" and op_name(w.target) in _WEIGHT_VIEWS:
        chain.add(w)
        w = w.args[0]
    return chain


def _grouped_layers(gm: GraphModule, params: dict, order: dict[Node, int]) -> list[MoeLayer]:
    by_offsets: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_grouped_matmul(node.target):
            offs = _offsets_of(node)
            if offs is not None:
                by_offsets.setdefault(offs, []).append(node)
    return [_grouped_layer(offs, sorted(mms, key=order.__getitem__), params) for offs, mms in by_offsets.items()]


def _reachable(starts: list[Node], forward: bool) -> set[Node]:
    seen: set[Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        for nxt in (n.users if forward else n.all_input_nodes):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _grouped_layer(offs: Node, mms: list[Node], params: dict) -> MoeLayer:
    weights = [expert_weight(mm, params) for mm in mms]
    rows = (shape_of(mms[0].args[0]) or (0,))[0]
    known = [w for w in weights if w is not None]
    num_experts = params[known[0]].shape[0] if known else 0
    router, stop = find_router(offs)
    name = _module_of([*mms, *([stop] if router is not None else [])]) or (known[0].rsplit(".", 1)[0] if known else offs.name)
    layer = MoeLayer(name, GROUPED, num_experts, rows, router, tuple(dict.fromkeys(known)), (), offsets=offs, grouped_mms=mms)
    if None in weights:
        layer.blocker = f"{describe(mms[weights.index(None)])} multiplies by a weight that is not a fused [experts, ...] parameter"
        return layer
    if any(params[w].shape[0] != num_experts for w in known):
        layer.blocker = f"the grouped matmuls on {offs.name} read weights with different expert counts"
        return layer
    if router is None:
        layer.blocker = f"the expert choice of {describe(mms[0])} comes from {describe(stop)}, not from a router's topk"
        return layer
    weight_views = set().union(*(_weight_chain(mm) for mm in mms))
    inside = _reachable(mms, forward=True) & (_reachable([mm.args[0] for mm in mms], forward=False) | {mm.args[0] for mm in mms})
    body = [n for n in mms[0].graph.nodes if n in inside or n in mms]
    exits = [n for n in body if any(u not in inside and u not in mms for u in n.users)]
    if len(exits) != 1 or exits[0] is not mms[-1]:
        leaving = next(n for n in exits if n is not mms[-1])
        layer.blocker = f"{describe(leaving)} inside the expert computation is also read outside it"
        return layer
    check = RowCheck(rows, set(body), weight_views | {offs})
    for n in body:
        problem = check.visit(n)
        if problem:
            layer.blocker = problem
            return layer
    layer.body, layer.body_inputs, layer.exit = body, check.row_inputs, mms[-1]
    return layer


def _module_of(nodes: list[Node]) -> str:
    """The innermost module that runs all of ``nodes`` (their router and experts: ``model.layers.0.mlp``)."""
    stacks = [[path for path, _ in (n.meta.get("nn_module_stack") or {}).values()] for n in nodes]
    common = ""
    for paths in zip(*stacks):
        if len(set(paths)) != 1:
            break
        common = paths[0]
    return common


# ---- loop form ---------------------------------------------------------------------------


def _through(node: object, names: frozenset[str]) -> object:
    while isinstance(node, Node) and node.op == "call_function" and op_name(node.target) in names:
        node = node.args[0]
    return node


def _combine_index(node: Node) -> tuple[Node, Node] | None:
    """(index, source) of an ``index_add(acc, 0, idx, src)`` or ``index_put(acc, [idx], src, True)``."""
    name = op_name(node.target) if node.op == "call_function" else ""
    if name in ("index_add", "index_add_") and node.args[1] in (0, -len(shape_of(node) or (0,))):
        return node.args[2], node.args[3]
    if name in ("index_put", "index_put_") and len(node.args) > 3 and node.args[3] and len(node.args[1]) == 1:
        return node.args[1][0], node.args[2]
    return None


def _expert_mask(idx: Node) -> tuple[Node, int] | None:
    """(choice, e) when ``idx`` is ``nonzero(choice == e)`` seen through views."""
    nz = _through(idx, _INDEX_VIEWS)
    if not (isinstance(nz, Node) and nz.op == "call_function" and op_name(nz.target) == "nonzero"):
        return None
    mask = nz.args[0]
    while isinstance(mask, Node) and op_name(mask.target) in ("any", "to", "_to_copy", "squeeze", "view", "reshape"):
        mask = mask.args[0]
    if isinstance(mask, Node) and op_name(mask.target) == "eq" and isinstance(mask.args[1], int):
        return mask.args[0], mask.args[1]
    return None


def _loop_layers(gm: GraphModule, params: dict, order: dict[Node, int]) -> list[MoeLayer]:
    groups: dict[Node, list[tuple[int, Node, Node, Node]]] = {}
    for node in gm.graph.nodes:
        found = _combine_index(node)
        if found is None or not isinstance(found[0], Node) or not isinstance(found[1], Node):
            continue
        mask = _expert_mask(found[0])
        if mask is not None:
            groups.setdefault(mask[0], []).append((mask[1], found[0], found[1], node))
    return [_loop_layer(choice, members, params) for choice, members in groups.items()]


def _loop_layer(choice: Node, members: list[tuple[int, Node, Node, Node]], params: dict) -> MoeLayer:
    router, stop = find_router(choice)
    experts: list[LoopExpert] = []
    blocker = ""
    for e, idx, src, combine in members:
        gathers = {u.args[0]: u for u in idx.users if _is_row_gather(u, idx)}
        inside = _reachable(list(gathers.values()), forward=True) & (_reachable([src], forward=False) | {src})
        body = [n for n in combine.graph.nodes if n in inside]
        rows = (shape_of(next(iter(gathers.values()))) or (0,))[0] if gathers else 0
        check = RowCheck(rows, set(body) | set(gathers.values()), set())
        problem = "" if gathers else f"{describe(combine)} adds rows that were not gathered with its index"
        for n in body:
            problem = problem or check.visit(n)
        if check.row_inputs and not problem:
            problem = f"{describe(check.row_inputs[0])} is read by expert {e} but not gathered with its index"
        owned = tuple(dict.fromkeys(str(a.target) for n in body for a in n.all_input_nodes if a.op == "get_attr" and str(a.target) in params))
        blocker = blocker or problem
        experts.append(LoopExpert(e, idx, gathers, body, src, combine, owned))
    experts.sort(key=lambda x: x.index)
    shapes = {tuple(tuple((shape_of(g) or ())[1:]) for g in sorted(x.gathers.values(), key=_position)) for x in experts}
    if len(shapes) > 1:
        blocker = blocker or f"the experts picked by {describe(choice)} gather rows of different shapes {sorted(shapes)}"
    num = (shape_of(router_input(choice)) or (len(experts),))[-1] if router is not None else len(experts)
    if router is None:
        blocker = f"the expert choice {describe(choice)} comes from {describe(stop)}, not from a router's topk"
    elif [x.index for x in experts] != list(range(num)):
        blocker = f"the experts picked by {describe(choice)} are {[x.index for x in experts]}, not each of 0..{num - 1} once"
    all_params = tuple(p for x in experts for p in x.params)
    name = _module_of([stop, *(x.combine for x in experts)]) or choice.name
    rows = sum((shape_of(x.idx) or (0,))[0] for x in experts)
    return MoeLayer(name, LOOP, num, rows, router, all_params, (), blocker, experts=experts)


def _position(node: Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def router_input(choice: Node) -> Node | None:
    """The scores a ``topk``/``max`` chose from (``choice`` is its index output)."""
    src = _through(choice, _INDEX_VIEWS)
    if isinstance(src, Node) and src.target is operator.getitem:
        src = src.args[0]
    return src.args[0] if isinstance(src, Node) and src.args and isinstance(src.args[0], Node) else None


def _is_row_gather(node: Node, idx: Node) -> bool:
    name = op_name(node.target) if node.op == "call_function" else ""
    if name == "index" and len(node.args[1]) >= 1 and node.args[1][0] is idx:
        return all(i is None for i in node.args[1][1:])
    return name == "index_select" and node.args[1] == 0 and node.args[2] is idx
