"""Sizes known only at run time that an op asks about while tracing.

A slice at bounds read from the data (``x[:, a:b]`` with ``a, b`` from ``.tolist()``) has a
size export knows only as an unbacked symbol ``u``. An op's kernel may then ask whether that
size is 0 or 1 (``scaled_dot_product_attention`` asks ``Eq(u, 0)``), which export cannot
answer: it raises ``GuardOnDataDependentSymNode``. Where the op's own inputs have a dim of
size exactly ``u``, the trace takes PyTorch's size-oblivious answer (the size is neither 0 nor
1), states it with ``torch._check`` (a run-time assertion in the graph) and calls the op
again. After the trace, ``name_assumptions`` rewrites each such assertion's message to name
the source line and what was assumed, so a run whose size is 0 (an empty document) fails
there, not with numbers the traced graph did not compute for it.

Any other question export cannot answer is left to raise.
"""

from __future__ import annotations

import linecache
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import sympy
import torch
from torch.fx import Graph, Node
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils._sympy.symbol import SymT, symbol_is_type

log = logging.getLogger(__name__)

# Frames inside these folders are the tracer's, not the model's (passes/ and cost_model/
# may be linked into the package from elsewhere, hence the real paths).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACER_ROOTS = tuple(
    os.path.realpath(folder) + os.sep
    for folder in (_PACKAGE, os.path.join(_PACKAGE, "passes"), os.path.join(_PACKAGE, "cost_model"), os.path.dirname(torch.__file__))
)
SIZE_OBLIVIOUS = (0, 1)  # the sizes a size-oblivious question asks about; its answer is "not this one"
_ASSERTION = re.compile(r"Runtime assertion failed for expression (.+) on node '[^']*'")


@dataclass(frozen=True)
class Assumption:
    """A size known only at run time that the trace assumed is not ``value``."""

    where: str  # the model's source line
    op: str
    dim: int
    value: int

    def message(self) -> str:
        assumed = "nonzero" if self.value == 0 else f"not {self.value}"
        return (
            f"{self.where}: {self.op} was traced assuming dim {self.dim} of its input, a size known only at run time, "
            f"is {assumed} (PyTorch's size-oblivious answer; the traced graph cannot ask the data); this run's is "
            f"{self.value}, which the traced graph does not compute. Fix: keep that size {assumed} (no empty slice or "
            f"document), or compute with static shapes (one block-diagonal mask over packed documents)."
        )


def model_line(frame: FrameType | None = None, also_skipped: tuple[str, ...] = ()) -> str:
    """The innermost frame of the model's own code, from ``frame`` (the caller's) outward: ``file:line (source)``;
    frames in the folders ``also_skipped`` (a library the model calls) are passed over as the tracer's are."""
    frame = frame if frame is not None else sys._getframe(1)
    skipped = TRACER_ROOTS + also_skipped
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(skipped):
        frame = frame.f_back
    if frame is None:
        return "unknown line"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()})"


def _asked(cond: sympy.Basic) -> tuple[sympy.Symbol, int] | None:
    """``(u, k)`` where ``cond`` asks whether an unbacked symbol ``u`` is ``k``, 0 or 1 (``Eq``
    or ``Ne``), or whether ``c * u`` is 0 (a numel: ``u`` times the other, static, sizes)."""
    if not isinstance(cond, (sympy.Eq, sympy.Ne)):
        return None
    for size, value in (cond.args, cond.args[::-1]):
        if value == 0 and isinstance(size, sympy.Mul):
            size = size.as_coeff_Mul()[1]
        if isinstance(size, sympy.Symbol) and symbol_is_type(size, SymT.UNBACKED_INT) and value in SIZE_OBLIVIOUS:
            return size, int(value)
    return None


class _SizeAssumptions(TorchFunctionMode):
    """Answers an op's size-oblivious question on an unbacked size of its inputs, as the module
    docstring says; records each answer by the expression of its run-time assertion."""

    def __init__(self) -> None:
        super().__init__()
        self.assumed: dict[str, Assumption] = {}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():  # inside a higher-order op's branch (torch.cond), which dynamo traces
            return func(*args, **kwargs)
        tracing = get_proxy_mode()
        graph = tracing.tracer.graph if tracing is not None else None
        while True:
            last = next(iter(reversed(graph.nodes)), None) if graph is not None else None
            try:
                return func(*args, **kwargs)
            except GuardOnDataDependentSymNode as e:
                if not self._assume(e.cond, func, args, kwargs):
                    raise
                if graph is not None:
                    _drop_failed_attempt(graph, last)

    def _assume(self, cond: sympy.Basic, func: Callable, args: tuple, kwargs: dict) -> bool:
        asked = _asked(cond)
        if asked is None:
            return False
        symbol, value = asked
        for t in (x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)):
            for dim, size in enumerate(t.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    asserts = size.node.shape_env.deferred_runtime_asserts
                    count = len(asserts.get(symbol, ()))
                    torch._check(size > 0 if value == 0 else size != value)  # a size is not negative: nonzero is >= 1
                    stated = asserts.get(symbol, [])
                    if len(stated) == count:  # known already, asked again: not a question this answers
                        return False
                    assumption = Assumption(model_line(), getattr(func, "__name__", str(func)), dim, value)
                    # a size's lower bound raised to 1 is asserted on its own, before the check
                    for key in (str(stated[-1].expr), f"{symbol} >= 1") if value == 0 else (str(stated[-1].expr),):
                        self.assumed[key] = assumption
                    log.info("traced assuming %s (size-oblivious) at %s", stated[-1].expr, assumption.where)
                    return True
        return False


def _drop_failed_attempt(graph: Graph, last: Node | None) -> None:
    """Erase the unread nodes an op's failed call recorded after ``last`` (the op's own node is
    made before its kernel asks). Nodes of symbolic numbers stay: the tracer may reuse them."""
    made = list(graph.nodes)
    made = made[made.index(last) + 1 :] if last is not None else made
    for node in reversed(made):
        values = tree_flatten(node.meta["val"])[0] if "val" in node.meta else []
        if node.op == "call_function" and not node.users and all(isinstance(v, torch.Tensor) for v in values):
            graph.erase_node(node)


@contextmanager
def assumed_sizes() -> Iterator[dict[str, Assumption]]:
    """While tracing: answer ops' size-oblivious questions on unbacked sizes; yields the
    assumptions made, keyed by the expression of their run-time assertion."""
    mode = _SizeAssumptions()
    with mode:
        yield mode.assumed


def name_assumptions(graph: Graph, assumed: dict[str, Assumption]) -> None:
    """Give the run-time assertions of ``assumed`` their messages (``Assumption.message``)."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default):
        found = _ASSERTION.fullmatch(str(node.args[1]))
        if found is not None and found.group(1) in assumed:
            node.args = (node.args[0], assumed[found.group(1)].message())
