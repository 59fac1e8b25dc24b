"""Pieces of a batch's rows taken by slicing, and whether they are put back together.

A slice, ``narrow``, ``select``, ``split`` or ``unbind`` along a dim holding the batch's rows
takes some of them. Each piece of a split step would take its own rows instead (``x[0]`` is
the first row of each microbatch, not of the batch), so a piece keeps a split step equal to
the whole batch's only if it is put back: the same computation on every piece, the results
concatenated (or stacked) along that dim in the rows' order, covering every row. That is a
loop over the batch's rows (``torch.stack([f(x[b]) for b in range(len(x))])``). Anything
else mixes rows: a piece meeting other rows (``x - x[0]``, ``a * b`` of ``a, b = x.chunk(2)``),
pieces put back out of order (a shift, ``cat([x[1:], x[:1]])``), a computation that depends
on the row's position (``x[b] @ w[b]``), or a piece reaching the graph's output on its own
(a loss over the first row). Integer pieces are bookkeeping (``position_ids[0]``), as
``batch_rows`` counts them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.node import map_aggregate

from autotp.analysis.shapes import is_float, norm_dim, schema_arg, shape_of
from autotp.ir.op_facts import op_name

_TAKES_PIECES = frozenset({"slice", "narrow", "select", "split", "split_with_sizes", "unbind", "chunk"})
_READS_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                               "new_zeros", "new_ones", "new_empty", "new_full", "sym_size"})  # fmt: skip
_TUPLES = frozenset({"split", "split_with_sizes", "unbind", "chunk"})
REASSEMBLES = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)  # ops that put pieces back


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop:step`` of ``source``'s dim ``dim`` (bounds None: known only at run
    time); ``keeps_dim`` is False where the piece is one row without the dim (``select``)."""

    source: Node
    dim: int
    start: int | None
    stop: int | None
    step: int
    keeps_dim: bool
    within_piece: bool  # the source is itself computed from a piece of rows

    @property
    def span(self) -> tuple[object, ...]:
        """Which rows: pieces of equal spans hold the same rows (``x[b]`` and ``coeff[b]``, or
        tokens ``t`` of two tensors of the batch's tokens); a piece of a piece, those of its source."""
        unit = (self.source, self.dim) if self.within_piece else (shape_of(self.source) or ())[self.dim]
        return (unit, self.start, self.stop, self.step)

    @property
    def rows(self) -> int | None:
        if self.start is None or self.stop is None:
            return None
        return len(range(self.start, self.stop, self.step))


class RowPieces:
    """Follows the pieces of rows through a graph walked in order (``_BatchWalker``)."""

    def __init__(self, rows_at: Callable[[Node], set[int]]) -> None:
        self.rows_at = rows_at
        self.of: dict[Node, frozenset[Piece]] = {}  # the pieces a node is computed from
        self.taken_by: dict[Piece, Node] = {}
        self.placed: set[Node] = set()  # nodes that take pieces or put them back
        self.sums: dict[Node, frozenset[Piece]] = {}  # statistics: the pieces whose rows they reduced
        self._keys: dict[Node, int] = {}  # what each node computes, up to which piece it reads

    def place(self, node: Node) -> Piece | None:
        """The piece ``node`` takes or puts back (its rows are then ``piece.source``'s rows at
        ``piece.dim``: a taken piece's own, a put-back one's all)."""
        piece = self._taken(node)
        if piece is not None:
            self.of[node] = frozenset({piece})
            self.taken_by.setdefault(piece, node)
            self._keys[node] = hash(("piece", piece.keeps_dim))
            self.placed.add(node)
            return piece
        self._keys[node] = self._key(node)
        restored = self._put_back(node)
        if restored is not None:
            if self.of.get(restored.source):
                self.of[node] = self.of[restored.source]
            self.placed.add(node)
        return restored

    def follow(self, node: Node, rows: set[int]) -> bool:
        """Whether ``node``, holding the rows at ``rows``, mixes the rows of the pieces it reads:
        a piece's values meet other rows, or a statistic of other rows (``x - x[0]``,
        ``x[1] * x[0].sum()``). Statistics meeting statistics only collect them (a loss chunk by
        chunk, a weight's gradient summed over chunks, per-row losses stacked)."""
        if node in self.placed:
            return False
        if op_name(node.target) in _READS_SHAPE_ONLY or isinstance(node.meta.get("val"), (torch.SymInt, int, float, bool)):
            return False
        deps = frozenset().union(*(self.of.get(a, frozenset()) for a in node.all_input_nodes))
        sums = frozenset().union(*(self.sums.get(a, frozenset()) for a in node.all_input_nodes))
        if not deps and not sums:
            return False
        meets_rows = any(self.rows_at(a) and not self.of.get(a) for a in node.all_input_nodes if is_float(a))
        spans = {p.span for p in deps | sums}
        if deps and not self._reduces(node, deps, rows):
            self.of[node] = deps
        else:
            self.sums[node] = deps | sums
        return meets_rows or bool(deps) and len(spans) > 1

    def _reduces(self, node: Node, deps: frozenset[Piece], rows: set[int]) -> bool:
        """Whether ``node``'s value holds none of its pieces' rows: a scalar, or the rows of
        pieces of two or more reduced away (a matmul contracting them)."""
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 0:
            return True
        held = [a for a in node.all_input_nodes if self.of.get(a) and self.rows_at(a)]
        return bool(held) and not rows and all(p.keeps_dim and (p.rows or 0) > 1 for p in deps)

    def reaching_output(self, output: Node) -> Node | None:
        """The node that took a piece reaching the graph's output without being put back, or
        whose statistics reach it without covering every row."""
        for a in output.all_input_nodes:
            for piece in self.of.get(a, ()):
                return self.taken_by[piece]
            by_unit: dict[object, set[tuple[object, ...]]] = {}
            for piece in self.sums.get(a, ()):
                by_unit.setdefault(piece.span[0], set()).add(piece.span)
            for unit, spans in by_unit.items():
                covered = sorted((s[1], s[2]) for s in spans if s[3] == 1 and s[1] is not None)
                ends = [0] + [stop for _, stop in covered]
                whole = len(covered) == len(spans) and all(start == end for (start, _), end in zip(covered, ends))
                if not whole or ends[-1] != (unit if isinstance(unit, int) else (shape_of(unit[0]) or ())[unit[1]]):
                    return next(self.taken_by[p] for p in self.taken_by if p.span in spans)
        return None

    def _taken(self, node: Node) -> Piece | None:
        """The piece of rows ``node`` takes, if it takes part of a float tensor's rows."""
        call = node.args[0] if node.target is operator.getitem else node
        if not isinstance(call, Node) or call.op != "call_function" or op_name(call.target) not in _TAKES_PIECES:
            return None
        name, source = op_name(call.target), call.args[0]
        if (call is node) == (name in _TUPLES):  # a tuple's getitems take the pieces
            return None
        shape = shape_of(source) if isinstance(source, Node) else None
        if shape is None or not is_float(source):
            return None
        dim = norm_dim(schema_arg(call, "dim", 0), len(shape))
        size = shape[dim]
        if dim not in self.rows_at(source) or not isinstance(size, int):
            return None
        bounds = _bounds(call, name, size, node.args[1] if call is not node else 0)
        if bounds == (0, size, 1) and name not in ("select", "unbind"):
            return None
        start, stop, step = bounds if bounds is not None else (None, None, 1)
        return Piece(source, dim, start, stop, step, name not in ("select", "unbind"), bool(self.of.get(source)))

    def _put_back(self, node: Node) -> Piece | None:
        """A piece of the tensor whose rows ``node`` puts back: the same computation of every
        piece of the rows, in order, concatenated (or stacked) along their dim."""
        if node.target not in REASSEMBLES or not node.args[0]:
            return None
        parts, stacking = node.args[0], node.target is torch.ops.aten.stack.default
        dim = norm_dim(schema_arg(node, "dim", 0), len(shape_of(parts[0]) or ()) + stacking)
        chosen: list[Piece] = []
        for part in parts:
            held = self.of.get(part) or self.sums.get(part, frozenset()) if isinstance(part, Node) else frozenset()
            fits = [p for p in held if p.dim == dim and p.keeps_dim != stacking and p.step == 1 and p.rows is not None]
            if len({p.span for p in held}) != 1 or not fits:
                return None
            chosen.append(fits[0])
        first = chosen[0]
        ends = [0] + [p.stop for p in chosen]
        if [p.span[0] for p in chosen] != [first.span[0]] * len(chosen) or ends[-1] != (shape_of(first.source) or ())[dim]:
            return None
        if any(p.start != end for p, end in zip(chosen, ends)) or len({self._keys[p] for p in parts}) != 1:
            return None
        if not stacking and any(p.rows > 1 and dim not in self.rows_at(part) for p, part in zip(chosen, parts)):
            return None  # the computation moved a piece's rows off their dim
        return first

    def _key(self, node: Node) -> int:
        """A hash of what ``node`` computes: its op, its constants, and its inputs' keys
        (a piece's key is the same for every piece)."""
        parts: list[object] = [str(node.target)]

        def one(a: object) -> object:
            parts.append(self._keys.get(a, hash(("input", a.name))) if isinstance(a, Node) else repr(a))
            return a

        map_aggregate((node.args, node.kwargs), one)
        return hash(tuple(parts))


def _bounds(call: Node, name: str, size: int, index: int) -> tuple[int, int, int] | None:
    """Rows ``start, stop, step`` of ``size`` that ``call`` (or its ``index``-th output) takes;
    None where they are known only at run time."""
    if name == "slice":
        start, stop, step = (schema_arg(call, k, d) for k, d in (("start", None), ("end", None), ("step", 1)))
        return None if isinstance(start, Node) or isinstance(stop, Node) else slice(start, stop, step).indices(size)
    if name in ("narrow", "select"):
        start, length = schema_arg(call, "start" if name == "narrow" else "index", 0), schema_arg(call, "length", 1)
        return None if isinstance(start, Node) or isinstance(length, Node) else (start % size, start % size + length, 1)
    if name == "unbind":
        return index, index + 1, 1
    if name == "split_with_sizes":
        sizes = list(schema_arg(call, "split_sizes", ()))
    else:
        each = schema_arg(call, "split_size", 1) if name == "split" else -(-size // schema_arg(call, "chunks", 1))
        sizes = [min(each, size - s) for s in range(0, size, each)]
    start = sum(sizes[:index])
    return start, start + sizes[index], 1
