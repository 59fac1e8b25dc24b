"""What must hold after every pass; the runner checks it and names the pass that broke it.

* **Collectives carry their metadata**: every inserted collective node has
  ``autotp_collective`` (its kind) and ``autotp_collective_ranks`` (its group size >= 1),
  which reports, dumps and the cost model read.
* **Stage boundaries are adjacent**: a ``stage_boundary(x, c)`` node runs in chunk c, its
  input in chunk c - 1, and its users in chunk c (or they are the next boundary), so a
  chunk only talks to its neighbours.
* **Layouts fit the tensors**: every sharded dim of a node's layout exists in its
  (global) value and has the size of its ``DimVar``; a partial layout is never sharded.

Each check returns a list of problems (empty when the graph is fine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.ir.layouts import Layout

Invariant = Callable[[GraphModule], list[str]]


def _boundary_chunk(node: Node) -> int | None:
    """The chunk a ``stage_boundary`` node crosses into, or None for other nodes."""
    return node.args[1] if node.op == "call_function" and node.target is ops.STAGE_BOUNDARY else None


# Collectives that ``insert_collectives`` places; the vocab-parallel ops carry their own.
_INSERTED = frozenset({ops.COPY_TO_TP, ops.REDUCE_FROM_TP, ops.GATHER_FROM_TP, ops.ALL_GATHER, ops.REDUCE_SCATTER})


def collectives_have_metadata(gm: GraphModule) -> list[str]:
    problems = []
    for node in gm.graph.nodes:
        if meta_keys.COLLECTIVE not in node.meta:
            if node.op == "call_function" and node.target in _INSERTED:
                problems.append(f"collective {node.name} has no {meta_keys.COLLECTIVE} metadata")
            continue
        ranks = node.meta.get(meta_keys.COLLECTIVE_RANKS)
        if node.op != "call_function" or not isinstance(ranks, int) or ranks < 1:
            problems.append(f"collective {node.name} ({node.op}) has group size {ranks!r}")
    return problems


def stage_boundaries_are_adjacent(gm: GraphModule) -> list[str]:
    problems = []
    for node in gm.graph.nodes:
        chunk = _boundary_chunk(node)
        if chunk is None:
            continue
        source = node.all_input_nodes[0]
        if node.meta.get(meta_keys.CHUNK) != chunk or source.meta.get(meta_keys.CHUNK) != chunk - 1:
            problems.append(
                f"boundary {node.name} into chunk {chunk} runs in chunk {node.meta.get(meta_keys.CHUNK)} "
                f"on {source.name} of chunk {source.meta.get(meta_keys.CHUNK)}"
            )
        for user in node.users:
            into_next = _boundary_chunk(user) == chunk + 1
            if user.op != "output" and user.meta.get(meta_keys.CHUNK) != chunk and not into_next:
                problems.append(f"boundary {node.name} into chunk {chunk} is used by {user.name} in chunk {user.meta.get(meta_keys.CHUNK)}")
    return problems


def _layouts(node: Node) -> list[tuple[Layout, object]]:
    lay, val = node.meta.get(meta_keys.LAYOUT), node.meta.get("val")
    if isinstance(lay, Layout):
        return [(lay, val)]
    if isinstance(lay, tuple) and isinstance(val, (tuple, list)) and len(lay) == len(val):
        return [(l, v) for l, v in zip(lay, val) if isinstance(l, Layout)]
    return []


def layouts_fit_values(gm: GraphModule) -> list[str]:
    problems = []
    for node in gm.graph.nodes:
        for lay, val in _layouts(node):
            if lay.partial and lay.dims:
                problems.append(f"{node.name} is both partial and sharded")
            if not isinstance(val, torch.Tensor):
                continue
            for d, var in lay.dims:
                root = var.find()
                if d >= val.dim():
                    problems.append(f"{node.name}: layout shards dim {d} of a {val.dim()}-d tensor")
                elif (root.size != val.shape[d]) and not root.padded:
                    problems.append(f"{node.name}: dim {d} has size {val.shape[d]} but its sharded var has {root.size}")
    return problems


INVARIANTS: tuple[Invariant, ...] = (collectives_have_metadata, stage_boundaries_are_adjacent, layouts_fit_values)
