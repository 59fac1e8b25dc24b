"""Give every pipeline chunk graph a copy whose linear weight gradients wait for a ``W``.

With a pipeline, zero-bubble schedules split a chunk's backward into the input gradients
(``B``) and the weight gradients (``W``, later). In a copy of each chunk graph, every
``aten.linear`` whose weight is a parameter becomes ``autotp::deferred_linear``: the same
forward; its backward computes the input and bias gradients and hands (weight, input,
output gradient) to the runtime's ``WeightGradStore``, whose ``W`` computes ``dW = dY^T · X``.
Norm weights, embeddings and other parameters keep their gradients in ``B`` (cheap next to
the matmuls). The copy is the chunk graph's submodule ``weight_grads_split``
(``autotp.ir.program.DEFERRED``); it has the chunk graph's parameter waits. The graphs must
run eagerly: ``torch.compile`` and CUDA graphs capture a backward as one piece.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from autotp.ir import ops
from autotp.ir.program import CHUNK_PREFIX, DEFERRED
from autotp.passes.extract_chunks import whole_copy
from autotp.passes.runner import PassContext


def deferred_copy(chunk: GraphModule) -> GraphModule:
    """A copy of ``chunk`` whose linears on parameter weights defer their weight gradients."""
    copy = whole_copy(chunk, DEFERRED)
    params = dict(chunk.named_parameters(remove_duplicate=False))
    for node in copy.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.linear.default:
            weight = node.args[1]
            if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and str(weight.target) in params:
                node.target = ops.DEFERRED_LINEAR
    copy.recompile()
    return copy


def split_weight_grads(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Attach ``weight_grads_split`` to every chunk graph of a pipeline (module docstring)."""
    if ctx.plan.num_chunks == 1:
        return gm
    for name, chunk in gm.named_children():
        if name.startswith(CHUNK_PREFIX) and isinstance(chunk, GraphModule):
            chunk.add_submodule(DEFERRED, deferred_copy(chunk))
    return gm
