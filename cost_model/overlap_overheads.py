"""How the overlapped sequence-parallel GEMMs (``all_gather_matmul`` and
``matmul_reduce_scatter``, ``autotp.runtime.execution.overlap``) run: as t chunks per weight
(``gemm_pieces``), and, on GPUs, with what ``torch.ops.symm_mem``'s fused ops cost beyond their
GEMMs and transfers (``overlap_overheads``):

* Each call synchronizes the group through symmetric-memory barriers and splits its copies
  among chunks: ``HardwareProfile.overlap_call_s`` of GPU time per call, forward and backward.
* They gather and scatter along dim 0. autotp's split dim is the sequence of [b, s, h], so with
  more than one row before it (b > 1) the fused ops move it outermost: the all-gather's gathered
  input and every product come back in [s, b, ...] memory order and are made contiguous again,
  and the reduce-scatter copies its whole input to that order first and its result back. With
  b = 1 those are no-ops. Such a permuted copy runs in PyTorch's strided elementwise kernel,
  ``HardwareProfile.permuted_copy_slowdown`` times slower per byte than the memory bandwidth.
* The backward of an all-gather-matmul of several weights (q/k/v, gate/up) concatenates their
  output gradients and their weights along K into one GEMM: a contiguous copy.

Each copy reads and writes its bytes. The backward moves what the forward moved (an
all-gather-matmul's backward is a matmul-reduce-scatter of the products' gradients, and the
reverse). The CPU profile has neither the calls' cost nor permuted copies: gloo runs the ring
(``overlap``), whose chunks are views and whose products are concatenated, as the plain
collectives' are.
"""

from __future__ import annotations

import math

import numpy as np
from torch.fx import Node

from autotp.cost_model.flops import Tensors
from autotp.cost_model.hardware import HardwareProfile
from autotp.ir import ops

_READ_AND_WRITE = 2


def gemm_pieces(node: Node) -> int:
    """How many equal GEMMs a node's FLOPs run as: an overlapped collective multiplies one
    chunk of 1/t of the rows per weight and step; every other node one."""
    if node.target is ops.ALL_GATHER_MATMUL or node.target is ops.MATMUL_REDUCE_SCATTER:
        return node.args[3] * len(node.args[1])
    return 1


def overlap_overheads(node: Node, tensors: Tensors) -> tuple[float, float, float, float, float, float]:
    """Of an overlapped GEMM node (0 for other nodes): the (forward, backward) bytes of its
    permuted copies, moved only where the rows before the split dim are more than one; the
    (forward, backward) bytes of its contiguous ones; those rows; and its calls (1). Every
    number is linear in the microbatch size, so the cost model fits each as ``const +
    per_sample·b`` (``affine.affine_costs``) and applies the condition at the size it prices."""
    if node.target is ops.ALL_GATHER_MATMUL:
        gathered, *products = tensors(node)
        moved = [gathered, *products]
        concatenated = [*products, *(tensors(w)[0] for w in node.args[1])] if len(products) > 1 else []
    elif node.target is ops.MATMUL_REDUCE_SCATTER:
        xs = [tensors(x)[0] for x in node.args[0]]
        gathered, moved = xs[0], [*xs, tensors(node)[0]]
        concatenated = [*xs, *(tensors(w)[0] for w in node.args[1])] if len(xs) > 1 else []
    else:
        return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    rows_before = math.prod(gathered.shape[: node.args[2] % len(gathered.shape)])
    permuted = _READ_AND_WRITE * sum(t.nbytes for t in moved)
    plain = _READ_AND_WRITE * sum(t.nbytes for t in concatenated)
    forward_plain, backward_plain = (plain, 0.0) if node.target is ops.MATMUL_REDUCE_SCATTER else (0.0, plain)
    return permuted, permuted, forward_plain, backward_plain, float(rows_before), 1.0


def overhead_seconds(overheads: np.ndarray, batch: int, hw: HardwareProfile) -> np.ndarray:
    """[nodes, (forward, backward)] seconds of ``overlap_overheads`` fitted per node ([nodes,
    6, (const, per_sample)]) at microbatch size ``batch`` on ``hw``."""
    at = overheads[:, :, 0] + overheads[:, :, 1] * batch
    permuted = np.where(at[:, 4:5] > 1, at[:, 0:2] * hw.permuted_copy_slowdown, 0.0)
    return (permuted + at[:, 2:4]) / hw.memory_bytes_per_s + at[:, 5:6] * hw.overlap_call_s
