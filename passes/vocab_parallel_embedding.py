"""Replace lookups in vocab-sharded tables by the masked local lookup (a partial sum).

The all-reduce that completes the sum is inserted by ``insert_collectives`` where the
partial result first meets an op that needs the full value, so position embeddings
added before that point share the same single all-reduce.
"""

from __future__ import annotations

from torch.fx import GraphModule

from autotp.ir import meta_keys, ops
from autotp.analysis.propagation_result import NodeRole
from autotp.passes.runner import PassContext
from autotp.ir.errors import UserInputError


def vocab_parallel_embedding(gm: GraphModule, ctx: PassContext) -> GraphModule:
    for node in gm.graph.nodes:
        if node.meta.get(meta_keys.ROLE) is not NodeRole.VOCAB_EMBEDDING:
            continue
        weight, ids = node.args[0], node.args[1]
        padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        if node.kwargs.get("sparse", False) or (len(node.args) > 4 and node.args[4]):
            raise UserInputError(f"sparse embedding gradients are not supported with a vocab-parallel table ({weight.target})")
        layout = ctx.plan.layout_of(str(weight.target))
        assert layout is not None and layout.dim == 0, f"{weight.target} is not vocab-sharded in the plan"
        (start, stop), = layout.sharding.ranges(ctx.tp_rank, ctx.plan.tp)
        stop = min(stop, layout.sharding.size)
        node.target = ops.VOCAB_PARALLEL_EMBEDDING
        node.args = (weight, ids, start, stop, layout.sharding.size, padding_idx)
        node.kwargs = {}
    return gm
