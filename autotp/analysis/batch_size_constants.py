"""Numbers a custom Function is handed from its batch's size, refused in a split step.

Unit scaling scales each gradient by ``1 / sqrt(x.numel())`` through a custom Function whose
call holds that number. The trace of one piece of a split step (dp ranks x microbatches) bakes
the piece's number into the call, so every piece would compute another function than the whole
batch does, silently. Where a graph holds such calls, it is compared with the graph of twice its
rows (the trace ``loss_denominators`` may ask for too): a float constant of a call that differs
between the two depends on the batch's size, and the split step is refused naming the Function.
Floats in the arguments of plain ops are not compared: a router's load-balancing loss divides by
the piece's token count, which autotp computes per piece on purpose (``plan.batch_statistics``),
and a plain op's number from the batch's size is not told apart from it yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from torch.fx import GraphModule, Node

from autotp.ir import custom_functions as calls
from autotp.ir import ops
from autotp.ir.errors import UserInputError, describe

_FUNCTIONS = (ops.FUNCTION, ops.ELEMENTWISE_FUNCTION)


def refuse_batch_size_constants(gm: GraphModule, doubled: Callable[[], GraphModule], rows: int) -> None:
    """Raise where ``gm`` (a piece of ``rows`` rows) holds a float that its trace at twice the rows,
    ``doubled``, holds otherwise."""
    if not any(_floats(n) for n in _calls(gm)):
        return
    for node, other in zip(_calls(gm), _calls(doubled())):
        mine, theirs = _floats(node), _floats(other)
        if len(mine) == len(theirs) and mine != theirs:
            at, was = next((a, b) for a, b in zip(mine, theirs) if a != b)
            where = f"{describe(node)}, custom Function {node.args[2]}"
            raise UserInputError(
                f"the forward computes a number from its batch's size at {where}: {at:g} for a piece of {rows} rows, "
                f"{was:g} for {2 * rows}; each piece of a split step (dp ranks x microbatches) would compute another function "
                "than the whole batch does. Train with dp=1 and num_microbatches=1 (schedule='gpipe' when pp > 1), or compute "
                "that number from a size that does not include the batch"
            )


def _calls(gm: GraphModule) -> Iterator[Node]:
    return (n for n in gm.graph.nodes if n.op == "call_function" and n.target in _FUNCTIONS)


def _floats(node: Node) -> list[float]:
    """The float constants of the Function call at ``node``."""
    return [x for x in calls.call(node.args[1]).constants if isinstance(x, float)]
