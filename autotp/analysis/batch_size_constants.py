"""Numbers a forward computes on the host from its batch's size, refused in a split step.

A forward may scale a tensor by a number it computes from a shape that includes the batch:
unit scaling scales each gradient by ``1 / sqrt(x.numel())`` through a custom Function, a
hand-written norm multiplies by ``x.numel() ** -0.5``. The trace of one piece of a split step
(dp ranks x microbatches) bakes the piece's number into its graph, so every piece would compute
another function than the whole batch does, silently. The graph of a piece is compared with the
graph of twice its rows (the trace ``loss_denominators`` already asks for): a float argument of an
op on tensors, or a float constant of a custom Function's call, that differs between the two
depends on the batch's size, and the split step is refused naming its line. A 0-d value is left
out: a loss's denominator is the whole batch's by ``loss_denominators``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autotp.ir import custom_functions as calls
from autotp.ir import ops
from autotp.ir.errors import UserInputError, describe

_FUNCTIONS = (ops.FUNCTION, ops.ELEMENTWISE_FUNCTION)


def refuse_batch_size_constants(gm: GraphModule, doubled: Callable[[], GraphModule], rows: int) -> None:
    """Raise where ``gm`` (a piece of ``rows`` rows) holds a float that its trace at twice the rows,
    ``doubled``, holds otherwise."""
    if not any(_floats(n) for n in gm.graph.nodes if _asked(n)):
        return
    twice = doubled()
    by_name = {n.name: n for n in twice.graph.nodes}
    pairs = [(n, by_name.get(n.name)) for n in gm.graph.nodes if _asked(n) and n.target not in _FUNCTIONS]
    pairs += list(zip(_calls(gm), _calls(twice)))
    for node, other in pairs:
        if other is None:
            continue
        mine, theirs = _floats(node), _floats(other)
        if len(mine) == len(theirs) and mine != theirs:
            at, was = next((a, b) for a, b in zip(mine, theirs) if a != b)
            where = describe(node) + (f", custom Function {node.args[2]}" if node.target in _FUNCTIONS else "")
            raise UserInputError(
                f"the forward computes a number from its batch's size at {where}: {at:g} for a piece of {rows} rows, "
                f"{was:g} for {2 * rows}; each piece of a split step (dp ranks x microbatches) would compute another function "
                "than the whole batch does. Train with dp=1 and num_microbatches=1 (schedule='gpipe' when pp > 1), or compute "
                "that number from a size that does not include the batch"
            )


def _asked(node: Node) -> bool:
    val = node.meta.get("val")
    return node.op == "call_function" and (node.target in _FUNCTIONS or (isinstance(val, torch.Tensor) and val.dim() > 0))


def _calls(gm: GraphModule) -> Iterator[Node]:
    return (n for n in gm.graph.nodes if n.op == "call_function" and n.target in _FUNCTIONS)


def _floats(node: Node) -> list[float]:
    """The float constants ``node`` computes with: its arguments' or its Function call's."""
    leaves: list[Any] = calls.call(node.args[1]).constants if node.target in _FUNCTIONS else torch.utils._pytree.tree_leaves((node.args, node.kwargs))
    return [x for x in leaves if isinstance(x, float)]
