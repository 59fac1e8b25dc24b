"""Give elementwise ops the rank's slice of a replicated operand that meets a sharded dim.

A per-head vector, an ALiBi-like bias or a buffer of full size combined with a tensor
sharded on that dim (``meta_keys.LOCAL_SLICES``): the op reads ``slice``s of the
operand covering the global ranges this rank holds (``DimSharding.ranges``), joined by
``cat`` when there are several; on a padded (vocabulary) dim the last rank's slice is
zero-padded to the local size (a per-vocabulary vector scaling vocab-parallel logits). The new nodes carry the sharded layout, so
``insert_collectives`` puts f before them when the operand is trainable: the ranks'
grads of their slices are summed into the full grad. A partial operand (a per-head bias
looked up in a vocab-parallel table) is all-reduced before the slices, not after.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys
from autotp.ir.layouts import resolve, shard
from autotp.passes.runner import PassContext

aten = torch.ops.aten


def slice_replicated(gm: GraphModule, ctx: PassContext) -> GraphModule:
    graph, tp = gm.graph, ctx.plan.tp
    for node in list(graph.nodes):
        for source, dim, var in node.meta.get(meta_keys.LOCAL_SLICES, []):
            ndim = source.meta["val"].dim()
            parts, made = [], []
            with graph.inserting_before(node):
                for start, have, length in resolve(var, tp).pieces(ctx.tp_rank, tp):
                    part = graph.call_function(aten.slice.Tensor, (source, dim, start, start + have))
                    made.append(part)
                    if length > have:  # padding
                        part = graph.call_function(aten.constant_pad_nd.default, (part, [0, 0] * (ndim - 1 - dim % ndim) + [0, length - have], 0.0))
                        made.append(part)
                    parts.append(part)
                local = parts[0] if len(parts) == 1 else graph.call_function(aten.cat.default, (parts, dim))
            for new in {*made, local}:
                _annotate(new, source, shard({dim: var}))
            reduce = node.meta.get(meta_keys.REDUCE_INPUTS, [])
            if source in reduce:  # a partial operand: sum it before slicing, not after
                node.meta[meta_keys.REDUCE_INPUTS] = [r for r in reduce if r is not source]
                for part in made:
                    if part.args[0] is source:
                        part.meta[meta_keys.REDUCE_INPUTS] = [source]
            node.replace_input_with(source, local)
    return gm


def _annotate(new: Node, source: Node, layout: object) -> None:
    new.meta.update({k: v for k, v in source.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    new.meta[meta_keys.LAYOUT] = layout
    new.meta[meta_keys.NEEDS_GRAD] = source.meta.get(meta_keys.NEEDS_GRAD, False)
