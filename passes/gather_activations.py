"""All-gather the split activations the plan gathers whole (``ParallelPlan.gathered``).

Where no split is sound at an op (a norm over a split latent, a softmax over a split
dim...), the planner may gather the split value on its way there instead of keeping the
parameters behind it whole (``cost_model/tensor_parallel``). The layout walk of the plan
gave every reader of such a value a replicated input; this pass puts ``gather_from_tp``
(in global order when the split has segments or replicated blocks) before its first
reader and gives every reader the whole value. Backward, each rank keeps its slice of the
(whole, equal on every rank) grad. Runs before ``insert_collectives``, which puts f after
the gather where a split op reads it.
"""

from __future__ import annotations

from torch.fx import GraphModule

from autotp.ir import meta_keys
from autotp.ir.layouts import Layout
from autotp.passes.insert_collectives import gather_whole
from autotp.passes.runner import PassContext


def gather_activations(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if ctx.plan.tp == 1 or not ctx.plan.gathered:
        return gm
    graph, names = gm.graph, {g.tensor for g in ctx.plan.gathered}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        lay = node.meta.get(meta_keys.LAYOUT)
        if node.name not in names or not node.users or not (isinstance(lay, Layout) and lay.dims):
            continue
        readers = sorted(node.users, key=order.__getitem__)
        whole = gather_whole(graph, node, lay, ctx.group, ctx.plan.tp, readers[0])
        for reader in readers:
            reader.replace_input_with(node, whole)
    return gm
