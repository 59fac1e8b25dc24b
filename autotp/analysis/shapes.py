"""Node helpers shared by the analysis modules: a node's traced shape and the graph nodes
it is computed from, dim arithmetic, and how a reshape pairs input dims with output dims."""

from __future__ import annotations

import math
from typing import Any

import sympy

import torch
from torch.fx import Node

from autotp.ir.layouts import REPLICATE

UNBACKED_SIZE = 1021
"""The size taken for a dim that the trace cannot know (a token count that depends on
routing: ``nonzero``, boolean masks). Prime, so that a reshape never mistakes it, or a
multiple of it, for a product of real dims."""


def size_int(size: int | torch.SymInt) -> int:
    """A traced size as an int. A data-dependent (unbacked) size is the constant the trace
    asserted it equal to, if any, else ``UNBACKED_SIZE``."""
    if isinstance(size, int):
        return size
    hint = size.node.hint  # None for an unbacked size (torch's optimization_hint is newer than torch 2.11)
    if hint is not None:
        return int(hint)
    asserted = _asserted_constant(size)
    return UNBACKED_SIZE if asserted is None else asserted


def _asserted_constant(size: torch.SymInt) -> int | None:
    """The constant that ``size`` equals by the trace's run-time assertions of equality: pieces
    at run-time bounds put back together (``cat(x.split(lengths.tolist()))`` asserts
    ``Eq(u0 + u1 + u2, 16)`` where the sizes must add up). An equality is solved for a symbol
    of ``size`` with coefficient 1 (sizes are sums) and substituted where that leaves fewer
    symbols."""
    equalities = [ra.expr.lhs - ra.expr.rhs for asserted in size.node.shape_env.deferred_runtime_asserts.values()
                  for ra in asserted if isinstance(ra.expr, sympy.Eq)]  # fmt: skip
    expr, changed = size.node.expr, True
    while changed and not expr.is_Integer:
        changed = False
        for eq in equalities:
            for s in sorted(eq.free_symbols & expr.free_symbols, key=str):
                if eq.coeff(s) != 1 or s in (eq - s).free_symbols:
                    continue
                solved = sympy.expand(expr.xreplace({s: s - eq}))
                if len(solved.free_symbols) < len(expr.free_symbols):
                    expr, changed = solved, True
                    break
    return int(expr) if expr.is_Integer else None


def sources(node: Node) -> list[Node]:
    """The graph inputs (placeholders) and parameters, buffers and constants (get_attr)
    that ``node`` is computed from."""
    seen, stack, found = {node}, [node], []
    while stack:
        n = stack.pop()
        if n.op in ("placeholder", "get_attr"):
            found.append(n)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return found


def reads_input(node: Node, memo: dict[Node, bool] | None = None) -> bool:
    """Whether ``node`` depends on a graph input (else on parameters and constants alone).
    ``memo`` keeps the answers for every node visited, for callers that ask of many nodes
    of a graph that does not change meanwhile."""
    memo = {} if memo is None else memo
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        pending = [a for a in n.all_input_nodes if a not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[n] = n.op == "placeholder" or any(memo[a] for a in n.all_input_nodes)
        stack.pop()
    return memo[node]


def shape_of(node: Any) -> tuple[int, ...] | None:
    """The traced shape of a tensor-valued node (None for anything else)."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(size_int(s) for s in val.shape)
    return None


def adds_nothing_to_cat(part: Any, d: int) -> bool:
    """Whether a ``cat`` input adds nothing along dim ``d``: empty along it (an empty cache, a
    part of width 0), or a 1-D empty tensor, which ``cat`` skips whatever the others' rank (a
    cache's first ``torch.tensor([])``)."""
    shape = shape_of(part)
    return shape is not None and (shape == (0,) or shape[d : d + 1] == (0,))


def is_float(node: Node) -> bool:
    """A floating-point or complex tensor (one that can carry a gradient)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def norm_dim(d: int, ndim: int) -> int:
    """``d`` as a non-negative dim of an ``ndim``-dim tensor."""
    return d + ndim if d < 0 else d


def replicated_like(node: Node) -> Any:
    """``REPLICATE``, or a tuple of them for a node with several outputs."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(REPLICATE for _ in val)
    return REPLICATE


def reshape_chunks(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal product.

    Size-1 dims are left out (they carry nothing). Returns None if the shapes do not
    describe the same number of elements.
    """
    a = [i for i, s in enumerate(src) if s != 1]
    b = [j for j, s in enumerate(dst) if s != 1]
    chunks: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ca, cb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    return None
                ca.append(a[i])
                pa *= src[a[i]]
                i += 1
            else:
                if j >= len(b):
                    return None
                cb.append(b[j])
                pb *= dst[b[j]]
                j += 1
        chunks.append((ca, cb))
    if i != len(a) or j != len(b):
        return None
    return chunks


def schema_arg(node: Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an op call, positional or keyword (``default`` if not passed)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.name == name:
                return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return node.kwargs.get(name, default)


def contiguous_strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def strided_walk(node: Node) -> list[int | None] | None:
    """For ``as_strided(x, size, stride, offset)`` of a contiguous ``x`` that starts its
    storage: the input dim each output dim steps along (None: a size-1 or stride-0 dim),
    when every element it reads is ``x[..., sum of the output indices along that dim, ...]``
    (each stride is one input dim's, and the indices along one input dim never carry past
    its size: sliding windows over the sequence). None when the strides mix dims otherwise."""
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, Node) else None
    offset = schema_arg(node, "storage_offset", None)
    if not isinstance(val, torch.Tensor) or not val.is_contiguous() or val.storage_offset() != 0 or offset:
        return None
    shape = [size_int(d) for d in val.shape]
    by_stride = {st: i for i, (st, n) in enumerate(zip(contiguous_strides(shape), shape)) if n > 1}
    walk: list[int | None] = []
    reach = [0] * len(shape)
    for size, stride in zip(node.args[1], node.args[2]):
        if size == 1 or stride == 0:
            walk.append(None)
        elif stride in by_stride:
            walk.append(by_stride[stride])
            reach[by_stride[stride]] += size - 1
        else:
            return None
    return walk if all(r < max(n, 1) for r, n in zip(reach, shape)) else None


def selecting_mask(selected: Node) -> tuple[Node, int] | None:
    """The boolean mask ``selected`` is taken by and how many elements each True selects:
    ``masked_select(x, mask)`` with ``mask`` of ``x``'s shape (one), or ``x[mask]`` with ``mask``
    of ``x``'s leading dims (``loss[mask]`` of a [b, n, d] loss and a [b, n] mask: d)."""
    if selected.target is torch.ops.aten.masked_select.default:
        mask = selected.args[1]
    elif selected.target is torch.ops.aten.index.Tensor and len(selected.args[1]) == 1:
        mask = selected.args[1][0]
    else:
        return None
    val = mask.meta.get("val") if isinstance(mask, Node) else None
    shape = selected.args[0].meta["val"].shape
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return None
    leading = len(shape) if selected.target is torch.ops.aten.masked_select.default else val.dim()
    if tuple(val.shape) != tuple(shape[:leading]):
        return None
    per_true = math.prod(shape[leading:])
    return (mask, per_true) if isinstance(per_true, int) else None


def sized_by_data(node: Node) -> bool:
    """A tensor whose size is known only at run time (a selection by a mask or by ``nonzero``)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape)
