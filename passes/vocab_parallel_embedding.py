"""Replace lookups in vocab-sharded tables (``embedding``, and ``index``/``index_select``
of a table's rows) by the masked local lookup (a partial sum).

The all-reduce that completes the sum is inserted by ``insert_collectives`` where the
partial result first meets an op that needs the full value, so position embeddings
added before that point share the same single all-reduce.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.analysis.propagation_result import NodeRole
from autotp.analysis.shapes import schema_arg
from autotp.passes.runner import PassContext
from autotp.ir.errors import UserInputError


def vocab_parallel_embedding(gm: GraphModule, ctx: PassContext) -> GraphModule:
    for node in gm.graph.nodes:
        if node.meta.get(meta_keys.ROLE) is not NodeRole.VOCAB_EMBEDDING:
            continue
        weight, ids, padding_idx, by_frequency = _lookup(node)
        wrap = node.target is torch.ops.aten.index.Tensor  # ``table[ids]`` reads a negative id from the end
        table = _parameter_behind(weight)
        layout = ctx.plan.layout_of(str(table.target))
        assert layout is not None and layout.dim == 0, f"{table.target} is not vocab-sharded in the plan"
        (start, stop), = layout.sharding.ranges(ctx.tp_rank, ctx.plan.tp)
        stop = min(stop, layout.sharding.size)
        node.target = ops.VOCAB_PARALLEL_EMBEDDING
        node.args = (weight, ids, start, stop, layout.sharding.size, padding_idx, wrap, by_frequency)
        node.kwargs = {}
    return gm


def _parameter_behind(table: Node) -> Node:
    """The parameter a lookup's table is made from: a frozen table is read through ``detach``,
    a cast through ``_to_copy``, whose rows are the parameter's."""
    while table.op == "call_function" and len(table.all_input_nodes) == 1:
        table = table.all_input_nodes[0]
    return table


def _lookup(node: Node) -> tuple[Node, Node, int, bool]:
    """The table, the row ids, the padding row of a lookup (-1: none) and whether its
    gradient is scaled by the ids' frequency."""
    if node.target is torch.ops.aten.index.Tensor:
        return node.args[0], node.args[1][0], -1, False
    if node.target is torch.ops.aten.index_select.default:
        return node.args[0], node.args[2], -1, False
    weight = node.args[0]
    if schema_arg(node, "sparse", False):
        raise UserInputError(f"sparse embedding gradients are not supported with a vocab-parallel table ({weight.target})")
    return weight, node.args[1], schema_arg(node, "padding_idx", -1), schema_arg(node, "scale_grad_by_freq", False)
