"""How good a layout walk is, for choosing between sound alternatives of one tp degree.

A norm over a sharded dim can be computed from a tp-reduced statistic, or its producer
kept whole so the norm sees the whole dim (``tensor_parallel``). Both are correct; which
one a rank is better off with depends on what follows: a q/k norm over all heads keeps
the attention sharded (reduce the statistic), a norm over a low-rank projection or a
patch embedding would pull the residual stream and the next projections into odd splits
(keep the small producer whole). The walk's result is scored by what one rank holds and
how long it computes and communicates, on ``hardware.H200``:

A split activation gathered whole where an op needs it whole (instead of keeping the
parameters behind it whole) adds its whole bytes and one all-gather.

* ``held_bytes`` = sum over parameters of ``PARAM_STATE_COPIES`` x their local bytes
  (weight, gradient, two Adam moments) + sum over computed tensors of their local bytes
  (a sharded tensor holds 1/tp, a partial or replicated one all of it; views hold none);
* ``step_s`` = 3 x sum over nodes of ``flops.compute_time_s`` of the node's local share
  (forward and a backward twice as long) + sum over all-reduces of
  ``communication.all_reduce_s`` (each partial input reduced forward, each replicated
  value entering a sharded op reduced backward).

``better`` ranks by held bytes and breaks near ties (within ``TIE``) by time: tensor
parallelism is asked for to shard, and on the small graphs a plan is tested with the
latency of a collective would otherwise favour keeping everything whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from autotp.ir.op_facts import is_alias
from autotp.analysis.propagation_result import Propagation, param_sharding
from autotp.analysis.shapes import size_int
from autotp.cost_model.communication import all_gather_s, all_reduce_s
from autotp.cost_model.flops import NodeCost, compute_time_s, node_cost
from autotp.cost_model.hardware import H200
from autotp.ir.layouts import PARTIAL, Layout, ShardingConflict

PARAM_STATE_COPIES = 4
TIE = 0.02


@dataclass(frozen=True)
class Footprint:
    held_bytes: float
    step_s: float

    def better(self, other: Footprint) -> bool:
        """Whether this layout beats ``other`` (see the module doc)."""
        if self.held_bytes < other.held_bytes * (1 - TIE):
            return True
        if other.held_bytes < self.held_bytes * (1 - TIE):
            return False
        return self.step_s < other.step_s


def _share(lay: object, tp: int) -> float:
    """The fraction of a node's value one rank holds or computes."""
    lays = lay if isinstance(lay, tuple) else (lay,)
    sharded = any(isinstance(l, Layout) and l.dims for l in lays)
    return 1 / tp if sharded else 1.0


def _nbytes(node: Node) -> float:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    total = 0.0
    for v in vals:
        if isinstance(v, torch.Tensor):
            numel = 1
            for s in v.shape:
                numel *= size_int(s)
            total += numel * v.dtype.itemsize
    return total


def gathered_bytes(node: Node) -> float:
    """Bytes of a value gathered whole (its whole tensor)."""
    return _nbytes(node)


def gather_s(node: Node, tp: int) -> float:
    """One all-gather of ``node``'s value over tp ranks (its backward keeps the rank's slice: no communication)."""
    return all_gather_s(_nbytes(node), tp, H200.intra_node)


def footprint(prop: Propagation, gm: GraphModule) -> Footprint:
    tp, hw = prop.tp, H200
    link = hw.intra_node
    params = dict(gm.named_parameters())
    held = 0.0
    for name, p in params.items():
        try:
            found = param_sharding(prop, name)
        except ShardingConflict:  # a split a conflicted walk left that cannot be laid out (a padded dim as a segment): counted whole
            found = None
        local = p.numel() if found is None else p.numel() // p.shape[found[1]] * found[2].local_size(tp)
        held += PARAM_STATE_COPIES * local * p.dtype.itemsize
    step = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        lay = prop.layouts.get(node)
        share = _share(lay, tp)
        if not is_alias(node):
            held += _nbytes(node) * share
        work = 1 / tp if lay == PARTIAL else share  # a row-parallel product: 1/tp of the work, all of the bytes
        cost = node_cost(node)
        step += 3 * compute_time_s(NodeCost(cost.flops * work, cost.bytes * work), hw)
        for partial in prop.reduce_inputs.get(node, []):
            step += all_reduce_s(_nbytes(partial), tp, link)
        if lay is not None and _share(lay, tp) == 1.0 and prop.needs_grad.get(node):
            if any(_share(prop.layouts.get(u), tp) < 1.0 for u in node.users):
                step += all_reduce_s(_nbytes(node), tp, link)
    for node in prop.gathered:  # the whole copy every reader gets, and its all-gather
        held += _nbytes(node)
        step += gather_s(node, tp)
    return Footprint(held, step)
