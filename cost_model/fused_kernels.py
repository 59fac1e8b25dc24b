"""What ``compile=True`` runs in place of a rank graph's memory-bound nodes: inductor's fused kernels.

Eager execution launches one kernel per memory-bound node, and each reads its inputs from and
writes its output to memory (``flops.node_cost``'s bytes). Inductor fuses every connected run of
such nodes into few kernels, and only what crosses the run's border moves: ``fused_regions``
groups them, and ``region_bytes`` counts that traffic.

* **Fusible** nodes: aten ops that are neither GEMMs, attention nor the fused loss, and that
  inductor lowers rather than calling the eager kernel (``torch._inductor.lowering.fallbacks``
  lists those it calls); views and other ops moving no data are fusible too. Collectives,
  autotp's own ops and the fallbacks are not: they are kernels of their own, as in eager.
* **Regions**: fusible nodes joined through their data edges, within one segment (the embedding, a
  decoder layer, the head, the preamble: a value another segment reads is written where it is
  made, so a rotary table does not join every layer's rotary into one region).
* **Bytes of a region**, charged to its first node: each input from outside it read once (a
  parameter, a GEMM's output, another region's output), and each member's output that something
  outside the region reads written once. A view passes its input's bytes on: a region that
  only reshapes a GEMM's output for another GEMM moves nothing.
* **Kernels**: one per region that moves bytes; ``compute.segment_time`` charges each one launch on
  the host (``HardwareProfile.compiled_launch_host_s``) forward, and one per region with a backward.
* **The fused lm_head + loss** traces through to its chunks, whose elementwise work inductor fuses:
  ``compiled_loss_bytes`` (its bytes sit in the same column, at its node).
* **Saved activations** (``compiled_saves``): what AOTAutograd's partitioner keeps for the backward, the
  cheapest cut of each region from which its backward recomputes the rest.

Where inductor splits a region (at a reduction over another dim) is left out;
``benchmarks/bench_cost_model.py --validate --compile`` measures how far the whole moves (``docs/planner.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from torch.fx import Node

from autotp.analysis.local_shapes import TensorInfo
from autotp.cost_model.flops import Tensors, node_cost
from autotp.cost_model.fused_loss import compiled_loss_bytes_per_logit, loss_bytes_per_logit
from autotp.ir import ops
from autotp.ir.op_facts import OpKind, op_kind


@functools.cache
def _inductor_fallbacks() -> frozenset:
    """The aten ops inductor runs as their eager kernels (imported on first use: ``torch._inductor`` loads
    in seconds, and only a compiled plan needs it)."""
    from torch._inductor.lowering import fallbacks

    return frozenset(fallbacks)


def fusible(node: Node) -> bool:
    """Whether inductor fuses ``node`` with its fusible neighbours (module docstring)."""
    if node.op != "call_function" or op_kind(node.target) is not OpKind.OTHER:
        return False
    namespace = getattr(node.target, "namespace", None)
    return namespace in ("aten", "prims") and node.target not in _inductor_fallbacks()


def fused_regions(nodes: Iterable[Node], segment_of: dict[Node, object]) -> dict[Node, tuple[Node, ...]]:
    """Region head (its first node in graph order) -> the region's nodes in graph order (module docstring)."""
    members = [n for n in nodes if fusible(n)]
    parent = {n: n for n in members}

    def root(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for source in n.all_input_nodes:
            if source in parent and segment_of.get(source) == segment_of.get(n):
                a, b = root(source), root(n)
                if a is not b:
                    parent[b] = a
    regions: dict[Node, list[Node]] = {}
    for n in members:
        regions.setdefault(root(n), []).append(n)
    return {group[0]: tuple(group) for group in regions.values()}


def compiled_saves(regions: dict[Node, tuple[Node, ...]], saved_by: dict[Node, list[Node]],
                   tensors: dict[Node, list[TensorInfo]]) -> dict[Node, list[Node]]:
    """``saved_by`` (what eager autograd keeps for each node's backward, ``saved_tensors.saved_inputs``) as
    ``compile=True`` keeps it. AOTAutograd's partitioner saves, of the values a backward needs, the cheapest set
    from which it recomputes the rest by fusible ops: per region, the values its own nodes and the GEMMs reading it
    save are cut from the region's inputs at the least bytes (a minimum cut, networkx), and the cut is saved instead,
    by the region's earliest saver (whose backward, the last of theirs to run, frees it). Each region is cut alone:
    an input that a GEMM saves anyway still costs its bytes here, which measured closer to the partitioner's choice
    on the held-out workloads (memory MAPE 2.5% against 3.8% with such inputs free)."""
    import networkx as nx

    out = {n: list(xs) for n, xs in saved_by.items()}
    order = {n: i for i, n in enumerate(next(iter(saved_by)).graph.nodes)} if saved_by else {}
    region_of = {m: head for head, members in regions.items() for m in members}
    needs: dict[Node, set[Node]] = {}
    savers: dict[Node, list[Node]] = {}
    for n, xs in saved_by.items():
        for x in xs:
            if x in region_of:
                needs.setdefault(region_of[x], set()).add(x)
                savers.setdefault(region_of[x], []).append(n)
    for head, needed in needs.items():
        members = regions[head]
        inside = set(members)
        graph = nx.DiGraph()
        for v in members:
            graph.add_edge((v, "in"), (v, "out"), capacity=_nbytes(v, tensors))
            for source in v.all_input_nodes:
                if source not in inside:
                    graph.add_edge("reads", (source, "in"))
                    graph.add_edge((source, "in"), (source, "out"), capacity=_nbytes(source, tensors))
                graph.add_edge((source, "out"), (v, "in"))
        for v in needed:
            graph.add_edge((v, "out"), "needs")
        _, (reachable, _) = nx.minimum_cut(graph, "reads", "needs")
        cut = [v for v, side in (x for x in graph.nodes if isinstance(x, tuple))
               if side == "in" and (v, "in") in reachable and (v, "out") not in reachable]  # fmt: skip
        first = min(savers[head], key=order.__getitem__)
        for n in set(savers[head]):
            out[n] = [x for x in out[n] if region_of.get(x) is not head]
        out[first] = list(dict.fromkeys([*out[first], *cut]))
    return out


def _nbytes(node: Node, tensors: dict[Node, list[TensorInfo]]) -> float:
    return float(sum(t.nbytes for t in tensors.get(node, ()))) if node.op != "get_attr" else 0.0


def compiled_loss_bytes(node: Node, tensors: Tensors) -> float:
    """Bytes the fused lm_head + loss (``linear_cross_entropy``) moves under ``compile=True``: ``flops.node_cost``'s,
    its loss passes fused (``fused_loss.compiled_loss_bytes_per_logit``)."""
    hidden, weight = tensors(node.args[0])[0], tensors(node.args[1])[0]
    logits = hidden.numel // hidden.shape[-1] * weight.shape[0]
    eager, fused = loss_bytes_per_logit(weight.dtype.itemsize), compiled_loss_bytes_per_logit(weight.dtype.itemsize)
    return node_cost(node, tensors).bytes - logits * (eager - fused)


def region_bytes(regions: dict[Node, tuple[Node, ...]], grad: set[Node]) -> Callable[[Node, Tensors], tuple[float, ...]]:
    """``affine_costs`` measure: (bytes moved, kernels, bytes of a region with a backward) of the region ``node``
    heads, zeros for every other node; ``grad``: the nodes that need a gradient."""

    def measure(node: Node, tensors: Tensors) -> tuple[float, ...]:
        if node.target is ops.LINEAR_CROSS_ENTROPY:
            return compiled_loss_bytes(node, tensors), 0.0, 0.0
        members = regions.get(node)
        if members is None:
            return 0.0, 0.0, 0.0
        inside = set(members)
        computes = {n for n in members if node_cost(n, tensors).bytes > 0}
        if not computes:
            return 0.0, 0.0, 0.0
        made = _computed_inside(members, inside, computes)
        reads = {source for n in members for source in n.all_input_nodes if source not in inside}
        nbytes = sum(t.nbytes for source in reads for t in tensors(source))
        nbytes += sum(t.nbytes for n in members if n in made and any(u not in inside for u in n.users) for t in tensors(n))
        return float(nbytes), 1.0, float(nbytes) if any(n in grad for n in computes) else 0.0

    return measure


def _computed_inside(members: tuple[Node, ...], inside: set[Node], computes: set[Node]) -> set[Node]:
    """Members whose value some computing member of the region made (a view of one included): the values the
    region writes, where something outside reads them."""
    made: set[Node] = set()
    for n in members:  # graph order: a member's in-region inputs come before it
        if n in computes or any(s in made for s in n.all_input_nodes if s in inside):
            made.add(n)
    return made
