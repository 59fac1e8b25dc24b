"""Make FlexAttention's nodes the rank's: global head indices, and a call dynamo traces again.

A rank's ``flex_attention`` runs over the heads it holds, numbered from 0, and calls the model's
``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` with that local
``h``. What the functions read by ``h`` (ALiBi slopes, a per-head bias table, a per-head window)
is held whole (``autotp.analysis.attention_rules.flex_attention``), so each function the node
calls is replaced by a copy that first maps the local head to the global one through the rank's
ranges of the heads (``DimSharding.ranges``). Functions that never read ``h`` stay as they are.

Export's node calls the higher-order op with the tensors the functions capture as arguments of
their own, a form dynamo does not trace again (it lifts captured tensors itself, from closures):
``compile=True`` raised. Every node calls ``flex_attention_call``, which runs the node as it is
in eager mode and, under dynamo, hands the op closures over those tensors.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from autotp.analysis.attention_rules import FLEX_ATTENTION
from autotp.ir import meta_keys
from autotp.ir.layouts import Layout, resolve
from autotp.passes.runner import PassContext

aten = torch.ops.aten
SCORE_HEAD, MASK_HEAD = 2, 1  # where h comes among the placeholders of score_mod and of mask_mod


def flex_attention_call(query: Tensor, key: Tensor, value: Tensor, score_mod: GraphModule, block_mask: tuple, scale: float,
                        kernel_options: dict, score_buffers: tuple = (), mask_buffers: tuple = ()) -> tuple[Tensor, ...]:  # fmt: skip
    """The op as export traced it; under dynamo, with the captured tensors in closures."""
    if not torch.compiler.is_dynamo_compiling():
        return FLEX_ATTENTION(query, key, value, score_mod, block_mask, scale, kernel_options, score_buffers, mask_buffers)
    mask_mod = block_mask[-1]

    def score(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score_mod(s, b, h, q_idx, kv_idx, *score_buffers)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask_mod(b, h, q_idx, kv_idx, *mask_buffers)

    return FLEX_ATTENTION(query, key, value, score, (*block_mask[:-1], mask), scale, kernel_options)


def flex_attention_rank(gm: GraphModule, ctx: PassContext) -> GraphModule:
    made: dict[tuple[str, tuple[tuple[int, int], ...]], Node] = {}
    for node in list(gm.graph.nodes):
        if node.target is not FLEX_ATTENTION:
            continue
        node.target = flex_attention_call
        lay = node.meta.get(meta_keys.LAYOUT)
        var = lay[0].var_at(1) if isinstance(lay, tuple) and isinstance(lay[0], Layout) else None
        if var is None:
            continue
        ranges = tuple(resolve(var, ctx.plan.tp).ranges(ctx.tp_rank, ctx.plan.tp))
        score, block_mask = node.args[3], node.args[4]
        new_score = _with_global_heads(gm, node, score, SCORE_HEAD, ranges, made)
        new_mask = _with_global_heads(gm, node, block_mask[-1], MASK_HEAD, ranges, made)
        node.args = (*node.args[:3], new_score, (*block_mask[:-1], new_mask), *node.args[5:])
    gm.graph.eliminate_dead_code()
    return gm


def _with_global_heads(gm: GraphModule, at: Node, fn: Node, position: int, ranges: tuple[tuple[int, int], ...], made: dict) -> Node:
    """The get_attr node of ``fn``'s copy whose head placeholder is mapped to the global heads
    (``fn`` itself when it does not read it or the rank's heads are the first ones)."""
    sub = getattr(gm, fn.target)
    head = [n for n in sub.graph.nodes if n.op == "placeholder"][position]
    if not head.users or ranges == ((0, ranges[0][1]),):
        return fn
    key = (fn.target, ranges)
    if key not in made:
        new = copy.deepcopy(sub)
        graph = new.graph
        local = [n for n in graph.nodes if n.op == "placeholder"][position]
        users = list(local.users)
        with graph.inserting_after(local):
            glob = graph.call_function(aten.add.Tensor, (local, ranges[0][0]))
        taken = ranges[0][1] - ranges[0][0]
        for (_, stop), (start, end) in zip(ranges, ranges[1:]):  # past each range's end, jump to the next one's start
            with graph.inserting_after(glob):
                past = graph.call_function(aten.ge.Scalar, (local, taken))
            with graph.inserting_after(past):
                jump = graph.call_function(aten.mul.Tensor, (past, start - stop))
            with graph.inserting_after(jump):
                glob = graph.call_function(aten.add.Tensor, (glob, jump))
            taken += end - start
        for user in users:
            user.replace_input_with(local, glob)
        new.recompile()
        name = f"{fn.target}_global_heads_{len(made)}"
        gm.add_submodule(name, new)
        with gm.graph.inserting_before(at):
            made[key] = gm.graph.get_attr(name)
    return made[key]
