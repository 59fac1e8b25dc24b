"""Insert Megatron's f and g (and the output gathers) as graph nodes.

Each collective is placed where the layouts say it is needed, one per use, without
looking for sharing; ``cancel_collectives`` merges the duplicates afterwards.

* g (``reduce_from_tp``): before every use of a partial tensor by an op that needs the
  full value (recorded by the layout pass), and between a row-parallel matmul and its
  bias.
* f (``copy_to_tp``): on every use of a replicated, trainable tensor by an op whose
  output is not replicated; backward, the grads that the ranks compute from their
  shards are partial and f sums them.
* f over the replica group: on parameters that several ranks hold whole (KV heads
  replicated when tp > num_key_value_heads), so their partial grads are summed; on the
  replicated segments only of a fused weight whose other segments are split.
  An f whose result the graph writes in place (through views: an accumulator sliced to
  the rank's part, then ``index_add_``) is followed by a clone: autograd forbids writing
  into what a custom Function returned as is.
* ``gather_from_tp``: on sharded graph outputs, so the user sees full tensors (put back in
  global order when the split has segments or replicated blocks).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.ir.axes import replica_group_key
from autotp.analysis.propagation_result import NodeRole
from autotp.analysis.shapes import shape_of
from autotp.ir.layouts import PARTIAL, REPLICATE, Layout, fixed_var, resolve
from autotp.ir.dim_sharding import DimSharding
from autotp.ir.op_facts import CONVOLUTIONS, CollectiveTag, mutated_base
from autotp.passes.runner import PassContext

aten = torch.ops.aten


def annotate_collective(new: Node, value: Node, layout: Any, kind: CollectiveTag, ranks: int, located_at: Node | None = None) -> None:
    """Metadata of a collective over ``ranks`` ranks applied to ``value``; ``located_at``
    names its source location."""
    where = located_at or value
    if "val" in value.meta:
        new.meta["val"] = value.meta["val"]
    for key in ("nn_module_stack", "stack_trace"):
        if key in where.meta:
            new.meta[key] = where.meta[key]
    new.meta[meta_keys.LAYOUT] = layout
    new.meta[meta_keys.NEEDS_GRAD] = value.meta.get(meta_keys.NEEDS_GRAD, False)
    new.meta[meta_keys.COLLECTIVE] = kind
    new.meta[meta_keys.COLLECTIVE_RANKS] = ranks


def _partial_source(node: Node) -> Node:
    """The op that made a partial value (a row matmul, a vocab lookup), through the
    linear ops that kept it partial; dumps and counts attribute the all-reduce to it."""
    while True:
        partial_inputs = [a for a in node.all_input_nodes if a.meta.get(meta_keys.LAYOUT) == PARTIAL]
        if not partial_inputs:
            return node
        node = partial_inputs[0]


def _not_replicated(node: Node) -> bool:
    lay = node.meta.get(meta_keys.LAYOUT)
    lays = lay if isinstance(lay, tuple) else (lay,)
    return any(isinstance(l, Layout) and not l.replicated for l in lays)


def insert_collectives(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if ctx.plan.tp == 1:
        return gm
    graph, key = gm.graph, ctx.group
    for node in list(graph.nodes):
        for partial in node.meta.get(meta_keys.REDUCE_INPUTS, []):
            with graph.inserting_before(node):
                g = graph.call_function(ops.REDUCE_FROM_TP, (partial, key), name="reduce_from_tp")
            annotate_collective(g, partial, REPLICATE, CollectiveTag.ALL_REDUCE, ctx.plan.tp, located_at=_partial_source(partial))
            node.replace_input_with(partial, g)
        if node.meta.get(meta_keys.ROLE) is NodeRole.ROW_WITH_BIAS:
            _split_row_bias(gm, node, key, ctx.plan.tp)
    for node in list(graph.nodes):
        lay = node.meta.get(meta_keys.LAYOUT)
        if not (isinstance(lay, Layout) and lay.replicated and node.meta.get(meta_keys.NEEDS_GRAD)):
            continue
        for user in list(node.users):
            if user.op == "call_function" and _not_replicated(user):
                with graph.inserting_before(user):
                    f = graph.call_function(ops.COPY_TO_TP, (node, key), name="copy_to_tp")
                annotate_collective(f, node, lay, CollectiveTag.ALL_REDUCE_BACKWARD, ctx.plan.tp)
                user.replace_input_with(node, f)
    _clone_written_copies(gm)
    _sync_replicated_blocks(gm, ctx)
    if ctx.plan.gather_outputs:
        _gather_outputs(gm, key, ctx.plan.tp)
    return gm




def _clone_written_copies(gm: GraphModule) -> None:
    graph = gm.graph
    written = {mutated_base(n) for n in graph.nodes if n.op == "call_function"}
    for f in [n for n in graph.nodes if n.target is ops.COPY_TO_TP and n in written]:
        with graph.inserting_after(f):
            copy = graph.call_function(aten.clone.default, (f,))
        copy.meta.update({k: v for k, v in f.meta.items() if k not in (meta_keys.COLLECTIVE, meta_keys.COLLECTIVE_RANKS)})
        f.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)


def _split_row_bias(gm: GraphModule, node: Node, key: str, tp: int) -> None:
    """``linear(x, W, b)`` / ``addmm(b, x, W)`` / a convolution with partial product -> ``g(x @ W) + b``."""
    graph = gm.graph
    if node.target is aten.linear.default:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs["bias"]
        target, args = aten.linear.default, (x, w)
    elif node.target in CONVOLUTIONS:  # conv(x, W, b, ...) -> g(conv(x, W, None, ...)) + b[:, None...]
        bias, target = node.args[2], node.target
        args = (node.args[0], node.args[1], None, *node.args[3:])
        shape = [-1] + [1] * (node.meta["val"].dim() - 2)
        with graph.inserting_before(node):
            bias = graph.call_function(aten.view.default, (bias, shape))
        bias.meta.update({"val": bias.args[0].meta["val"].view(shape), meta_keys.LAYOUT: REPLICATE})
    else:
        bias, x, w = node.args[0], node.args[1], node.args[2]
        target, args = aten.mm.default, (x, w)
    with graph.inserting_before(node):
        product = graph.call_function(target, args)
        g = graph.call_function(ops.REDUCE_FROM_TP, (product, key), name="reduce_from_tp")
        out = graph.call_function(aten.add.Tensor, (g, bias))
    product.meta.update({k: v for k, v in node.meta.items() if k != meta_keys.ROLE})
    product.meta[meta_keys.LAYOUT] = Layout(partial=True)
    annotate_collective(g, product, REPLICATE, CollectiveTag.ALL_REDUCE, tp)
    out.meta.update({k: v for k, v in node.meta.items() if k != meta_keys.ROLE})
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _sync_replicated_blocks(gm: GraphModule, ctx: PassContext) -> None:
    graph, tp = gm.graph, ctx.plan.tp
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        layout = ctx.plan.layout_of(str(node.target))
        if layout is None or layout.sharding.replicas(tp) == 1 or not node.meta.get(meta_keys.NEEDS_GRAD):
            continue
        sharding = layout.sharding
        replicas = [max(tp // g, 1) for g in sharding.groups]
        if len(set(replicas)) == 1:
            with graph.inserting_after(node):
                f = graph.call_function(ops.COPY_TO_TP, (node, replica_group_key(ctx.group, replicas[0])), name="copy_to_tp")
            annotate_collective(f, node, node.meta.get(meta_keys.LAYOUT), CollectiveTag.ALL_REDUCE_BACKWARD, replicas[0])
            node.replace_all_uses_with(f, delete_user_cb=lambda u: u is not f)
            continue
        _sync_replicated_segments(gm, node, layout, replicas, ctx.group, tp)


def _sync_replicated_segments(gm: GraphModule, node: Node, layout: Any, replicas: list[int], group: str, tp: int) -> None:
    """A fused weight whose segments are held differently (query heads split, one KV head
    replicated): the grads of each replicated segment are summed over its replica group
    only, so the weight is split into its local segments, f is put on the replicated ones,
    and they are joined again."""
    graph, sharding, dim = gm.graph, layout.sharding, layout.dim
    lengths = [seg // g * max(g // tp, 1) for seg, g in zip(sharding.segments, sharding.groups)]
    val = node.meta["val"]
    with graph.inserting_after(node):
        split = graph.call_function(aten.split_with_sizes.default, (node, lengths, dim))  # the local pieces
    split.meta["val"] = torch.split(val, list(sharding.segments), dim)
    parts, prev = [], split
    for i, (seg, g, reps) in enumerate(zip(sharding.segments, sharding.groups, replicas)):
        seg_layout = Layout(((dim, fixed_var(DimSharding(seg, (seg,), (g,), axis=sharding.axis), layout.name)),))
        with graph.inserting_after(prev):
            part = graph.call_function(operator.getitem, (split, i))
        part.meta["val"], part.meta[meta_keys.LAYOUT] = split.meta["val"][i], seg_layout
        part.meta[meta_keys.NEEDS_GRAD] = True
        prev = part
        if reps > 1:
            with graph.inserting_after(part):
                f = graph.call_function(ops.COPY_TO_TP, (part, replica_group_key(group, reps)), name="copy_to_tp")
            annotate_collective(f, part, seg_layout, CollectiveTag.ALL_REDUCE_BACKWARD, reps)
            part, prev = f, f
        parts.append(part)
    with graph.inserting_after(prev):
        joined = graph.call_function(aten.cat.default, (parts, dim))
    joined.meta.update({k: v for k, v in node.meta.items() if k in ("val", meta_keys.LAYOUT, meta_keys.NEEDS_GRAD)})
    split.meta[meta_keys.LAYOUT] = tuple(p.meta[meta_keys.LAYOUT] for p in parts)
    node.replace_all_uses_with(joined, delete_user_cb=lambda u: u is not split)


def _gather_outputs(gm: GraphModule, key: str, tp: int) -> None:
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    for arg in list(out_node.all_input_nodes):
        lay = arg.meta.get(meta_keys.LAYOUT)
        if not isinstance(lay, Layout) or not lay.dims:
            continue
        out_node.replace_input_with(arg, gather_whole(graph, arg, lay, key, tp, out_node))


def gather_whole(graph: Any, arg: Node, lay: Layout, key: str, tp: int, before: Node) -> Node:
    """``arg``'s value gathered whole on every rank (``gather_from_tp`` on each split dim, in
    global order), inserted before ``before``; backward, each rank keeps its slice of the grad."""
    shape = shape_of(arg)
    assert shape is not None
    value = arg
    for d, var in lay.dims:
        sharding = resolve(var, tp)
        contiguous = len(sharding.segments) == 1 and sharding.replicas(tp) == 1  # padded: the gather drops the end
        size = shape[d] if contiguous else sharding.local_size(tp) * tp
        with graph.inserting_before(before):
            value = graph.call_function(ops.GATHER_FROM_TP, (value, d, size, key), name="gather_from_tp")
        annotate_collective(value, arg, REPLICATE, CollectiveTag.ALL_GATHER, tp)
        if not contiguous:
            value = _in_global_order(graph, value, d, sharding, tp, before)
    return value


def _in_global_order(graph: Any, gathered: Node, d: int, sharding: DimSharding, tp: int, before: Node) -> Node:
    """The ranks' pieces (rank order, each rank's segments in local order) put back in
    global order, each range taken from the first rank that holds it; backward, the other
    holders get no gradient, and the replica groups sum what the first one gets."""
    local, pieces, seen = sharding.local_size(tp), [], set()
    for rank in range(tp):
        offset = rank * local
        for start, have, length in sharding.pieces(rank, tp):
            if have and (start, start + have) not in seen:
                seen.add((start, start + have))
                pieces.append((start, start + have, offset))
            offset += length
    pieces.sort()
    assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]] and pieces[-1][1] == sharding.size
    val = gathered.meta["val"]
    gathered.meta["val"] = val.new_empty([local * tp if i == d else s for i, s in enumerate(val.shape)])
    with graph.inserting_before(before):
        parts = [graph.call_function(aten.slice.Tensor, (gathered, d, at, at + stop - start)) for start, stop, at in pieces]
        joined = graph.call_function(aten.cat.default, (parts, d))
    for node in (*parts, joined):
        node.meta.update({k: v for k, v in gathered.meta.items() if k in ("nn_module_stack", "stack_trace")})
        node.meta[meta_keys.LAYOUT] = REPLICATE
        node.meta[meta_keys.NEEDS_GRAD] = gathered.meta.get(meta_keys.NEEDS_GRAD, False)
    for node, (start, stop, _) in zip(parts, pieces):
        node.meta["val"] = val.narrow(d, start, stop - start)
    joined.meta["val"] = val
    return joined
