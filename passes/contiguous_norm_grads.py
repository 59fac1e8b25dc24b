"""Hand each batch norm of a CPU rank graph a contiguous output gradient.

torch's CPU kernel of the batch-norm backward (``native_batch_norm_backward``, eval and training
mode; torch 2.11 and 2.13) reads a gradient with channels-last strides as if it were contiguous
when the batch holds one sample; the CUDA kernels read it right. Such a gradient reaches a norm
whose feature map is read as tokens (``flatten(2).transpose(1, 2)``) and then reduced over them
(timm's LeViT): the unmodified model's gradients are right on the whole batch and wrong on each
sample alone, so a step split into one-sample microbatches came out wrong. Every batch norm's
output is read through ``contiguous_grad`` (a copy forward, which the graph may then write in place as
an in-place activation does; ``grad.contiguous()`` backward). On other devices the graph is left as it is.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from autotp.ir import ops
from autotp.passes.runner import PassContext

aten = torch.ops.aten
BATCH_NORMS = frozenset({
    aten.batch_norm.default, aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit_functional.default, aten._batch_norm_with_update.default,
    aten._batch_norm_with_update_functional.default, aten._batch_norm_no_update.default,
})  # fmt: skip
"""The forward batch-norm ops, whose output (index 0 of a tuple) is the normalized tensor."""


def contiguous_norm_grads(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if ctx.device.type != "cpu":
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in BATCH_NORMS:
            for out in _normalized(node):
                with graph.inserting_after(out):
                    guarded = graph.call_function(ops.CONTIGUOUS_GRAD, (out,))
                guarded.meta.update(out.meta)
                out.replace_all_uses_with(guarded, delete_user_cb=lambda user: user is not guarded)
    return gm


def _normalized(node: Node) -> list[Node]:
    """The node holding ``node``'s normalized output: itself, or the ``getitem`` of index 0 of its tuple."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return [node]
    return [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
