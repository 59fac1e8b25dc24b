"""The tensors a node produces on one tensor-parallel rank.

A node's per-rank shape is its traced (whole-model) shape ``node.meta["val"]`` with:

* every dim sharded in its layout (``meta_keys.LAYOUT``) replaced by the dim's local size;
* the expand fix-ups (``meta_keys.EXPAND_FIXUPS``, ``repeat_kv``): a broadcast dim that
  a later reshape merges into a sharded dim gets local(merged) / local(outer).

A slice within a sharded dim (``meta_keys.SLICE_FIXUP``) has local bounds,
``local_slice_bounds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from autotp.ir import meta_keys
from autotp.analysis.shapes import size_int
from autotp.ir.layouts import Layout, local_offset, local_size


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def global_tensors(node: Node) -> list[TensorInfo]:
    """The tensors a node produces, with the whole-model shapes of ``node.meta["val"]``."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return [TensorInfo(tuple(size_int(s) for s in v.shape), v.dtype) for v in vals if isinstance(v, torch.Tensor)]


def _layouts_for(node: Node, count: int) -> tuple[Layout | None, ...]:
    lay = node.meta.get(meta_keys.LAYOUT)
    if isinstance(lay, tuple) and len(lay) == count:
        return tuple(l if isinstance(l, Layout) else None for l in lay)
    return (lay if isinstance(lay, Layout) else None,) * count


def local_sizes(node: Node, tp: int, layout: Layout | None) -> dict[int, int]:
    """{dim: per-rank size} of the dims that sharding changes, for one output of ``node``."""
    sizes = {d: local_size(var, tp) for d, var in layout.dims} if layout is not None else {}
    for d, merged, outer in node.meta.get(meta_keys.EXPAND_FIXUPS, []):
        sizes[d] = local_size(merged, tp) // local_size(outer, tp)
    return sizes


def local_tensors(node: Node, tp: int) -> list[TensorInfo]:
    """The tensors a node produces on one rank."""
    infos = global_tensors(node)
    out = []
    for info, lay in zip(infos, _layouts_for(node, len(infos))):
        shape = list(info.shape)
        for d, size in local_sizes(node, tp, lay).items():
            shape[d] = size
        out.append(TensorInfo(tuple(shape), info.dtype))
    return out


def local_shape(node: Node, tp: int) -> tuple[int, ...]:
    """The per-rank shape of a node with one tensor output."""
    return local_tensors(node, tp)[0].shape


def local_slice_bounds(node: Node, tp: int) -> tuple[int, int]:
    """(start, end) on one rank of a slice with a ``meta_keys.SLICE_FIXUP``."""
    whole, part, at = node.meta[meta_keys.SLICE_FIXUP]
    start = local_offset(whole, at, tp)
    return start, start + local_size(part, tp)
