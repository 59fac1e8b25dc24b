"""Where partial sums are all-reduced.

A row-parallel matmul (or a vocab-parallel embedding, or a sum over a sharded dim) makes
a *partial* tensor: each rank holds a summand. It stays partial through ops that are
linear in it (``linear_in_partial``) as long as the partial value has one user; any
other consumer, and every user of a shared partial value, gets it listed in
``reduce_inputs`` (an all-reduce goes there), and later readers of a value already
reduced read the reduced value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from autotp.ir.layouts import PARTIAL

aten = torch.ops.aten

_LINEAR_IN_PARTIAL = {aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                      aten.alias.default, aten.contiguous.default, aten.detach.default}
_ADDS = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
_PRODUCTS = {aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}
_DIVISIONS = {aten.div.Tensor, aten.div_.Tensor}


class PartialSums:
    """The all-reduce placement of one walk; ``reduce_inputs`` is the walk's result dict."""

    def __init__(self, layouts: dict[Node, Any], reduce_inputs: dict[Node, list[Node]]) -> None:
        self.layouts = layouts
        self.reduce_inputs = reduce_inputs
        # Partial tensors already all-reduced for an earlier consumer: later consumers
        # read the reduced value instead of staying partial.
        self.reduced: set[Node] = set()

    def reduce_at_source(self, arg: Node) -> bool:
        """Whether a partial ``arg`` is reduced once where it is made, rather than on each
        value derived from it (a hand-written norm reads x twice)."""
        return arg in self.reduced or len(arg.users) > 1

    def reduce_first(self, node: Node, args: list[Any]) -> None:
        """Mark every partial input of ``node`` for an all-reduce."""
        for a in args:
            if isinstance(a, Node) and self.layouts.get(a) == PARTIAL:
                self.reduced.add(a)
                lst = self.reduce_inputs.setdefault(node, [])
                if a not in lst:
                    lst.append(a)


def linear_in_partial(node: Node, args: list[Any], lays: list[Any]) -> bool:
    """Whether ``node`` maps partial summands to partial summands of its output."""
    target = node.target
    n_partial = sum(1 for l in lays if l == PARTIAL)
    if target in _LINEAR_IN_PARTIAL:
        return True
    if target in _ADDS:
        return n_partial == 2 and len(args) == 2
    if target in _PRODUCTS:
        if n_partial != 1:
            return False
        if target in _DIVISIONS and node.args[0] is not args[lays.index(PARTIAL)]:
            return False
        return True
    return False
