"""The memory order of the tp group's collective results: a gather or an all-reduce returns its
operand's layout (dense), so a ``view`` that export recorded on the unmodified model's tensor stays
valid on the rank's."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def memory_order(x: Tensor) -> list[int]:
    """x's dims from the outermost in memory to the innermost, as PyTorch's elementwise kernels
    order their outputs: a dim of stride 0 (expanded) or of size 1 says nothing of the order and
    keeps its place among the others, and equal strides keep dim order. (Sorting an expanded
    head dim innermost made an all-reduced value SDPA's CPU kernels read otherwise.)"""
    order = list(range(x.dim() - 1, -1, -1))  # innermost first, moved outwards by insertion

    def outer_than(a: int, b: int) -> int:
        if x.stride(a) == 0 or x.stride(b) == 0 or x.shape[a] == 1 or x.shape[b] == 1:
            return 0
        return (x.stride(a) > x.stride(b)) - (x.stride(a) < x.stride(b))

    for i in range(1, len(order)):
        at = i
        for j in range(i - 1, -1, -1):
            swap = outer_than(order[j], order[at])
            if swap > 0:
                order[j], order[at] = order[at], order[j]
                at = j
            elif swap < 0:
                break
    return order[::-1]


def empty_in_memory_order(x: Tensor, dim: int, size: Any) -> Tensor:
    """An empty tensor of x's shape with ``size`` at ``dim``, dense, its dims in x's memory order."""
    shape = [size if d == dim % x.dim() else s for d, s in enumerate(x.shape)]
    return torch.empty_permuted(shape, memory_order(x), dtype=x.dtype, device=x.device)


def reduced_like(x: Tensor) -> Tensor:
    """The empty result of an all-reduce of x, dense in x's memory order."""
    return empty_in_memory_order(x, 0, x.shape[0]) if x.dim() else torch.empty_like(x)
