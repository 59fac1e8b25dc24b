"""Per-node costs as functions of the microbatch size: ``const + per_sample·b``.

A node whose tensors come from the inputs (``compute.batch_dependent``) has b times their
elements at microbatch size b; the rest (weights, rotary tables) do not grow. Measuring a
node's numbers (FLOPs, bytes, FP8 cast bytes) at the traced batch and with those tensors
doubled gives both coefficients exactly, since no node is quadratic in b.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch.fx import Node

from autotp.cost_model.flops import Tensors, TensorInfo, global_tensors, node_cost


@dataclass(frozen=True)
class Affine:
    """``const + per_sample·b``: a cost at microbatch size b."""

    const: float
    per_sample: float

    def at(self, batch: float) -> float:
        return self.const + self.per_sample * batch


def _doubled(infos: list[TensorInfo]) -> list[TensorInfo]:
    return [TensorInfo((t.shape[0] * 2, *t.shape[1:]), t.dtype) if t.shape else t for t in infos]


def affine_costs(nodes: list[Node], tensors: dict[Node, list[TensorInfo]], dependent: set[Node], batch: int,
                 measure: Callable[[Node, Tensors], tuple[float, ...]] | None = None) -> np.ndarray:  # fmt: skip
    """[n, k, 2]: the k numbers of ``measure(node, tensors)`` (default: ``node_cost``'s flops and bytes)
    of each node as (const, per_sample), from shapes at ``batch`` and 2·batch."""

    def at(scale: bool):
        def get(n: Node) -> list[TensorInfo]:
            infos = tensors[n] if n in tensors else global_tensors(n)
            return _doubled(infos) if scale and n in dependent else infos

        return get

    measure = measure or (lambda n, t: (node_cost(n, t).flops, node_cost(n, t).bytes))
    one, two = at(False), at(True)
    out = np.zeros((len(nodes), 2 if not nodes else len(measure(nodes[0], one)), 2))
    for i, n in enumerate(nodes):
        m1, m2 = np.array(measure(n, one), dtype=float), np.array(measure(n, two), dtype=float)
        out[i, :, 1] = (m2 - m1) / batch
        out[i, :, 0] = m1 - out[i, :, 1] * batch
    return out
