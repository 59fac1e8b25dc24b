"""Make each chunk graph wait for a DistributedOptimizer's parameter all-gather, bucket by bucket.

Runs when the compiler is given the optimizer's bucket layout (``ctx.param_buckets``: the
runtime asks for it when a ``DistributedOptimizer`` overlaps its all-gather with the next
forward). Right before the first node that reads a parameter of bucket k, the graph calls
its ``ParamWaits`` submodule with k; before its output, it waits for the chunk's buckets it
did not read, so every bucket has landed when the step ends (Megatron's forward pre-hooks,
at graph-node granularity). The runtime's callback waits for the bucket's all-gather; a
graph whose callback is unset waits for nothing.
"""

from __future__ import annotations

from torch.fx import GraphModule

from autotp.ir.program import CHUNK_PREFIX, CHUNK_SPEC, WAIT_MODULE, BucketLayout, ParamWaits
from autotp.passes.runner import PassContext


def _insert(chunk: GraphModule, layout: BucketLayout, index: int) -> None:
    chunk.add_submodule(WAIT_MODULE, ParamWaits())
    graph = chunk.graph
    waited: set[int] = set()
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            buckets = set(layout.chunk_buckets.get(index, ())) - waited
        else:
            read = (layout.bucket_of.get(str(a.target)) for a in node.all_input_nodes if a.op == "get_attr")
            buckets = {b for b in read if b is not None} - waited
        with graph.inserting_before(node):
            for bucket in sorted(buckets):
                graph.call_module(WAIT_MODULE, (bucket,))
        waited |= buckets
    chunk.recompile()


def insert_param_waits(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Insert the waits of ``ctx.param_buckets`` into every chunk graph that has none yet."""
    if ctx.param_buckets is None:
        return gm
    for name, chunk in gm.named_children():
        if name.startswith(CHUNK_PREFIX) and isinstance(chunk, GraphModule) and not hasattr(chunk, WAIT_MODULE):
            _insert(chunk, ctx.param_buckets, chunk.meta[CHUNK_SPEC].chunk)
    return gm
