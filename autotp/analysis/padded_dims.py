"""Dims split with padding: a dim tp does not divide (an FFN of 170 channels at tp=4), split
in blocks of ``ceil(size / tp)``, the last rank's block running past the end.

The planner pads a dim only after a walk found it indivisible (``Indivisible.paddable``); the
next walk creates the variable of those parameters' split padded (``pad``). Their padding
rows are zero (``autotp.runtime.state.sharding``), so the padding of the values computed
from them means nothing but stays finite until an op combines elements along the dim.
What an op may do with a padded dim:

* keep it, elementwise along it (pointwise ops, views and transposes that leave it one
  dim, a softmax over another dim): the rule's output carries the same variable;
* sum over it (a row-parallel matmul, an einsum's or a convolution's contraction, ``sum``):
  the rule records the operand in ``Propagation.padding_masks`` and the ranks holding
  padding zero it there (``passes/mask_padding``), which also keeps the padding rows'
  gradients zero;
* anything else (cut it into segments or blocks, reduce it with a statistic, index it) is a
  ``ShardingConflict``, settled as any other: the parameters stay whole or the value is
  gathered.

``check_padding`` enforces this after every rule, whatever the rule does, so a rule that
knows nothing of padding cannot compute a wrong number from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node
from torch.utils._pytree import tree_leaves

from autotp.analysis.propagation_result import NodeRole, Propagation
from autotp.ir.axes import Axis
from autotp.ir.errors import describe
from autotp.ir.layouts import DimVar, Layout, ShardingConflict

CONSUMING_ROLES = (NodeRole.VOCAB_CROSS_ENTROPY, NodeRole.VOCAB_EMBEDDING)
"""Roles whose rewrite handles a padded (vocabulary) dim itself: the loss masks the padded classes."""


def pad(var: DimVar) -> None:
    """Split ``var`` with padding, if nothing constrains its blocks yet."""
    r = var.find()
    if r.segments is None and r.groups in (None, r.size) and r.fixed is None and r.follows is None and r.axis is Axis.TP:
        r.padded = r.padded_parts = True


def _unconstrained(r: DimVar) -> bool:
    """Single elements, or segments that are each that (a fused gate/up pair cut by ``chunk``)."""
    if r.follows is not None or r.groups not in (None, r.size):
        return False
    return r.segments is None or all(s.find().padded and s.find() is not r and _unconstrained(s.find()) for s in r.segments)


def _parts(r: DimVar) -> set[int]:
    """``r`` and its segments, at any depth."""
    return {r.uid}.union(*(_parts(s.find()) for s in r.segments or () if s.find() is not r))


def _roots(value: Any) -> dict[int, DimVar]:
    found = {}
    for lay in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(lay, Layout):
            for _, v in lay.dims:
                found[v.find().uid] = v.find()
    return found


def padded_inputs(prop: Propagation, node: Node, gathered: frozenset[str]) -> dict[int, DimVar]:
    """The padded variables among ``node``'s split inputs (gathered inputs arrive whole)."""
    found: dict[int, DimVar] = {}
    for a in node.all_input_nodes:
        if a.name not in gathered:
            found.update({uid: r for uid, r in _roots(prop.layouts.get(a)).items() if r.padded})
    return found


def record_mask(prop: Propagation, node: Node, operand: Any, dim: int, var: DimVar) -> None:
    """``node`` sums ``operand`` over ``dim``, split as ``var``: zero its padding first."""
    if var.find().padded and isinstance(operand, Node):
        prop.padding_masks.setdefault(node, []).append((operand, dim, var))


def check_padding(prop: Propagation, node: Node, padded: dict[int, DimVar], out: Any) -> None:
    """Refuse what ``node``'s rule did with the padded dims of its inputs unless it kept them
    as they are or summed over them with the padding masked (module docstring)."""
    kept = set(_roots(out))
    reads_values = any(isinstance(v, torch.Tensor) for v in tree_leaves(node.meta.get("val")))  # not a size alone
    masked = {v.find().uid for _, _, v in prop.padding_masks.get(node, ())}
    for r in padded.values():
        root = r.find()
        if not _unconstrained(root):
            raise ShardingConflict(f"{describe(node)}: cuts a dim split with padding into parts", root.origins, (root,))
        if reads_values and not _parts(root) & (kept | masked) and prop.roles.get(node) not in CONSUMING_ROLES:
            raise ShardingConflict(f"{describe(node)}: combines the elements of a dim split with padding", root.origins, (root,))
