"""Run the sequence-parallel collectives behind their GEMMs (``plan.tp_overlap``).

After ``sequence_parallel`` each column-parallel GEMM reads an ``all_gather`` of the
sequence shard, and each row-parallel GEMM feeds a ``reduce_scatter``. This pass fuses
each such pair into one op whose kernel pipelines the two (``autotp.runtime.execution.overlap``):

* ``all_gather`` (in ``plan.tp_overlap`` as ``all_gather``) whose every user is a GEMM with
  it as the activation -> one ``all_gather_matmul(x, [w1, w2, ...])`` for all of them
  (q/k/v, gate/up share one), each GEMM's output a ``getitem`` of it. Recognised GEMMs:
  ``linear(ag, W[, b])`` (weight ``t(W)``, bias added after), ``matmul(ag, W)`` with a 2-d W,
  and ``mm(v, W)`` / ``addmm(b, v, W)`` on ``v = view(ag, [-1, K])`` (GPT-2's Conv1D; the
  output is flattened back the same way). Backward, its grad is one
  ``matmul_reduce_scatter`` of all the output grads.
* ``reduce_scatter`` (``reduce_scatter``) of ``linear(x, W)`` (no bias: a row-parallel bias
  is added after the reduction), ``matmul(x, W)``, or ``view(mm(view(x, [-1, K]), W), ...)``
  (GPT-2) -> ``matmul_reduce_scatter([x], [W])``; backward an ``all_gather_matmul`` of the
  output grad, whose gathered grad the weight grad reuses.

An all-gather with any other user (attention reading the gathered activation, the MoE
dispatch) and a reduce-scatter of anything else (a sum over experts) stay as they are;
``autotp explain`` and the op counts show which were fused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from autotp.analysis.shapes import shape_of
from autotp.ir import meta_keys, ops
from autotp.ir.layouts import Layout
from autotp.ir.op_facts import CollectiveTag, is_reshape
from autotp.ir.plan import OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER
from autotp.passes.runner import PassContext

aten = torch.ops.aten


def tp_overlap(gm: GraphModule, ctx: PassContext) -> GraphModule:
    plan = ctx.plan
    if not plan.tp_overlap or plan.tp == 1:
        return gm
    if plan.tp_overlap_impl not in ops.OVERLAP_IMPLS:
        raise AssertionError(f"plan.tp_overlap_impl {plan.tp_overlap_impl!r} is not one of {ops.OVERLAP_IMPLS}")
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or len(node.args) < 4 or node.args[3] != ctx.group:
            continue
        if node.target is ops.ALL_GATHER and OVERLAP_ALL_GATHER in plan.tp_overlap:
            _fuse_all_gather(gm.graph, node, plan.tp_overlap_impl)
        elif node.target is ops.REDUCE_SCATTER and OVERLAP_REDUCE_SCATTER in plan.tp_overlap:
            _fuse_reduce_scatter(gm.graph, node, plan.tp_overlap_impl)
    return gm


def _is_call(node: object, *targets: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _is_reshape(node: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and is_reshape(node.target)


def _flattens(view: Node, source: Node) -> bool:
    """``view`` is ``source`` with its leading dims merged into one: ``[-1, K]``."""
    before, after = shape_of(source), shape_of(view)
    return before is not None and after is not None and len(after) == 2 and len(before) >= 3 and after[-1] == before[-1]


def _two_d(node: object) -> bool:
    return isinstance(node, Node) and len(shape_of(node) or ()) == 2


@dataclass(frozen=True)
class _Consumer:
    """One GEMM (``out``) reading the gathered activation: its weight ([K, N], after ``t`` when
    ``transpose``), its bias, and whether it reads the activation flattened to [M, K]."""

    out: Node
    weight: Node
    transpose: bool
    bias: object
    flat: bool


def _consumers(ag: Node) -> list[_Consumer] | None:
    found: list[_Consumer] = []
    for user in ag.users:
        if _is_call(user, aten.linear.default) and user.args[0] is ag and _two_d(user.args[1]) and user.args[1] is not ag:
            bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
            found.append(_Consumer(user, user.args[1], True, bias, False))
        elif _is_call(user, aten.matmul.default) and user.args[0] is ag and _two_d(user.args[1]):
            found.append(_Consumer(user, user.args[1], False, None, False))
        elif _is_reshape(user) and _flattens(user, ag) and user.users:
            for mm in user.users:
                if _is_call(mm, aten.mm.default) and mm.args[0] is user and mm.args[1] is not user:
                    found.append(_Consumer(mm, mm.args[1], False, None, True))
                elif _is_call(mm, aten.addmm.default) and mm.args[1] is user and mm.args[2] is not user and not mm.kwargs:
                    found.append(_Consumer(mm, mm.args[2], False, mm.args[0], True))
                else:
                    return None
        else:
            return None
    return found or None


def _retarget_layout(lay: object, ndim: int) -> object:
    """A flattened GEMM output's layout ([M, N]) moved onto its unflattened form ([..., N])."""
    if not isinstance(lay, Layout):
        return lay
    return Layout(tuple((ndim - 1 if d in (1, -1) else d, v) for d, v in lay.dims), lay.partial)


def _copy_site(new: Node, source: Node) -> None:
    for key in ("nn_module_stack", "stack_trace", meta_keys.NEEDS_GRAD, meta_keys.LAYER):
        if key in source.meta:
            new.meta[key] = source.meta[key]


def _fuse_all_gather(graph: Graph, ag: Node, impl: str) -> None:
    consumers = _consumers(ag)
    if consumers is None:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((c.out for c in consumers), key=order.__getitem__)
    if any(order[c.weight] > order[first] or (isinstance(c.bias, Node) and order[c.bias] > order[first]) for c in consumers):
        return
    x, dim, tp, group = ag.args
    full = ag.meta["val"]
    with graph.inserting_before(first):
        weights = [transposed_weight(graph, c.weight) if c.transpose else c.weight for c in consumers]
        fused = graph.call_function(ops.ALL_GATHER_MATMUL, (x, weights, dim, tp, group, impl), name="all_gather_matmul")
    vals, layouts = [full], [ag.meta.get(meta_keys.LAYOUT)]
    for c in consumers:
        out_val = c.out.meta["val"]
        vals.append(out_val.reshape(*full.shape[:-1], out_val.shape[-1]) if c.flat else out_val)
        layouts.append(_retarget_layout(c.out.meta.get(meta_keys.LAYOUT), full.dim()) if c.flat else c.out.meta.get(meta_keys.LAYOUT))
    fused.meta.update({k: v for k, v in ag.meta.items() if k not in ("val", meta_keys.LAYOUT)})
    _copy_site(fused, first)
    fused.meta["val"], fused.meta[meta_keys.LAYOUT] = vals, tuple(layouts)
    fused.meta[meta_keys.COLLECTIVE] = CollectiveTag.ALL_GATHER_MATMUL
    fused.meta[meta_keys.NEEDS_GRAD] = any(n.meta.get(meta_keys.NEEDS_GRAD) for n in (ag, *(c.out for c in consumers)))
    for i, c in enumerate(consumers, start=1):
        with graph.inserting_before(c.out):
            out = graph.call_function(operator.getitem, (fused, i))
            out.meta.update(c.out.meta)
            out.meta["val"], out.meta[meta_keys.LAYOUT] = vals[i], layouts[i]
            if c.flat:
                out = _follow(graph, aten.flatten.using_ints, (out, 0, -2), c.out, c.out.meta["val"])
            if c.bias is not None:
                out = _follow(graph, aten.add.Tensor, (out, c.bias), c.out, c.out.meta["val"])
        c.out.replace_all_uses_with(out)
        graph.erase_node(c.out)
    for view in [u for u in ag.users if not u.users]:
        graph.erase_node(view)
    graph.erase_node(ag)


def transposed_weight(graph: Graph, weight: Node) -> Node:
    """``t(weight)``: a linear's [N, K] weight in the ops' [K, N] matmul layout."""
    t = graph.call_function(aten.t.default, (weight,))
    t.meta["val"] = weight.meta["val"].t()
    lay = weight.meta.get(meta_keys.LAYOUT)
    t.meta[meta_keys.LAYOUT] = Layout(tuple((1 - d, v) for d, v in lay.dims), lay.partial) if isinstance(lay, Layout) else lay
    _copy_site(t, weight)
    return t


def _follow(graph: Graph, target: object, args: tuple, like: Node, val: object) -> Node:
    """A node computing ``target(*args)`` that stands for ``like`` (its meta, value ``val``)."""
    node = graph.call_function(target, args)
    node.meta.update(like.meta)
    node.meta["val"] = val
    return node


def _producer(y: Node) -> tuple[Node, Node, bool, tuple[Node, ...]] | None:
    """(x, weight, transpose, nodes to drop) when ``y``, read only by the reduce-scatter, is a GEMM of x."""
    if len(y.users) != 1:
        return None
    if _is_call(y, aten.linear.default) and len(y.args) == 2 and not y.kwargs and _two_d(y.args[1]):
        return y.args[0], y.args[1], True, (y,)
    if _is_call(y, aten.matmul.default) and _two_d(y.args[1]):
        return y.args[0], y.args[1], False, (y,)
    if _is_reshape(y) and _is_call(y.args[0], aten.mm.default) and len(y.args[0].users) == 1:
        mm = y.args[0]
        flat = mm.args[0]
        if _is_reshape(flat) and _flattens(flat, flat.args[0]) and shape_of(flat.args[0])[:-1] == shape_of(y)[:-1]:
            return flat.args[0], mm.args[1], False, (y, mm, flat)
    return None


def _fuse_reduce_scatter(graph: Graph, rs: Node, impl: str) -> None:
    y, dim, tp, group = rs.args
    found = _producer(y)
    if found is None:
        return
    x, weight, transpose, gone = found
    with graph.inserting_before(rs):
        if transpose:
            weight = transposed_weight(graph, weight)
        fused = graph.call_function(ops.MATMUL_REDUCE_SCATTER, ([x], [weight], dim, tp, group, impl), name="matmul_reduce_scatter")
    fused.meta.update(rs.meta)
    _copy_site(fused, gone[1] if len(gone) > 1 else gone[0])  # the GEMM
    fused.meta[meta_keys.COLLECTIVE] = CollectiveTag.MATMUL_REDUCE_SCATTER
    rs.replace_all_uses_with(fused)
    graph.erase_node(rs)
    for n in gone:
        if not n.users:
            graph.erase_node(n)
