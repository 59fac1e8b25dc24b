"""The terms of a scalar loss that sum over the rows (``loss_denominators._sums_scaled_by_pieces``).

A split step averages its pieces' losses: right for a mean over the rows, ``1/pieces`` of the
whole batch's value for a sum. A loss may mix both: CapsNet's margin loss averaged over the
rows plus ``5e-4`` times a reconstruction error summed over them, ``mse_loss(recon, x,
reduction="sum")``. Each **summed term** is scaled by the number of pieces where it enters the
loss, the others are left alone: the walk goes down from each scalar output through the ops
that are linear in a term (``add``/``sub``, ``neg``, casts, scalings by a constant) and stops at
the first term that sums over the rows.

A reduction is what ``reduction_kind`` says: any op with a ``reduction`` argument (every aten
loss: ``mse_loss``, ``l1_loss``, ``binary_cross_entropy_with_logits``, ``kl_div``,
``cross_entropy_loss``...) reduces by it, ``2`` a sum and ``1`` a mean.

A scaling by a number the trace baked in, on the way down or inside the term, counts only where
the trace of the batch doubled has the same number (``x.sum() / 64``, not ``x.sum() /
labels.numel()``, a mean), and a scaling by a tensor only where it comes from the caller's
inputs or the parameters (``fixed_scalings``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.fx import GraphModule, Node

from autotp.analysis.shapes import schema_arg, sources
from autotp.ir.batch_denominators import MEAN, SUM

aten = torch.ops.aten

CASTS = frozenset({aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.alias.default})
SCALINGS = frozenset({aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar})
_TERMS = frozenset({aten.add.Tensor, aten.sub.Tensor})
_BY_REDUCTION = {1: MEAN, 2: SUM}  # torch's Reduction enum: 0 none


class Reads(Protocol):
    def of(self, node: Node) -> tuple[bool, bool]: ...

    def is_constant(self, arg: Any) -> bool: ...


def has_reduction(n: Node) -> bool:
    """An op whose schema takes a ``reduction`` (a loss)."""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(a.name == "reduction" for a in schema.arguments)


def reduction_kind(n: Node) -> str | None:
    """``SUM`` or ``MEAN`` for a loss reducing by its ``reduction`` argument (its default: a
    mean), None for ``reduction="none"``."""
    return _BY_REDUCTION.get(schema_arg(n, "reduction", 1))


def _linear_operands(n: Node, reads: Reads) -> list[Node]:
    """The operands ``n`` is linear in, where ``n`` is a sum, a negation, a cast or a scaling by
    a constant; none otherwise."""
    if n.target in _TERMS:
        return [a for a in n.args[:2] if isinstance(a, Node)]
    if n.target in CASTS or n.target is aten.neg.default:
        return [n.args[0]] if isinstance(n.args[0], Node) else []
    if n.target in SCALINGS:
        a, b = n.args[0], n.args[1]
        if isinstance(a, Node) and reads.is_constant(b):
            return [a]
        if n.target is aten.mul.Tensor and isinstance(b, Node) and reads.is_constant(a):
            return [b]
    return []


def summed_terms(roots: list[Node], output: Node, is_sum: Callable[[Node, tuple[Node, ...]], bool], reads: Reads) -> list[tuple[Node, Node]]:
    """(term, the node it enters) for every summed term under ``roots`` (the scalar outputs,
    which enter ``output``); ``is_sum(term, path)`` decides a term reached through ``path``."""
    found: list[tuple[Node, Node]] = []
    stack: list[tuple[Node, Node, tuple[Node, ...]]] = [(root, output, ()) for root in roots]
    seen: set[tuple[Node, Node]] = set()
    while stack:
        n, user, path = stack.pop()
        if (n, user) in seen:
            continue
        seen.add((n, user))
        if is_sum(n, path):
            found.append((n, user))
            continue
        stack.extend((a, n, (*path, n)) for a in _linear_operands(n, reads))
    return found


def fixed_scalings(n: Node, path: tuple[Node, ...], doubled: Callable[[], GraphModule], reads: Reads, params: set[str]) -> bool:
    """Whether every number the sum ``n`` is scaled by (inside it and on ``path``, the ops
    between it and the loss) is the same in the trace of the batch doubled, node by node of the
    same name, and every tensor it is scaled by comes from the caller's inputs or the parameters
    (``num_items_in_batch``, a temperature), not from a constant the trace made
    (``torch.tensor(labels.numel())``)."""
    chain = [*_sum_chain(n), *path, *(a for m in path if m.target in SCALINGS for a in m.args[:2] if isinstance(a, Node) and reads.is_constant(a))]
    made = [a for a in chain if not reads.of(a)[0]]  # the scalings' tensors: they read no batch input
    if any(a.op == "call_function" and not a.all_input_nodes for a in made) or any(
        s.op == "get_attr" and str(s.target) not in params for a in made for s in sources(a)
    ):
        return False
    scaled = [m for m in chain if m.target in SCALINGS and any(isinstance(a, (int, float)) for a in m.args[:2])]
    if not scaled:
        return True
    twice = {m.name: m for m in doubled().graph.nodes}

    def numbers(m: Node) -> list[Any]:
        return [a for a in m.args[:2] if not isinstance(a, Node)]

    return all(m.name in twice and numbers(twice[m.name]) == numbers(m) for m in scaled)


def _sum_chain(n: Node) -> list[Node]:
    """The nodes from ``n`` down to its reductions through casts, scalings and adds."""
    chain, stack = [], [n]
    while stack:
        m = stack.pop()
        chain.append(m)
        if m.target in CASTS | SCALINGS or m.target in (aten.neg.default, aten.add.Tensor, aten.sub.Tensor):
            stack.extend(a for a in m.args[:2] if isinstance(a, Node))
    return chain
