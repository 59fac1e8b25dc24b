"""Where the parameters that the traced forward never reads are stored.

A text-only forward of a multimodal model never touches its vision or audio tower, yet a
user training the text path keeps those weights in the model and expects them back in a
checkpoint. Held whole on every rank they would cost their full size everywhere; here each
is split over the tp group and held by one pipeline stage:

* **dim**: the dim whose split leaves the smallest local tensor,
  ``argmin_d ceil(size_d / tp) * numel / size_d`` (the first such dim; padded past the end
  when tp does not divide it). A scalar is held whole (dim -1).
* **stage**: with tp > 1, largest first, each goes to the pipeline rank that holds the
  fewest parameter bytes so far (greedy), counting the parameters each rank's chunks read at
  their local size (``ParamLayout.sharding.local_size``) and the unread ones placed before
  it; a parameter read by several ranks (tied) counts on each. With tp = 1 and pp > 1 each is
  split over the pipeline ranks instead (its layout on axis pp), so that one tower larger than
  a stage's share is spread too; ``chunk`` 0's stage answers for it when gathered.

The parameters have no grad, so optimizers leave them as they are; ``autotp.ir.plan.UnreadParam``
records each one.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.fx import GraphModule

from autotp.analysis.pipeline_units import chunk_bases
from autotp.ir.axes import Axis
from autotp.ir.errors import UserInputError
from autotp.ir.dim_sharding import DimSharding
from autotp.ir.plan import UNREAD_KIND, ParallelPlan, ParamLayout, UnreadParam

DETAIL = "no node of the forward traced at the example inputs reads it"


def _names_per_tensor(gm: GraphModule) -> list[list[str]]:
    """Every name of each parameter of ``gm`` (tied ones have several; the first is canonical)."""
    groups: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def unread_names(gm: GraphModule) -> list[str]:
    """The parameters of ``gm`` (canonical names) that no node reads under any of their names."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    return [names[0] for names in _names_per_tensor(gm) if not read & set(names)]


def split_dim(shape: tuple[int, ...], tp: int) -> int:
    """The dim whose split over ``tp`` ranks leaves the smallest local tensor (-1: a scalar or an
    empty tensor, which has nothing to split)."""
    if not shape or 0 in shape:
        return -1
    return min(range(len(shape)), key=lambda d: (math.ceil(shape[d] / tp) * math.prod(shape) // max(shape[d], 1), d))


def _read_bytes_per_stage(gm: GraphModule, plan: ParallelPlan) -> list[float]:
    """The parameter bytes each pipeline rank's chunks read, at their local size."""
    nodes = list(gm.graph.nodes)
    bases = chunk_bases(gm, plan)
    params = dict(gm.named_parameters(remove_duplicate=False))
    held = [0.0] * plan.pp
    seen: set[tuple[int, int]] = set()
    for node in nodes:
        if node.op != "get_attr" or not node.users or str(node.target) not in params:
            continue
        p = params[str(node.target)]
        layout = plan.layout_of(str(node.target))
        share = layout.sharding.local_size(plan.degree(layout.axis)) / layout.sharding.size if layout else 1.0
        for user in node.users:
            stage = plan.pp_rank_of_chunk(bases.get(user, plan.head_chunk))
            if (id(p), stage) not in seen:
                seen.add((id(p), stage))
                held[stage] += p.numel() * p.element_size() * share
    return held


def plan_unread_params(gm: GraphModule, plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with a split layout and an ``UnreadParam`` entry for every parameter of ``gm``
    that no node reads (see the module doc); ``plan`` itself when there is none."""
    names = unread_names(gm)
    if not names:
        return plan
    params = dict(gm.named_parameters(remove_duplicate=False))
    held = _read_bytes_per_stage(gm, plan)
    axis = Axis.TP if plan.tp > 1 else Axis.PP
    ranks = plan.degree(axis)
    layouts, entries = [], []
    for name in sorted(names, key=lambda n: (-params[n].numel(), n)):
        p: torch.Tensor = params[name]
        dim = split_dim(tuple(p.shape), ranks)
        local = p.numel() * p.element_size()
        if dim >= 0 and ranks > 1:
            size = p.shape[dim]
            layouts.append(ParamLayout(name, UNREAD_KIND, dim, DimSharding(size, (size,), (size,), size % ranks != 0, axis)))
            local = local * math.ceil(size / ranks) // size
        stage = min(range(plan.pp), key=lambda r: (held[r], r)) if axis == Axis.TP else 0
        held[stage] += local
        entries.append(UnreadParam(name, dim, chunk=stage, bytes=p.numel() * p.element_size(), detail=DETAIL))
    return replace(plan, params=plan.params + tuple(layouts), unread=tuple(entries))


def refuse_reading_unread(gm: GraphModule, plan: ParallelPlan) -> None:
    """Raise if ``gm`` (a later input signature's trace) reads a parameter that ``plan`` stores
    split because the forward it was planned from never read it."""
    unread = {u.name for u in plan.unread}
    if not unread:
        return
    canonical = {alias: names[0] for names in _names_per_tensor(gm) for alias in names}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users and canonical.get(str(node.target), str(node.target)) in unread:
            raise UserInputError(
                f"this forward reads parameter {node.target} (node {node.name!r}), which the plan stores split because the "
                "forward traced at the example inputs never read it (plan.unread); pass example_inputs that exercise every "
                "path you will run (e.g. pixel_values for a vision tower) to parallelize"
            )
