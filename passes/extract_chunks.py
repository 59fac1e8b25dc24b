"""Cut the rank graph into one graph per pipeline chunk (``autotp.ir.program``).

``split_stages`` marked every value that crosses from chunk c-1 to chunk c with a
``stage_boundary(x, c)`` node. Chunk c's graph computes the nodes of chunk c and the cheap
input-derived values it reads (``autotp_chunk`` None: masks, positions, parameter reads),
which every chunk that needs them repeats, with the in-place writes into such a value (a
``labels.new_zeros(...)`` filled through a view: no node reads the writes, so each chunk
that needs the value repeats them). Its inputs are the model inputs it reads, then chunk
c's boundary values (``recv_<name>``; one the chunk writes in place is copied first); its outputs are the values that feed chunk c+1's
boundaries, and on the last chunk the model's outputs. Each becomes submodule
``chunk_<c>`` of the rank graph, its ``ChunkSpec`` in the submodule's meta (this rank's
shapes of what it receives and sends).

Without a pipeline, ``chunk_0`` is a copy of the whole graph, called with the model's
keyword arguments. The rank graph itself stays as it is, for reports.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from autotp.analysis.local_shapes import local_shape
from autotp.ir import meta_keys, ops
from autotp.ir.op_facts import writes_by_base
from autotp.ir.program import CHUNK_PREFIX, CHUNK_SPEC, Boundary, ChunkSpec
from autotp.passes.runner import PassContext
from autotp.passes.subgraphs import standalone

aten = torch.ops.aten


def _boundary(node: Node, tp: int) -> Boundary:
    val = node.meta["val"]
    carries_grad = val.dtype.is_floating_point or val.dtype.is_complex  # a spectrum between a model's layers
    return Boundary(local_shape(node, tp), val.dtype, bool(node.meta.get(meta_keys.NEEDS_GRAD)) and carries_grad)


def whole_copy(gm: GraphModule, class_name: str) -> GraphModule:
    """A copy of ``gm`` with its own graph and calling convention, sharing its attributes."""
    graph = Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = GraphModule(gm, graph, class_name=class_name)
    for spec in ("_in_spec", "_out_spec"):
        if hasattr(gm, spec):
            setattr(copy, spec, getattr(gm, spec))
    return copy


def _chunk(gm: GraphModule, c: int, num_chunks: int, tp: int, repeated_writes: dict[Node, list[Node]]) -> GraphModule:
    nodes = list(gm.graph.nodes)
    boundaries = [n for n in nodes if n.target is ops.STAGE_BOUNDARY and n.args[1] == c]
    is_last = c == num_chunks - 1
    next_boundaries = [] if is_last else [n for n in nodes if n.target is ops.STAGE_BOUNDARY and n.args[1] == c + 1]
    sends = [b.args[0] for b in next_boundaries]
    own = {n for n in nodes if n.meta.get(meta_keys.CHUNK) == c and n.op != "placeholder"}
    needed: set[Node] = set()
    stack = list(own) + sends
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.target is ops.STAGE_BOUNDARY and n.args[1] == c:
            continue  # received, not computed
        stack.extend(a for a in n.all_input_nodes if a.meta.get(meta_keys.CHUNK) is None or a in own)
        stack.extend(repeated_writes.get(n, []))
    placeholders = [n for n in nodes if n.op == "placeholder" and n in needed]
    inputs = [(p, p.name) for p in placeholders] + [(b, f"recv_{b.args[0].name}") for b in boundaries]
    body = [n for n in nodes if n in needed and n.op not in ("placeholder", "output")]
    output = next(n for n in nodes if n.op == "output").args[0] if is_last else tuple(sends)
    sub = standalone(gm, body, inputs, output, f"{CHUNK_PREFIX}{c}")
    written = writes_by_base(body)
    _copy_written(sub, {f"recv_{b.args[0].name}" for b in boundaries if b in written})
    sub.meta[CHUNK_SPEC] = ChunkSpec(
        chunk=c,
        input_names=tuple(p.name for p in placeholders),
        recv=tuple(_boundary(b, tp) for b in boundaries),
        send=tuple(_boundary(b, tp) for b in next_boundaries),
        is_last=is_last,
    )
    return sub


def _copy_written(sub: GraphModule, names: set[str]) -> None:
    """Make the chunk write into copies of the received values ``names``: a value the model wrote in
    place (``x += y`` on a layer's output) arrives as a leaf of the chunk's autograd graph, which
    autograd does not let an in-place op write."""
    if not names:
        return
    received = [n for n in sub.graph.nodes if n.op == "placeholder" and n.name in names]
    last = [n for n in sub.graph.nodes if n.op == "placeholder"][-1]
    for node in reversed(received):
        with sub.graph.inserting_after(last):
            copy = sub.graph.call_function(aten.clone.default, (node,))
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
    sub.recompile()


def extract_chunks(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Attach ``chunk_<c>`` for every chunk of the plan (module docstring)."""
    num_chunks = ctx.plan.num_chunks
    if num_chunks == 1:
        whole = whole_copy(gm, f"{CHUNK_PREFIX}0")
        whole.meta[CHUNK_SPEC] = ChunkSpec(0, (), (), (), is_last=True, whole=True)
        gm.add_submodule(f"{CHUNK_PREFIX}0", whole)
        return gm
    repeated_writes = writes_by_base(n for n in gm.graph.nodes if n.meta.get(meta_keys.CHUNK) is None)
    for c in range(num_chunks):
        gm.add_submodule(f"{CHUNK_PREFIX}{c}", _chunk(gm, c, num_chunks, ctx.plan.tp, repeated_writes))
    return gm
