"""What kind of computation a graph node is: a matmul, a grouped (MoE expert) matmul,
attention, an embedding lookup, or anything else.

Names are matched, not overloads, so that every overload of ``aten.mm`` and custom ops
registered by libraries that may not be loaded (``transformers::grouped_mm_fallback``)
are recognized: a target is a *grouped matmul* if its name contains ``grouped_mm``
(``aten._grouped_mm`` too).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from torch.fx import Node

MATMUL_NAMES = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "all_gather_matmul", "matmul_reduce_scatter",
                          "linear_cross_entropy", "fp8_linear"})  # fmt: skip
ATTENTION_NAME = "scaled_dot_product_attention"
EMBEDDING_NAMES = frozenset({"embedding", "vocab_parallel_embedding"})


class OpKind(Enum):
    MATMUL = "matmul"
    GROUPED_MATMUL = "grouped_matmul"
    ATTENTION = "attention"
    EMBEDDING = "embedding"
    OTHER = "other"

    @property
    def is_matmul(self) -> bool:
        """Dense or grouped."""
        return self in (OpKind.MATMUL, OpKind.GROUPED_MATMUL)


def op_name(target: Any) -> str:
    """Short name of a call target: ``linear`` for ``aten.linear.default``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def is_grouped_matmul(target: Any) -> bool:
    return "grouped_mm" in str(target)


def op_kind(target: Any) -> OpKind:
    """The kind of a call target (a node's ``target``)."""
    name = op_name(target)
    if name in MATMUL_NAMES:
        return OpKind.MATMUL
    if is_grouped_matmul(target):
        return OpKind.GROUPED_MATMUL
    if name == ATTENTION_NAME:
        return OpKind.ATTENTION
    if name in EMBEDDING_NAMES:
        return OpKind.EMBEDDING
    return OpKind.OTHER


def is_matmul(node: Node) -> bool:
    """A matmul of either kind (dense or grouped) in a ``call_function`` node."""
    return node.op == "call_function" and op_kind(node.target).is_matmul


def mutated_base(node: Node) -> Node | None:
    """The tensor an in-place op writes, traced back through views to the node that made it."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable or not node.args or not isinstance(node.args[0], Node):
        return None
    return view_root(node.args[0])


def view_root(node: Node) -> Node:
    """The node that made the tensor ``node`` is, through any chain of views and in-place ops
    (which return the tensor they write); ``node`` itself if it is neither."""
    while is_alias(node):
        node = node.args[0]
    return node


def is_alias(node: Node) -> bool:
    """Whether ``node``'s result is (a view of) its first argument: a view or an in-place op."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None
