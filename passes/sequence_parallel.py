"""Sequence parallelism (Megatron SP): the replicated regions between TP regions run on
1/tp of the tokens (``plan.sequence_parallel``).

After ``insert_collectives`` the layouts say which values are replicated: everything
between a g (``reduce_from_tp`` of a row-parallel output) and the next f (``copy_to_tp``
before a column-parallel matmul) is computed whole on every rank: residual adds, norms,
dropout. This pass gives those values the layout *sharded on the sequence dim* (dim 1 of
a ``[batch, seq, ...]`` activation):

* a g whose output is ``[B, S, ...]``, the features last as its producer made them,
  becomes ``reduce_scatter`` on dim 1 (backward all-gather); a g followed only by a
  ``view`` to ``[B, S, ...]`` (MoE's flattened tokens) first trades places with that
  view, which is linear;
* a node joins the region when one of its inputs is in it and the op is token-wise:
  pointwise ops, dtype casts, ``layer_norm``, reductions and softmax over dims other than
  the sequence dim, a matmul whose other operand is replicated and the same for every
  token (a weight, not attention's values), dropout (its mask then comes from the
  tp-sharded RNG stream), provided its output is ``[B, S, ...]`` like its region input;
* a replicated operand from outside the region that carries the full sequence at the
  aligned dim (position embeddings, token-type embeddings) is sliced to this rank's
  tokens (``scatter_to_tp``, backward all-gather);
* an f reading a region value becomes ``all_gather`` on dim 1 (backward reduce-scatter,
  which sums the partial grads the column-parallel matmuls produce, as f did);
* any other consumer of a region value (a view, the MoE dispatch, attention, a graph
  output) reads it through ``gather_from_tp`` (backward: this rank's slice, since the
  consumer computes replicated values and gets the same grad on every rank);
* unless that replicated computation ends in f's (the MoE router and dispatch before the
  column-parallel experts): then the f's go, its gradients stay partial summands, and
  ``gather_from_tp`` becomes ``all_gather``, whose backward reduce-scatter sums them
  (``_reduce_scatter_partial_grads``): no all-reduce is left in the MoE layer's backward.

Region values carry ``Layout`` ``Shard(1)`` with a ``DimVar`` of the sequence length, so
local shapes (pipeline receive buffers included) come out as ``S / tp``. A sequence that
``tp`` does not divide cannot be split: the pass raises ``ValueError``.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from autotp.ir.errors import UserInputError
from autotp.analysis.shapes import shape_of
from autotp.ir import meta_keys, ops
from autotp.ir.layouts import REPLICATE, DimVar, Layout, shard
from autotp.ir.op_facts import CollectiveTag, is_pointwise, is_reshape
from autotp.passes.insert_collectives import annotate_collective
from autotp.passes.runner import PassContext

aten = torch.ops.aten
SEQ = 1
_CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default,
                    aten.detach.default, aten.contiguous.default, aten.to.dtype_layout})  # fmt: skip
_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction,
                         aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int})  # fmt: skip
_DROPOUTS = frozenset({aten.dropout.default, ops.TP_DROPOUT})
_MOVES_DIMS = frozenset({aten.permute.default, aten.transpose.int, aten.t.default})
_KEEPS_DIMS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                         aten.squeeze.dim, aten.contiguous.default, aten.clone.default, aten.expand.default})  # fmt: skip
# Collective tags (``meta_keys.COLLECTIVE``) of the ops this pass inserts.


def sequence_parallel(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if not ctx.plan.sequence_parallel or ctx.plan.tp == 1:
        return gm
    graph, tp = gm.graph, ctx.plan.tp
    for node in list(graph.nodes):
        if _is_g(node, ctx.group) and _tokens(node) is None:
            _swap_with_view(graph, node)
    region: dict[Node, int] = {}  # node -> sequence length
    var: dict[int, DimVar] = {}
    fs: dict[Node, Node] = {}  # trainable operand -> its f
    for node in list(graph.nodes):
        seq = _joins(node, region, ctx.group)
        if seq is None:
            continue
        if seq % tp:
            raise UserInputError(
                f"sequence parallelism splits the sequence of {node.name} ({seq} tokens) over tp={tp} ranks; "
                f"pad the sequence to a multiple of {tp} or pass sequence_parallel=False"
            )
        region[node] = seq
        node.meta[meta_keys.LAYOUT] = shard({SEQ: var.setdefault(seq, DimVar(seq, frozenset()))})
        _adapt_outside_operands(graph, node, region, var[seq], ctx.group, tp, fs)
    for node in [n for n in region if _is_g(n, ctx.group)]:
        if not any(u in region for u in node.users):  # nothing token-wise reads it: stay an all-reduce
            del region[node]
            node.meta[meta_keys.LAYOUT] = REPLICATE
    for node in list(region):
        if _is_g(node, ctx.group):
            with graph.inserting_before(node):
                rs = graph.call_function(ops.REDUCE_SCATTER, (node.args[0], SEQ, tp, ctx.group), name="reduce_scatter")
            rs.meta.update(node.meta)
            rs.meta[meta_keys.COLLECTIVE] = CollectiveTag.REDUCE_SCATTER
            node.replace_all_uses_with(rs)
            graph.erase_node(node)
            region[rs] = region.pop(node)
        elif node.target is ops.TP_DROPOUT:
            node.args = (*node.args[:3], ops.SHARDED)
    for node in list(region):
        full = _gather_for_outside_users(graph, node, region, ctx.group, tp)
        if full is not None:
            _reduce_scatter_partial_grads(graph, full, ctx.group, tp)
    return gm


def _is_g(node: Node, group: str) -> bool:
    return node.op == "call_function" and node.target is ops.REDUCE_FROM_TP and node.args[1] == group


def _tokens(node: Node) -> int | None:
    """The sequence length of a ``[B, S, ...]`` activation (3-D or more), else None."""
    shape = shape_of(node)
    return int(shape[SEQ]) if shape is not None and len(shape) >= 3 else None


def _swap_with_view(graph: Graph, g: Node) -> None:
    """``view(g(x) [+ bias])`` -> ``g(view(x)) [+ bias]`` when g reaches, through single-user
    pointwise ops whose other operands are at most 1-D (a bias), a view to ``[B, S, ...]``
    with the same last dim (GPT-2's Conv1D and MoE's flattened tokens)."""
    chain = [g]
    while len(chain[-1].users) == 1:
        (user,) = chain[-1].users
        if is_reshape(user.target) and _tokens(user) is not None and shape_of(user)[-1] == shape_of(g)[-1]:
            break
        if not _bias_like(user, chain[-1]):
            return
        chain.append(user)
    else:
        return
    view_node = next(iter(chain[-1].users))
    shape = list(shape_of(view_node))
    x = g.args[0]
    with graph.inserting_before(g):
        view = graph.call_function(view_node.target, (x, shape), name="view")
    view.meta["val"] = x.meta["val"].reshape(shape)
    view.meta[meta_keys.LAYOUT] = x.meta.get(meta_keys.LAYOUT)
    view.meta[meta_keys.NEEDS_GRAD] = x.meta.get(meta_keys.NEEDS_GRAD, False)
    g.replace_input_with(x, view)
    for n in chain:
        n.meta["val"] = n.meta["val"].reshape(shape)
    view_node.replace_all_uses_with(chain[-1])
    graph.erase_node(view_node)


def _bias_like(node: Node, source: Node) -> bool:
    if not is_pointwise(node.target):
        return False
    others = [a for a in node.all_input_nodes if a is not source]
    return all(len(shape_of(a) or ()) <= 1 for a in others)


def _joins(node: Node, region: dict[Node, int], group: str) -> int | None:
    """The sequence length if ``node`` joins the region (see the module docstring), else None."""
    if node.op != "call_function":
        return None
    seq = _tokens(node)
    if seq is None or seq < 2:
        return None
    if _is_g(node, group):
        return seq if _features_last(node.args[0]) else None
    inside = [a for a in node.all_input_nodes if a in region]
    if not inside or any(region[a] != seq or _tokens(a) != seq or len(shape_of(a)) != len(shape_of(node)) for a in inside):
        return None
    outside = [a for a in node.all_input_nodes if a not in region]
    if any(not _replicated(a) for a in outside):
        return None
    target, ndim = node.target, len(shape_of(node))
    if target in _CASTS or target in _DROPOUTS:
        return seq if node.args[0] in region else None
    if target in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        return seq if dims and all(d % ndim != SEQ for d in dims) else None
    if target is aten.layer_norm.default:
        return seq if len(node.args[1]) < ndim - SEQ and node.args[0] in region else None
    if target in (aten.linear.default, aten.matmul.default, aten.mm.default):  # the other operand the same for every token
        other = node.args[1]
        return seq if node.args[0] in region and other not in region and _broadcasts(other, ndim, seq) == -1 else None
    if is_pointwise(target):
        return seq if all(_broadcasts(a, ndim, seq) is not None for a in outside) else None
    return None


def _features_last(partial: Node) -> bool:
    """Whether the value a g reduces keeps its producer's last dim (the features) last through
    the views and permutes between them: ``[B, S, ..., D]`` tokens, not an attention bias
    ``[1, H, S, S]`` permuted out of a table lookup, whose dim 1 is the heads."""
    node = partial
    while node.op == "call_function" and node.target in _MOVES_DIMS | _KEEPS_DIMS and isinstance(node.args[0], Node):
        rank = len(shape_of(node) or ())
        if node.target is aten.permute.default and node.args[1][-1] % rank != rank - 1:
            return False
        if node.target is aten.transpose.int and rank - 1 in (node.args[1] % rank, node.args[2] % rank):
            return False
        if node.target is aten.t.default and rank == 2:
            return False
        node = node.args[0]
    return True


def _replicated(node: Node) -> bool:
    lay = node.meta.get(meta_keys.LAYOUT)
    return not isinstance(lay, Layout) or lay.replicated


def _broadcasts(node: Node, ndim: int, seq: int) -> int | None:
    """For an outside operand of a pointwise op with a ``ndim``-D output: the dim aligned with
    the sequence when it holds the whole sequence (to slice), -1 when it broadcasts, None if neither."""
    shape = shape_of(node)
    if shape is None:
        return -1
    aligned = SEQ - (ndim - len(shape))
    if aligned < 0 or shape[aligned] == 1:
        return -1
    return aligned if shape[aligned] == seq else None


def _adapt_outside_operands(
    graph: Graph, node: Node, region: dict[Node, int], var: DimVar, group: str, tp: int, fs: dict[Node, Node]
) -> None:
    """Slice whole-sequence operands to this rank's tokens; put f on the other trainable ones
    (a norm weight sees this rank's tokens only, so its grad is partial)."""
    if _is_g(node, group):
        return
    pointwise = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
    ndim, seq = len(shape_of(node)), region[node]
    for a in [a for a in node.all_input_nodes if a not in region]:
        dim = _broadcasts(a, ndim, seq) if pointwise else None
        if dim is not None and dim >= 0:
            with graph.inserting_before(node):
                part = graph.call_function(ops.SCATTER_TO_TP, (a, dim, seq // tp, group), name="scatter_to_tp")
            annotate_collective(part, a, shard({dim: var}), CollectiveTag.SCATTER, tp, located_at=node)
            node.replace_input_with(a, part)
        elif a.meta.get(meta_keys.NEEDS_GRAD):
            if a not in fs:
                with graph.inserting_after(a):
                    fs[a] = graph.call_function(ops.COPY_TO_TP, (a, group), name="copy_to_tp")
                annotate_collective(fs[a], a, a.meta.get(meta_keys.LAYOUT), CollectiveTag.ALL_REDUCE_BACKWARD, tp, located_at=node)
            node.replace_input_with(a, fs[a])


def _gather_for_outside_users(graph: Graph, node: Node, region: dict[Node, int], group: str, tp: int) -> Node | None:
    """Replace f's reading ``node`` by all-gathers; other outside users read one ``gather_from_tp``, returned."""
    full: Node | None = None
    for user in [u for u in node.users if u not in region]:
        if _is_f(user, group):
            user.replace_all_uses_with(_all_gather_for(graph, node, user, tp, group))
            graph.erase_node(user)
            continue
        fs = list(user.users)
        if is_reshape(user.target) and fs and all(_is_f(f, group) for f in fs):  # view -> f: gather, then view
            user.replace_input_with(node, _all_gather_for(graph, node, fs[0], tp, group))
            for f in fs:
                f.replace_all_uses_with(user)
                graph.erase_node(f)
            continue
        if full is None:
            with graph.inserting_after(node):
                full = graph.call_function(ops.GATHER_FROM_TP, (node, SEQ, region[node], group), name="gather_from_tp")
            annotate_collective(full, node, REPLICATE, CollectiveTag.ALL_GATHER, tp)
        user.replace_input_with(node, full)
    return full


def _is_f(node: Node, group: str) -> bool:
    return node.op == "call_function" and node.target is ops.COPY_TO_TP and node.args[1] == group


def _all_gather_for(graph: Graph, node: Node, f: Node, tp: int, group: str) -> Node:
    """An all-gather of ``node`` standing where f was (backward: reduce-scatter of the partial grads)."""
    with graph.inserting_after(node):
        gathered = graph.call_function(ops.ALL_GATHER, (node, SEQ, tp, group), name="all_gather")
    annotate_collective(gathered, node, REPLICATE, CollectiveTag.SEQUENCE_ALL_GATHER, tp, located_at=f)
    return gathered


def _reduce_scatter_partial_grads(graph: Graph, full: Node, group: str, tp: int) -> None:
    """``gather_from_tp`` -> ``all_gather`` when the gathered tokens feed f's through replicated ops.

    The replicated computation between ``full`` and f's (``_partial_grad_region``: the MoE
    router and dispatch) gets whole gradients from the f's backward all-reduces. A backward
    is linear in the output gradient, and these ops compute the same forward values on every
    rank, so the sum over ranks of each rank's backward of its partial gradients is the
    backward of their sum: the f's can go, and every gradient in that computation is then a
    partial summand. The all-gather's backward reduce-scatter sums the summands and keeps
    this rank's tokens (Megatron's pair), where ``gather_from_tp`` took a slice of a whole
    gradient after the f's all-reduces. Where a gradient enters that computation whole (a
    router's logits read by an auxiliary loss, a graph output), ``partial_grad`` divides it
    by tp so that the ranks' sum counts it once; a parameter read there (the router weight)
    gets an f on those reads, as its gradient there is a summand too.
    """
    found = _partial_grad_region(full, group)
    if found is None:
        return
    inside, sinks, blocker = found
    if blocker is not None:
        for f in sinks:
            f.meta[meta_keys.KEPT_ALL_REDUCE] = blocker
        return
    with graph.inserting_after(full):
        gathered = graph.call_function(ops.ALL_GATHER, (full.args[0], SEQ, tp, group), name="all_gather")
    annotate_collective(gathered, full.args[0], REPLICATE, CollectiveTag.SEQUENCE_ALL_GATHER, tp, located_at=full)
    full.replace_all_uses_with(gathered)
    graph.erase_node(full)
    for node in [gathered, *inside]:
        whole = [u for u in node.users if u not in inside and u not in sinks and _takes_grad(u)]
        if isinstance(node.meta.get("val"), (tuple, list)):  # its outputs leave by getitems: divide there
            for item in whole:
                _divide_grad(graph, item, [u for u in item.users if _takes_grad(u)], tp)
        elif whole:
            _divide_grad(graph, node, whole, tp)
    for f in sinks:
        f.replace_all_uses_with(f.args[0])
        graph.erase_node(f)
    fs: dict[Node, Node] = {}
    for node in inside:
        for a in [a for a in node.all_input_nodes if a.op == "get_attr" and a.meta.get(meta_keys.NEEDS_GRAD)]:
            if a not in fs:
                with graph.inserting_after(a):
                    fs[a] = graph.call_function(ops.COPY_TO_TP, (a, group), name="copy_to_tp")
                annotate_collective(fs[a], a, a.meta.get(meta_keys.LAYOUT), CollectiveTag.ALL_REDUCE_BACKWARD, tp, located_at=node)
            node.replace_input_with(a, fs[a])


def _divide_grad(graph: Graph, node: Node, users: list[Node], tp: int) -> None:
    """``users`` read ``node`` through ``partial_grad``: the whole gradient they send back is
    divided by tp, so that the ranks' sum of their partial summands counts it once."""
    if not users:
        return
    with graph.inserting_after(node):
        shared = graph.call_function(ops.PARTIAL_GRAD, (node, tp), name="partial_grad")
    shared.meta.update({k: v for k, v in node.meta.items() if k != meta_keys.COLLECTIVE})
    for user in users:
        user.replace_input_with(node, shared)


def _takes_grad(user: Node) -> bool:
    """Whether a gradient flows back from ``user`` (the graph output, or an op whose value needs one)."""
    return user.op == "output" or bool(user.meta.get(meta_keys.NEEDS_GRAD))


def _partial_grad_region(full: Node, group: str) -> tuple[dict[Node, None], list[Node], str | None] | None:
    """(the replicated nodes on the paths from ``full`` to f's, those f's, why they must stay), or
    None when there is no such f. They stay when a node on those paths reads an activation from
    elsewhere that needs a gradient: that gradient would be a partial summand too, and no
    collective of this rank's tokens would sum it."""
    after: dict[Node, None] = {}
    sinks: dict[Node, None] = {}
    stack = [full]
    while stack:
        for user in stack.pop().users:
            if user in after or user in sinks:
                continue
            if _is_f(user, group):
                sinks[user] = None
            elif user.op == "call_function" and user.meta.get(meta_keys.NEEDS_GRAD) and _all_replicated(user) \
                    and meta_keys.COLLECTIVE not in user.meta:  # fmt: skip
                after[user] = None
                stack.append(user)
    if not sinks:
        return None
    inside: dict[Node, None] = {}
    stack = [f.args[0] for f in sinks]
    while stack:
        node = stack.pop()
        if node in after and node not in inside:
            inside[node] = None
            stack.extend(node.all_input_nodes)
    for node in inside:
        for a in node.all_input_nodes:
            if a is not full and a not in inside and a.op != "get_attr" and a.meta.get(meta_keys.NEEDS_GRAD):
                why = (f"'{node.name}' reads both the tokens gathered at '{full.name}' and '{a.name}', which needs a "
                       "gradient from elsewhere: without this all-reduce that gradient would stay a partial sum")
                return inside, list(sinks), why
    return inside, list(sinks), None


def _all_replicated(node: Node) -> bool:
    lay = node.meta.get(meta_keys.LAYOUT)
    return all(not isinstance(l, Layout) or l.replicated for l in (lay if isinstance(lay, tuple) else (lay,)))
