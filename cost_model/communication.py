"""Alpha-beta costs of collectives (the ops themselves live in ``autotp.runtime.processes.collectives``).

A collective over t ranks of a ``Link`` (alpha = ``latency_s``, h = ``hop_latency_s``,
B = ``bus_bytes_per_s``) moving a tensor of n bytes costs
``alpha + steps·h + traffic / B``. ``traffic`` is what each rank sends, so B is NCCL's
bus bandwidth for every collective:

==================  ===================  =================  ==========================
collective           function             steps              traffic
==================  ===================  =================  ==========================
ring all-reduce      ``ring_all_reduce_s``  2(t-1)           2(t-1)/t · n
tree all-reduce      ``tree_all_reduce_s``  2⌈log2 t⌉        2 · n (double binary tree:
                                                              reduce up, broadcast down)
reduce-scatter       ``reduce_scatter_s``   t-1              (t-1)/t · n (n: the input)
all-gather           ``all_gather_s``       t-1              (t-1)/t · n (n: the output)
all-to-all           ``all_to_all_s``       t-1              (t-1)/t · n (n: one rank's)
point-to-point       ``p2p_s``              0                n
==================  ===================  =================  ==========================

**Overlapped** (``overlapped_s``): an all-gather pipelined with the GEMM that consumes it,
or a reduce-scatter with the GEMM that produces it (``autotp.runtime.execution.overlap``), runs in
t - 1 steps that each move 1/(t-1) of the collective (time C) while a GEMM chunk, 1/t of
the GEMM (time M), computes; one chunk computes alone. The pair takes
(t-1)·max(C/(t-1), M/t) + M/t, so what the GEMM does not hide is

    exposed = max(0, C - (t-1)/t · M)

``all_reduce_s`` takes the cheaper of ring and tree, as NCCL's tuner does: the ring's
bandwidth term is smaller, the tree's latency grows as log t instead of t. Every cost
is 0 for t = 1.

A group spanning nodes (``group_all_reduce_s``) runs hierarchically, like NCCL: with g
of its ranks on each of k nodes, reduce-scatter inside the node, all-reduce the n/g
shards across nodes (the g GPUs of a node use their own NICs, so ``inter_node`` is a
per-GPU link), all-gather inside the node:

    T = reduce_scatter(n, g, intra) + all_reduce(n/g, k, inter) + all_gather(n, g, intra)

and a reduce-scatter or all-gather spanning nodes (``group_sharded_s``) likewise, as
the two halves of that all-reduce: inside the node over n, across nodes over n/g:

    T = reduce_scatter(n, g, intra) + reduce_scatter(n/g, k, inter)
"""

from __future__ import annotations

import math

from autotp.cost_model.hardware import HardwareProfile, Link
from autotp.ir.op_facts import Collective


def _ceil_log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def ring_all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks == 1:
        return 0.0
    return link.latency_s + 2 * (ranks - 1) * link.hop_latency_s + 2 * (ranks - 1) / ranks * nbytes / link.bus_bytes_per_s


def tree_all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks == 1:
        return 0.0
    return link.latency_s + 2 * _ceil_log2(ranks) * link.hop_latency_s + 2 * nbytes / link.bus_bytes_per_s


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    return min(ring_all_reduce_s(nbytes, ranks, link), tree_all_reduce_s(nbytes, ranks, link))


def reduce_scatter_s(nbytes: float, ranks: int, link: Link) -> float:
    if ranks == 1:
        return 0.0
    return link.latency_s + (ranks - 1) * link.hop_latency_s + (ranks - 1) / ranks * nbytes / link.bus_bytes_per_s


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    return reduce_scatter_s(nbytes, ranks, link)


def overlapped_s(comm_s: float, matmul_s: float, ranks: int) -> float:
    """The part of a collective of ``comm_s`` that a ``matmul_s`` GEMM pipelined with it leaves exposed."""
    if ranks == 1:
        return 0.0
    return max(0.0, comm_s - (ranks - 1) / ranks * matmul_s)


def all_to_all_s(nbytes: float, ranks: int, link: Link) -> float:
    return reduce_scatter_s(nbytes, ranks, link)


def p2p_s(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bus_bytes_per_s


def group_all_reduce_s(nbytes: float, ranks: int, ranks_per_node: int, hw: HardwareProfile) -> float:
    """All-reduce over ``ranks`` ranks, ``ranks_per_node`` of them on each node."""
    if ranks == 1:
        return 0.0
    if ranks_per_node >= ranks:
        return all_reduce_s(nbytes, ranks, hw.intra_node)
    nodes = ranks // ranks_per_node
    if ranks_per_node == 1:
        return all_reduce_s(nbytes, nodes, hw.inter_node)
    return (
        reduce_scatter_s(nbytes, ranks_per_node, hw.intra_node)
        + all_reduce_s(nbytes / ranks_per_node, nodes, hw.inter_node)
        + all_gather_s(nbytes, ranks_per_node, hw.intra_node)
    )


def group_sharded_s(nbytes: float, ranks: int, ranks_per_node: int, hw: HardwareProfile) -> float:
    """Reduce-scatter (n: the input) or all-gather (n: the output) over ``ranks`` ranks, ``ranks_per_node`` per node."""
    if ranks_per_node >= ranks:
        return reduce_scatter_s(nbytes, ranks, hw.intra_node)
    nodes = ranks // ranks_per_node
    return reduce_scatter_s(nbytes, ranks_per_node, hw.intra_node) + reduce_scatter_s(nbytes / ranks_per_node, nodes, hw.inter_node)


def group_collective_s(kind: Collective, nbytes: float, ranks: int, ranks_per_node: int, hw: HardwareProfile) -> float:
    """An ``all_reduce`` (hierarchical across nodes), ``all_gather`` or ``reduce_scatter``
    (ring over the slowest link) or ``p2p`` send between two ranks of a node."""
    if kind == Collective.P2P:
        return p2p_s(nbytes, hw.intra_node) if ranks > 1 else 0.0
    if kind == Collective.ALL_REDUCE:
        return group_all_reduce_s(nbytes, ranks, ranks_per_node, hw)
    assert kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER), f"unknown collective {kind!r}"
    return all_gather_s(nbytes, ranks, hw.intra_node if ranks_per_node >= ranks else hw.inter_node)
