"""Whether a set of nodes computes row by row: each output row from the same row of its
inputs only, so that the rows may be computed in any subset, in any order, on any rank.

An expert body must be row-wise to move under expert parallelism (``autotp.analysis.moe``).
An op is row-wise when its semantics keep dim 0 apart: pointwise ops (``torch.Tag.pointwise``),
matmuls of rows by a weight, grouped matmuls, casts and copies, and the ops that take a
``dim`` (split, slice, softmax, norms, reductions, views) when that dim is not dim 0.
``RowCheck`` also collects the *row inputs*: row-aligned tensors the body reads from
outside it (they travel with the rows).
"""

from __future__ import annotations

import operator
from typing import Any

from torch.fx import Node

from autotp.ir.op_facts import is_grouped_matmul, is_pointwise, op_name
from autotp.analysis.shapes import norm_dim, reads_input, shape_of
from autotp.ir.errors import describe

_COPIES = frozenset({"to", "_to_copy", "clone", "contiguous", "alias", "detach", "type_as", "dropout", "native_dropout",
                     "tp_dropout", "lift_fresh_copy"})  # fmt: skip
_ROW_MATMULS = frozenset({"linear", "mm", "matmul", "addmm"})
# op name -> position of its dim argument (default when absent: the value after the colon)
_DIM_ARG = {"chunk": (2, 0), "split": (2, 0), "split_with_sizes": (2, 0), "slice": (1, 0), "narrow": (1, None),
            "select": (1, None), "unbind": (1, 0), "softmax": (1, None), "_softmax": (1, None), "log_softmax": (1, None),
            "_log_softmax": (1, None), "cat": (1, 0), "glu": (1, -1), "cumsum": (1, None), "unsqueeze": (1, None),
            "squeeze": (1, None)}  # fmt: skip
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "var", "std", "norm", "linalg_vector_norm", "any", "all"})
_NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})
_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "expand", "flatten", "permute", "transpose"})


class RowCheck:
    """Checks nodes of a body of ``rows`` rows one by one (``visit``), ``inside`` being the
    body, ``ignore`` inputs that are not data (expert weights' views, offsets)."""

    def __init__(self, rows: int, inside: set[Node], ignore: set[Node]) -> None:
        self.rows, self.inside, self.ignore = rows, inside, ignore
        self.row_inputs: list[Node] = []
        self.input_readers: dict[Node, bool] = {}

    def visit(self, node: Node) -> str:
        """Why ``node`` is not row-wise ("" when it is); records its row inputs."""
        for a in node.all_input_nodes:
            if a in self.inside or a in self.ignore or a in self.row_inputs or a.op == "get_attr":
                continue
            shape = shape_of(a)
            if shape and shape[0] == self.rows and reads_input(a, self.input_readers):
                self.row_inputs.append(a)
        if node.target is operator.getitem or node.op != "call_function":
            return ""
        if is_grouped_matmul(node.target) or op_name(node.target) in _COPIES:
            return ""
        if is_pointwise(node.target):
            return ""
        ok = self._keeps_rows(node, op_name(node.target))
        return "" if ok else f"{describe(node)} mixes rows of the expert computation (it is not row-wise)"

    def _is_row(self, arg: Any) -> bool:
        return isinstance(arg, Node) and (arg in self.inside or arg in self.row_inputs)

    def _keeps_rows(self, node: Node, name: str) -> bool:
        shape = shape_of(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
        ndim = len(shape) if shape else 0
        if name in _ROW_MATMULS:
            x, w = (node.args[1], node.args[2]) if name == "addmm" else (node.args[0], node.args[1])
            return self._is_row(x) and not self._is_row(w) and (shape_of(w) or (0, 0)).__len__() <= 2
        if name in _DIM_ARG:
            pos, default = _DIM_ARG[name]
            if name == "cat":
                ndim = len(shape_of(node.args[0][0]) or ()) if node.args[0] else 0
            dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
            if isinstance(dim, (list, tuple)):
                return all(norm_dim(d, ndim + (name == "unsqueeze")) != 0 for d in dim)
            return dim is not None and norm_dim(dim, ndim + (name == "unsqueeze")) != 0
        if name in _REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else dims
            return bool(dims) and all(norm_dim(d, ndim) != 0 for d in dims)
        if name in _NORMS:
            return len(node.args[1]) < ndim
        if name in _VIEWS:
            return self._view_keeps_rows(node, name)
        return False

    def _view_keeps_rows(self, node: Node, name: str) -> bool:
        out = shape_of(node)
        if not out or out[0] != self.rows:
            return False
        if name == "permute":
            return norm_dim(node.args[1][0], len(out)) == 0
        if name == "transpose":
            return 0 not in {norm_dim(d, len(out)) for d in node.args[1:3]}
        if name == "flatten":
            return (node.args[1] if len(node.args) > 1 else 0) not in (0, -len(out))
        return True
