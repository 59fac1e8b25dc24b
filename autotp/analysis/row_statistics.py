"""Where a statistic over the batch's rows meets each row's values (``batch_rows``' last check): a reduction
over a dim holding the rows, a matmul contracting them, or an accumulating scatter of them into slots that
hold no rows, whose result then combines with float values that still hold rows (``x - x.mean(0)``, a
quantization scale ``x.abs().amax()``): each row's result depends on the other rows of its piece."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from autotp.analysis.shapes import is_float, norm_dim, schema_arg, shape_of
from autotp.analysis.statistic_rules import REDUCTIONS, reduced_dims
from autotp.ir.op_facts import op_name

ROW_STATISTICS = REDUCTIONS | {
    torch.ops.aten.amax.default, torch.ops.aten.amin.default, torch.ops.aten.aminmax.default, torch.ops.aten.max.default,
    torch.ops.aten.min.default, torch.ops.aten.logsumexp.default, torch.ops.aten.var_mean.correction,
    torch.ops.aten.std_mean.correction, torch.ops.aten.norm.ScalarOpt_dim,
}  # fmt: skip


def statistic_meets_rows(gm: GraphModule, rows_at: Callable[[Node], set[int]]) -> tuple[Node, Node] | None:
    """The first op that combines a float statistic over the batch rows with float values
    that still hold rows, so that each row's result depends on the other rows of its piece,
    and the reduction the statistic comes from. A statistic that only meets other statistics
    (a mean loss, an auxiliary loss of per-expert means) keeps the rows apart."""
    source: dict[Node, Node] = {}  # a node computed from a statistic over rows -> that reduction
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        tainted = [a for a in node.all_input_nodes if a in source]
        if tainted:
            stats = [a for a in tainted if is_float(a)]
            rows = [a for a in node.all_input_nodes if a not in source and is_float(a) and rows_at(a)]
            if stats and rows and rows_at(node):
                return node, source[stats[0]]
            source[node] = source[tainted[0]]
        elif _contracts_rows(node, rows_at):
            source[node] = node
        elif node.target in ROW_STATISTICS and is_float(node.args[0]):
            if set(reduced_dims(node, len(shape_of(node.args[0]) or ()))) & rows_at(node.args[0]):
                source[node] = node
        elif _scatters_rows(node, rows_at):
            source[node] = node
    return None


def _contracts_rows(node: Node, rows_at: Callable[[Node], set[int]]) -> bool:
    """A matmul whose contracted dim holds the rows in both operands (Liger's weight gradient
    ``d_logits.t() @ x``, a Gram matrix ``x.t() @ x``): a sum over the rows."""
    if op_name(node.target) not in ("mm", "matmul", "bmm") or len(node.args) < 2:
        return False
    (a, sa), (b, sb) = ((x, shape_of(x) or ()) for x in node.args[:2])
    return len(sa) >= 2 and len(sb) >= 2 and len(sa) - 1 in rows_at(a) and len(sb) - 2 in rows_at(b)


# scatters that accumulate: op -> positions of (dim, values)
_ACCUMULATING_SCATTERS = {
    torch.ops.aten.index_add.default: (1, 3), torch.ops.aten.scatter_add.default: (1, 3),
    torch.ops.aten.scatter_reduce.two: (1, 3), torch.ops.aten.index_reduce.default: (1, 3),
}  # fmt: skip


def _scatters_rows(node: Node, rows_at: Callable[[Node], set[int]]) -> bool:
    """An accumulating scatter of values whose rows lie on the scattered dim into a tensor that
    holds no rows there (messages summed into a graph's nodes, ``zeros(n).index_add(0, dst, m)``):
    each slot is a statistic over whichever rows the index sends to it. Into a tensor holding the
    rows there (an MoE's combine into ``zeros_like(tokens)``) the slots are the rows themselves."""
    if node.target is torch.ops.aten.index_put.default:
        dim, values, accumulates = 0, node.args[2], schema_arg(node, "accumulate", False)
    elif node.target in _ACCUMULATING_SCATTERS:
        at_dim, at_values = _ACCUMULATING_SCATTERS[node.target]
        dim, values, accumulates = node.args[at_dim], node.args[at_values], True
    else:
        return False
    if not (accumulates and isinstance(values, Node) and is_float(values) and isinstance(dim, int)):
        return False
    rank = len(shape_of(node) or ())
    return norm_dim(dim, rank) in rows_at(values) and norm_dim(dim, rank) not in rows_at(node)
