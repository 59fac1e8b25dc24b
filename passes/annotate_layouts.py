"""Write every node's tensor-parallel layout into its metadata (reads the plan)."""

from __future__ import annotations

from torch.fx import GraphModule

from autotp.ir import meta_keys
from autotp.analysis.propagation import propagate
from autotp.analysis.propagation_result import check_divisible
from autotp.passes.runner import PassContext


def annotate_layouts(gm: GraphModule, ctx: PassContext) -> GraphModule:
    prop = propagate(gm, ctx.plan.tp, plan=ctx.plan)
    check_divisible(prop, gm)
    for node in gm.graph.nodes:
        node.meta[meta_keys.LAYOUT] = prop.layouts.get(node)
        node.meta[meta_keys.NEEDS_GRAD] = prop.needs_grad.get(node, False)
        if node in prop.reduce_inputs:
            node.meta[meta_keys.REDUCE_INPUTS] = list(prop.reduce_inputs[node])
        if node in prop.roles:
            node.meta[meta_keys.ROLE] = prop.roles[node]
        if node in prop.expand_fixups:
            node.meta[meta_keys.EXPAND_FIXUPS] = prop.expand_fixups[node]
        if node in prop.slice_fixups:
            node.meta[meta_keys.SLICE_FIXUP] = prop.slice_fixups[node]
        if node in prop.padding_slices:
            node.meta[meta_keys.PADDING_SLICE] = prop.padding_slices[node]
        if node in prop.padding_masks:
            node.meta[meta_keys.PADDING_MASKS] = prop.padding_masks[node]
        if node in prop.index_slices:
            node.meta[meta_keys.INDEX_AS_SLICE] = prop.index_slices[node]
        if node in prop.identity_indices:
            node.meta[meta_keys.IDENTITY_INDICES] = prop.identity_indices[node]
        if node in prop.repeat_fixups:
            node.meta[meta_keys.REPEAT_FIXUP] = prop.repeat_fixups[node]
        if node in prop.local_slices:
            node.meta[meta_keys.LOCAL_SLICES] = prop.local_slices[node]
    return gm
