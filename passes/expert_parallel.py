"""Expert parallelism: each planned MoE layer sends its rows to the ranks that hold their
experts and takes the results back (reads ``plan.moe_layers``, ``moe_dispatch``, ``ep``).

The layer is found again in this graph (``autotp.analysis.moe``) and keeps its own
routing, sort, weighting and combine; only the expert computation moves:

* **grouped form** -- ``moe_route`` on the grouped matmuls' ``offs`` gives the route and
  the local offsets; every row input of the body goes through ``moe_to_experts``, the
  body's grouped matmuls read the local offsets (and this rank's ``E/ep`` expert weights,
  which the runtime binds), and the body's output comes back through ``moe_from_experts``.
* **loop form** -- the rows each expert gathers are concatenated in expert order (their
  counts are the offsets), moved the same way, split among this rank's experts, computed
  by those experts' own nodes, moved back and split per expert for the original combines.
  The other experts' nodes go: this rank does not hold their parameters.

In sync-free mode (``plan.moe_dispatch == SYNC_FREE``) the received rows are packed at the
front of a static ``E * capacity``-row buffer and the local offsets count only them: the
grouped matmuls keep their op and multiply the rows that arrived, not the padding (rows past
the last offset are never read downstream). Shape constants counting rows become ``-1``.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from autotp.analysis.moe import GROUPED, MoeLayer, find_moe_layers
from autotp.ir.op_facts import op_name
from autotp.ir import meta_keys
from autotp.ir.errors import UserInputError
from autotp.ir.moe_ops import MOE_FROM_EXPERTS, MOE_ROUTE, MOE_TO_EXPERTS, SYNC_FREE, received_rows
from autotp.ir.axes import Axis, group_key
from autotp.ir.moe_plan import MoeLayerPlan, capacity_for
from autotp.passes.runner import PassContext

aten = torch.ops.aten
_COPIED_META = ("nn_module_stack", "stack_trace", meta_keys.LAYER, meta_keys.NEEDS_GRAD)


def expert_parallel(gm: GraphModule, ctx: PassContext) -> GraphModule:
    plan = ctx.plan
    if not plan.moe_dispatch or not plan.moe_layers:
        return gm
    found = {layer.name: layer for layer in find_moe_layers(gm)}
    for entry in plan.moe_layers:
        layer = found.get(entry.name)
        if layer is None or layer.blocker:
            why = "there is no MoE layer there" if layer is None else layer.blocker
            raise UserInputError(f"the plan moves the experts of {entry.name} to ep ranks, but in this graph {why}; "
                                 "re-plan for these inputs (parallelize with plan=None)")  # fmt: skip
        capacity = capacity_for(layer.rows, plan.tp, layer.num_experts, plan.moe_capacity_factor) if plan.moe_dispatch == SYNC_FREE else 0
        layout = (layer.num_experts, capacity, plan.ep, group_key(Axis.EP, plan.ep), plan.tp, ctx.group)
        if layer.form == GROUPED:
            _rewrite_grouped(gm.graph, layer, layout)
        else:
            _rewrite_loop(gm.graph, layer, layout, ctx.ep_rank)
    gm.graph.eliminate_dead_code()
    return gm


def new_node(graph: Graph, target: Any, args: tuple, like: Node, val: Any) -> Node:
    """A call to ``target`` carrying ``like``'s module, layer and grad metadata and ``val``."""
    node = graph.call_function(target, args)
    for key in _COPIED_META:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta["val"] = val
    return node


def route(graph: Graph, offsets: Node, rows: int | Node, layout: tuple, layer: str, like: Node) -> tuple[Node, Node]:
    """``moe_route`` and its two outputs, after ``offsets`` (and ``rows``)."""
    num_experts, _, ep, *_ = layout
    off_val = offsets.meta["val"]
    after = offsets
    if isinstance(rows, Node):
        position = {n: i for i, n in enumerate(graph.nodes)}
        after = max(offsets, rows, key=position.__getitem__)
    with graph.inserting_after(after):
        pair = new_node(graph, MOE_ROUTE, (offsets, rows, *layout, layer), like, None)
    pair.meta[meta_keys.NEEDS_GRAD] = False
    with graph.inserting_after(pair):
        routed = new_node(graph, operator.getitem, (pair, 0), pair, off_val.new_empty(2 + 2 * num_experts, dtype=torch.int64))
    with graph.inserting_after(routed):
        local = new_node(graph, operator.getitem, (pair, 1), pair, off_val.new_empty(num_experts // ep))
    pair.meta["val"] = (routed.meta["val"], local.meta["val"])
    return routed, local


def to_experts(graph: Graph, x: Node, routed: Node, layout: tuple, before: Node) -> Node:
    num_experts, capacity, ep, _, tp, _ = layout
    val = x.meta["val"]
    with graph.inserting_before(before):
        rows = received_rows(val.shape[0], num_experts, capacity, ep, tp)
        return new_node(graph, MOE_TO_EXPERTS, (x, routed, *layout), x, val.new_empty((rows, *val.shape[1:])))


def from_experts(graph: Graph, y: Node, routed: Node, rows: int | Node, layout: tuple) -> Node:
    val = y.meta["val"]
    count = rows.meta["val"] if isinstance(rows, Node) else rows
    with graph.inserting_after(y):
        return new_node(graph, MOE_FROM_EXPERTS, (y, routed, rows, *layout), y, val.new_empty((count, *val.shape[1:])))


def _rewrite_grouped(graph: Graph, layer: MoeLayer, layout: tuple) -> None:
    assert layer.offsets is not None and layer.exit is not None
    routed, local = route(graph, layer.offsets, layer.rows, layout, layer.name, layer.exit)
    body = set(layer.body)
    for x in layer.body_inputs:
        first = next(n for n in layer.body if x in n.all_input_nodes)
        moved = to_experts(graph, x, routed, layout, first)
        for n in layer.body:
            n.replace_input_with(x, moved)
    for mm in layer.grouped_mms:
        mm.replace_input_with(layer.offsets, local)
    exit_node = layer.exit
    back = from_experts(graph, exit_node, routed, layer.rows, layout)
    exit_node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back and u not in body)
    moved_rows(layer.body, layer.rows)


def _rewrite_loop(graph: Graph, layer: MoeLayer, layout: tuple, ep_rank: int) -> None:
    """The loop form (module docstring): every new node goes right before the layer's last
    combine, in creation order; this rank's experts' nodes and the combines move there
    too, after what they now read."""
    num_experts, capacity, ep, *_ = layout
    assert not capacity, "the planner keeps loop-form layers dropless"
    experts = layer.experts
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((e.combine for e in experts), key=order.__getitem__)
    gathered = [sorted(e.gathers.values(), key=order.__getitem__) for e in experts]
    local = num_experts // ep
    mine = [e for e in experts if e.index // local == ep_rank]
    first_rows = [g[0] for g in gathered]

    mode = torch._guards.detect_fake_mode([first_rows[0].meta["val"]])

    def make(target: Any, args: tuple, like: Node, kwargs: dict | None = None) -> Node:
        """A node before ``last``, its value propagated through the trace's fake tensors."""
        with graph.inserting_before(last):
            node = new_node(graph, target, args, like, None)
        node.kwargs = kwargs or {}
        vals = torch.fx.node.map_arg((args, node.kwargs), lambda a: a.meta.get("val"))
        known = all(a.meta.get("val") is not None for a in node.all_input_nodes)
        if known and target is not aten.tensor_split.tensor_indices_or_sections:  # its split points are data
            with mode if mode is not None else contextlib.nullcontext():
                node.meta["val"] = target(*vals[0], **vals[1])
        return node

    device = first_rows[0].meta["val"].device
    sizes = [make(aten.sym_size.int, (g, 0), g) for g in first_rows]
    counts = [make(aten.scalar_tensor.default, (s,), s, {"dtype": torch.int64, "device": device}) for s in sizes]
    offsets = make(aten.cumsum.default, (make(aten.stack.default, (counts,), last), 0), last)
    cats = [make(aten.cat.default, ([g[j] for g in gathered],), last) for j in range(len(gathered[0]))]
    rows = make(aten.sym_size.int, (cats[0], 0), last)
    with graph.inserting_before(last):
        routed, local_offsets = route(graph, offsets, rows, layout, layer.name, last)
    bounds = make(aten._to_copy.default, (make(aten.slice.Tensor, (local_offsets, 0, 0, local - 1), last),), last,
                  {"device": torch.device("cpu")})
    for j, cat in enumerate(cats):
        moved = to_experts(graph, cat, routed, layout, last)
        split = make(aten.tensor_split.tensor_indices_or_sections, (moved, bounds, 0), last)
        for e in mine:
            gather = gathered[e.index][j]
            segment = make(operator.getitem, (split, e.index % local), gather)
            count: Node | None = None
            for n in e.body:
                n.replace_input_with(gather, segment)
                for size in _row_counts(n, gather):  # a view in the expert counting its rows counts the segment's
                    count = count or make(aten.sym_size.int, (segment, 0), gather)
                    n.replace_input_with(size, count)
    for e in mine:
        for n in e.body:
            last.prepend(n)
    results = make(aten.cat.default, ([e.result for e in mine],), last)
    with graph.inserting_before(last):
        back = from_experts(graph, results, routed, rows, layout)
    last.prepend(back)
    pieces = make(aten.split_with_sizes.default, (back, sizes, 0), last)
    for i, e in enumerate(experts):
        piece = make(operator.getitem, (pieces, i), e.result)
        e.combine.replace_input_with(e.result, piece)
    for e in sorted(experts, key=lambda x: order[x.combine]):
        if e.combine is not last:
            last.prepend(e.combine)


def _row_counts(node: Node, gather: Node) -> list[Node]:
    """The inputs of ``node`` that are the (data-dependent) row count of ``gather``."""
    rows = str(gather.meta["val"].shape[0])
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.SymInt) and str(a.meta["val"]) == rows]


def moved_rows(body: list[Node], rows: int) -> None:
    """The body now sees the rows this rank received: shape constants that counted the
    layer's rows are inferred instead."""
    for node in body:
        if node.op == "call_function" and op_name(node.target) in ("view", "reshape", "_unsafe_view") and list(node.args[1])[:1] == [rows]:
            node.args = (node.args[0], [-1, *node.args[1][1:]], *node.args[2:])


def moe_layer_plans(layers: list[MoeLayer], tp: int, capacity_factor: float) -> tuple[MoeLayerPlan, ...]:
    """The plan entries of the layers expert parallelism applies to."""
    out = []
    for layer in layers:
        if layer.blocker:
            continue
        experts_of = tuple(layer.expert_of(p) for p in layer.expert_params) if layer.form != GROUPED else ()
        capacity = capacity_for(layer.rows, tp, layer.num_experts, capacity_factor) if capacity_factor else 0
        router = layer.router.describe() if layer.router is not None else ""
        out.append(MoeLayerPlan(layer.name, layer.form, layer.num_experts, layer.top_k, router, layer.expert_params,
                                experts_of, -(-layer.rows // tp), capacity))  # fmt: skip
    return tuple(out)
