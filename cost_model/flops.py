"""Per-node FLOPs, memory bytes and estimated time, from the shapes in ``node.meta["val"]``.

Shapes come through a callback ``tensors(node) -> list[TensorInfo]``: ``global_tensors``
reads ``node.meta["val"]`` (whole-model shapes); ``autotp.analysis.local_shapes.local_tensors``
gives one rank's. FLOPs are forward only and count a multiply-add as 2.

``node_cost`` applies, by op:

* **matmuls** (``autotp.ir.op_facts``): ``aten.linear``, ``addmm``, ``mm``, ``bmm``,
  ``matmul`` and every target whose name contains ``grouped_mm`` (``aten._grouped_mm``,
  ``transformers::grouped_mm_fallback``):
  FLOPs = 2 · numel(out) · K, with K the last dim of the first matrix operand (linear's
  ``x``, addmm's ``mat1``); a bias (linear's third argument, addmm's first) adds
  numel(out). For grouped_mm each token row meets exactly one expert, so this is 2·T·K·N.
  The overlapped collectives count their GEMMs: ``all_gather_matmul`` 2·K·Σ numel(product)
  (its first output, the gathered input, is no product), ``matmul_reduce_scatter``
  2·Σ_i rows(x_i)·K_i·N_i. The fused lm_head and loss ``linear_cross_entropy(h [N, H], W [V, H])``
  counts its logits GEMM, 2·N·H·V (its forward also runs the two gradient GEMMs:
  ``autotp.cost_model.compute`` times all three there); bytes: its inputs, outputs, and its
  float32 loss passes (``autotp.cost_model.fused_loss.loss_bytes_per_logit`` per logit). ``fp8_linear`` 2·K·Σ numel(out_i) plus its
  biases (its speed and casts: ``autotp.cost_model.fp8``).
* **attention**, ``scaled_dot_product_attention(q [..., L, D], k [..., S, D], v [..., S, Dv])``:
  FLOPs = 2·BH·L·S·D + 2·BH·L·S·Dv with BH = prod(q.shape[:-2]); the softmax is not
  counted. With ``is_causal=True`` only the lower triangle is computed: half of that.
  An explicit ``attn_mask`` (what HF passes, causal models included) counts the full
  L·S product. Bytes: q, k, v, the mask and the output, each once (as fused attention
  kernels do: the L×S scores never reach memory).
* **embedding** (``aten.embedding``, autotp's vocab-parallel lookup): 0 FLOPs; bytes =
  ids + 2 · output (the rows read, the output written).
* **views** (``autotp.ir.op_facts.is_view``: ``view``, ``transpose``, ``expand``, ``getitem``...,
  and the identities Megatron's *f*, ``stage_boundary`` and ``partial_grad``; reshape-likes
  are counted as views, without the strides that would tell when they copy): 0 FLOPs, 0 bytes.
* **data movement** (``to``, ``contiguous``, ``cat``, ``index``, ``pad``, factories...):
  0 FLOPs; bytes = inputs + outputs.
* **collectives** (``ops.COMMUNICATION_ONLY``: *g*, the all-gathers, the reduce-scatter, the sequence slice): 0 FLOPs, 0 bytes here;
  ``autotp.cost_model.communication.group_collective_s`` times their communication.
* **everything else** (elementwise ops, norms, reductions, softmax, the vocab-parallel
  loss): 1 FLOP per element of the largest input or output; bytes = inputs + outputs.
  Transcendentals are not weighted: such ops are memory-bound, and their time comes
  from their bytes.

Time, with a ``HardwareProfile``:

* ``compute_time_s``: roofline, max(FLOPs / matmul FLOP/s, bytes / memory bytes/s).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from autotp.analysis.local_shapes import TensorInfo, global_tensors
from autotp.ir import ops
from autotp.ir.op_facts import OpKind, is_view, op_kind, op_name
from autotp.cost_model.fused_loss import loss_bytes_per_logit
from autotp.cost_model.hardware import HardwareProfile


@dataclass(frozen=True)
class NodeCost:
    flops: int
    bytes: int


Tensors = Callable[[Node], list[TensorInfo]]

_DATA_MOVEMENT = {
    "to", "_to_copy", "contiguous", "clone", "copy", "copy_", "cat", "stack", "pad",
    "constant_pad_nd", "index", "index_select", "gather", "scatter", "index_put", "index_put_",
    "repeat", "repeat_interleave", "arange", "zeros", "ones", "full", "empty", "empty_like",
    "zeros_like", "ones_like", "full_like", "new_ones", "new_zeros", "new_full", "new_empty",
    "scalar_tensor",
}  # fmt: skip
_SDPA_IS_CAUSAL_ARG = 5


def _input_nodes(node: Node) -> list[Node]:
    out: list[Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: out.append(n))
    return out


def _arg(node: Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _bytes(nodes: list[Node], tensors: Tensors) -> int:
    return sum(t.nbytes for n in nodes for t in tensors(n))


def _largest(nodes: list[Node], tensors: Tensors) -> int:
    return max((t.numel for n in nodes for t in tensors(n)), default=0)


def _matmul_flops(node: Node, name: str, out: int, tensors: Tensors) -> int:
    first = node.args[1] if name == "addmm" else node.args[0]
    k = tensors(first)[0].shape[-1]
    bias = name == "addmm" or (name == "linear" and _arg(node, 2, "bias") is not None)
    return 2 * out * k + (out if bias else 0)


def attention_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], causal: bool) -> int:
    """FLOPs of ``scaled_dot_product_attention`` on q, k, v of these shapes (module docstring)."""
    bh, length, source = math.prod(q[:-2]), q[-2], k[-2]
    flops = 2 * bh * length * source * q[-1] + 2 * bh * length * source * v[-1]
    return flops // 2 if causal else flops


def _attention_flops(node: Node, tensors: Tensors) -> int:
    q, k, v = (tuple(tensors(a)[0].shape) for a in node.args[:3])
    return attention_flops(q, k, v, bool(_arg(node, _SDPA_IS_CAUSAL_ARG, "is_causal")))


def node_cost(node: Node, tensors: Tensors = global_tensors) -> NodeCost:
    """Forward FLOPs and memory bytes of one node (formulas in the module docstring)."""
    if node.op != "call_function":
        return NodeCost(0, 0)
    if is_view(node.target) or node.target in ops.COMMUNICATION_ONLY:
        return NodeCost(0, 0)
    name = op_name(node.target)
    inputs = _input_nodes(node)
    outputs = tensors(node)
    in_bytes, out_bytes = _bytes(inputs, tensors), sum(t.nbytes for t in outputs)
    out_numel = sum(t.numel for t in outputs)
    if name == "all_gather_matmul":
        k = tensors(node.args[0])[0].shape[-1]
        return NodeCost(2 * k * sum(t.numel for t in outputs[1:]), in_bytes + out_bytes)
    if name == "fp8_linear":  # one input, a GEMM per weight (each output), biases added
        k = tensors(node.args[0])[0].shape[-1]
        biases = sum(t.numel for t, b in zip(outputs, node.args[2]) if b is not None)
        return NodeCost(2 * k * out_numel + biases, in_bytes + out_bytes)
    if name == "matmul_reduce_scatter":
        flops = sum(2 * tensors(x)[0].numel * tensors(w)[0].shape[-1] for x, w in zip(node.args[0], node.args[1]))
        return NodeCost(flops, in_bytes + out_bytes)
    if name == "linear_cross_entropy":
        hidden, weight = tensors(node.args[0])[0], tensors(node.args[1])[0]
        logits = hidden.numel // hidden.shape[-1] * weight.shape[0]
        return NodeCost(2 * logits * hidden.shape[-1], in_bytes + out_bytes + logits * loss_bytes_per_logit(weight.dtype.itemsize))
    kind = op_kind(node.target)
    if kind.is_matmul:
        return NodeCost(_matmul_flops(node, name, out_numel, tensors), in_bytes + out_bytes)
    if kind is OpKind.ATTENTION:
        return NodeCost(_attention_flops(node, tensors), in_bytes + out_bytes)
    if kind is OpKind.EMBEDDING:
        ids = tensors(node.args[1])[0].nbytes
        return NodeCost(0, ids + 2 * out_bytes)
    if name in _DATA_MOVEMENT:
        return NodeCost(0, in_bytes + out_bytes)
    return NodeCost(max(_largest(inputs, tensors), out_numel), in_bytes + out_bytes)


def compute_time_s(cost: NodeCost, hw: HardwareProfile) -> float:
    """Roofline time of one node."""
    return max(cost.flops / hw.matmul_flops_per_s, cost.bytes / hw.memory_bytes_per_s)
