"""Replace ``aten.cross_entropy_loss`` on vocab-sharded logits by the parallel loss.

Only per-token values cross ranks (max, sum of exps, target logit); the full logits are
never gathered on the loss path.
"""

from __future__ import annotations

from torch.fx import GraphModule

from autotp.ir import meta_keys, ops
from autotp.analysis.propagation_result import NodeRole
from autotp.ir.layouts import Layout, resolve
from autotp.passes.runner import PassContext
from autotp.ir.errors import UserInputError

_REDUCTION_MEAN = 1
_DEFAULT_IGNORE_INDEX = -100


def vocab_parallel_cross_entropy(gm: GraphModule, ctx: PassContext) -> GraphModule:
    tp = ctx.plan.tp
    for node in gm.graph.nodes:
        if node.meta.get(meta_keys.ROLE) is not NodeRole.VOCAB_CROSS_ENTROPY:
            continue
        logits, target = node.args[0], node.args[1]
        lay = logits.meta[meta_keys.LAYOUT]
        assert isinstance(lay, Layout)
        sharding = resolve(lay.var_at(1), tp)
        ranges = sharding.ranges(ctx.tp_rank, tp)
        if len(ranges) != 1 or sharding.replicas(tp) != 1:
            raise UserInputError(f"cross-entropy at node '{node.name}': class dim is not one contiguous slice per rank")
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", _REDUCTION_MEAN)
        ignore_index = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", _DEFAULT_IGNORE_INDEX)
        node.target = ops.VOCAB_PARALLEL_CROSS_ENTROPY
        node.args = (logits, target, ranges[0][0], sharding.size, ignore_index, reduction, ctx.group)
        node.kwargs = {}
    return gm
