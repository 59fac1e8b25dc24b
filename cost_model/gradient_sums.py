"""The backward's gradient sums: what autograd adds where one tensor feeds several differentiable ops.

A tensor read by k nodes that need a gradient gets k gradients in the backward, and autograd's
input buffer adds them up (``aten::add_`` in place): k - 1 adds, each reading two tensors of the
tensor's size and writing one, ``GRADIENT_SUM_BYTES`` = 3 bytes moved per byte of the tensor. In a
Llama decoder layer these are the residual stream (read by the norm and by the residual add), the
norm's float32 copy (its square and its product), the normalized hidden state (q, k and v; gate and
up) and the rotary inputs (q and k, and their rotated halves): about a dozen hidden-sized sums per layer,
1.5 ms of an 8B-width layer's 45 ms at 16k tokens on one H100 (``benchmarks/profile_cost_terms.py``
measured 11 ms of ``aten::add_`` over 8 layers). ``elementwise_backward_factor`` cannot hold them:
it is measured on a chain of ops without forks (``autotp.cli.measure``).
``compute.node_times`` charges the bytes in the backward of the node whose output is summed, at
the HBM rate. ``all_gather_matmul`` (``passes/tp_overlap``) multiplies one gathered input by k weights inside
one node; its backward sums the k input gradients (``matmul_reduce_scatter`` over the k products) and is
charged the same k - 1 sums of the gathered input as the separate linears it replaces.
"""

from __future__ import annotations

from torch.fx import Node

from autotp.cost_model.flops import Tensors
from autotp.ir import ops

GRADIENT_SUM_BYTES = 3


def gradient_sum_bytes(node: Node, tensors: Tensors, grad: set[Node]) -> tuple[int]:
    """Bytes the backward's gradient sums of ``node``'s output move (module docstring); a 1-tuple for ``affine_costs``."""
    if node not in grad:
        return (0,)
    outputs = tensors(node)
    if node.target is ops.ALL_GATHER_MATMUL:  # the readers are inside: its backward sums its k weights' input gradients
        return (GRADIENT_SUM_BYTES * (len(node.args[1]) - 1) * outputs[0].nbytes,)
    readers = sum(1 for user in node.users if user in grad and user.op == "call_function")
    return (GRADIENT_SUM_BYTES * max(readers - 1, 0) * outputs[0].nbytes if len(outputs) == 1 else 0,)
