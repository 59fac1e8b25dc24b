"""Tag the nodes of the CUDA-graph regions the plan chose.

``find_cudagraph_candidates`` numbered the candidate regions; the cost model chose some
(``plan.cudagraph_regions``, before this pass runs). Their nodes get
``autotp_cudagraph_region`` (the candidate's id), which ``split_cudagraph_regions`` and the
capture read.
"""

from __future__ import annotations

from torch.fx import GraphModule

from autotp.ir import meta_keys
from autotp.passes.find_cudagraph_candidates import candidate_regions
from autotp.passes.runner import PassContext


def mark_cudagraph_regions(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Tag the nodes of every candidate that ``ctx.plan.cudagraph_regions`` names."""
    if not ctx.plan.cudagraphs:
        return gm
    candidates = candidate_regions(gm)
    unknown = [r for r in ctx.plan.cudagraph_regions if not 0 <= r < len(candidates)]
    assert not unknown, f"the plan captures regions {unknown}, but the graph has {len(candidates)} candidates"
    for region in ctx.plan.cudagraph_regions:
        for node in candidates[region]:
            node.meta[meta_keys.CUDAGRAPH_REGION] = region
    return gm
