"""What one compiled rank graph does, node by node and layer by layer: ``build_report``.

Read by the cost model (``compute.py`` costs segments from it), ``autotp dump`` (which
draws it) and ``autotp explain`` (which tabulates it, ``autotp.report.graph_report``).

* **Shapes** are this rank's: the global ``node.meta["val"]`` shape with every sharded
  dim of the node's layout replaced by its local size.
* **Layer** of a node: ``autotp.analysis.layers``, the first integer in its innermost
  ``nn_module_stack`` path (``model.layers.3.mlp`` -> 3, ``transformer.h.3`` -> 3).
  Nodes after the last layer's last node belong to ``"head"``. Before, nodes of a module
  outside the layers (``model.embed_tokens``, ``model.rotary_emb``) belong to
  ``"embedding"``, and nodes without a module path to the layer in progress.
  Inputs, parameter reads, *f* (it opens the block its value enters: in a post-norm
  model that value comes from the previous layer's norm) and inserted nodes without a
  module path (stage boundaries) take the layer of their first user (``labels``
  belong to the head).
* **Collectives**: *g* (``reduce_from_tp``) is a forward all-reduce, *f* (``copy_to_tp``)
  a backward all-reduce of the gradient, ``gather_from_tp`` a forward all-gather. The
  vocab-parallel cross-entropy all-reduces twice forward: the row max [N] and the
  stacked sum-exp and target logit [2, N], both float32. Bytes are the full tensor's
  (an all-reduced tensor is whole on every rank; an all-gather's is its output).
  ``all_gather_matmul`` all-gathers its first output forward and reduce-scatters its grad
  backward; ``matmul_reduce_scatter`` the reverse. Both are ``overlapped``: their GEMM hides
  part of them (``communication.overlapped_s``, charged by ``compute.segment_time``).
  ``fp8_linear`` all-reduces (max) the amaxes of operands split over the group, once
  forward and once backward (float32, ``cost_model.fp8.amax_reduce_bytes``); with an FP8
  all-gather its input's tokens go forward in FP8 (1 byte each) and their gradient comes
  back reduce-scattered.
* **FLOPs** are forward only (``autotp.cost_model.flops``); times are estimates for a
  ``HardwareProfile``.
* **Stages**: a node's pipeline stage is the pp rank of its chunk (``split_stages``
  writes the chunk; chunk c runs on pp rank ``plan.pp_rank_of_chunk(c)``). Nodes that
  every chunk repeats (masks, positions, parameter reads) have none. A
  ``stage_boundary`` is a point-to-point transfer of this rank's shard: the activation
  forward, its gradient backward. With pp = 1 every node is in stage 0.
* CUDA-graph regions come from the ``mark_cudagraph_regions`` pass, when the plan asks for CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule, Node

from autotp.ir import meta_keys, ops
from autotp.analysis.local_shapes import TensorInfo, global_tensors, local_tensors
from autotp.cost_model.communication import group_collective_s
from autotp.cost_model.flops import compute_time_s, node_cost
from autotp.cost_model.fp8 import amax_reduce_bytes
from autotp.cost_model.hardware import H200, HardwareProfile
from autotp.analysis.layers import EMBEDDING, HEAD, LayerKey, last_layer_position, layer_of, outside_layers
from autotp.ir.layouts import Layout
from autotp.ir.plan import ParallelPlan
from autotp.ir.op_facts import TAG_COMMUNICATION, Collective, CollectiveTag, Direction, op_name

KINDS = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.P2P)
DIRECTIONS = tuple(Direction)

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class CollectiveCost:
    kind: Collective
    direction: Direction
    bytes: int
    ranks: int
    time_s: float
    overlapped: bool = False


@dataclass(frozen=True)
class NodeReport:
    node: Node
    layer: LayerKey
    op: str
    tensors: tuple[TensorInfo, ...]
    layout: str | None
    collectives: tuple[CollectiveCost, ...]
    flops: int
    bytes: int
    time_s: float
    param_bytes: int
    chunk: int | None
    stage: int | None


@dataclass(frozen=True)
class LayerReport:
    layer: LayerKey
    stage: int | None
    ops: int
    collectives: dict[str, dict[str, int]]
    collective_bytes: dict[str, dict[str, int]]
    param_bytes_per_rank: int
    flops_per_rank: int
    compute_time_s: float
    comm_time_s: float

    def to_json(self) -> dict[str, Any]:
        """The deterministic part (no time estimates)."""
        return {
            "layer": self.layer,
            "stage": self.stage,
            "ops": self.ops,
            "collectives": self.collectives,
            "collective_bytes": self.collective_bytes,
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "flops_per_rank": self.flops_per_rank,
        }


@dataclass(frozen=True)
class GraphReport:
    """A rank's graph, or the part of it that one pipeline stage runs (``stage_view``)."""

    graph: GraphModule
    plan: ParallelPlan
    rank: int
    hardware: HardwareProfile
    nodes: tuple[NodeReport, ...]
    layers: tuple[LayerReport, ...]
    stage: int | None = None

    @property
    def tp(self) -> int:
        return self.plan.tp

    def inputs(self) -> dict[str, list[int]]:
        """Shapes of the graph's tensor inputs (``input_ids``, ``labels``...)."""
        return {r.node.name: list(r.tensors[0].shape) for r in self.nodes if r.node.op == "placeholder" and r.tensors}


# ---- shapes and layouts -------------------------------------------------------------


def describe_layout(node: Node, tp: int) -> str | None:
    lay = node.meta.get(meta_keys.LAYOUT)
    if isinstance(lay, Layout):
        return lay.describe(tp)
    if isinstance(lay, tuple):
        return "(" + ", ".join(l.describe(tp) if isinstance(l, Layout) else "-" for l in lay) + ")"
    return None


# ---- layers -------------------------------------------------------------------------


def _joins_its_user(node: Node) -> bool:
    if node.meta.get(meta_keys.COLLECTIVE) == CollectiveTag.ALL_REDUCE_BACKWARD:
        return True
    inserted = meta_keys.COLLECTIVE in node.meta or node.target is ops.STAGE_BOUNDARY
    return inserted and not node.meta.get("nn_module_stack")


def assign_layers(gm: GraphModule) -> dict[Node, LayerKey]:
    """Layer of every node (rules in the module docstring)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    from_path = {n: layer_of(n) for n in nodes if n.op == "call_function"}
    last = last_layer_position(nodes)
    layers: dict[Node, LayerKey] = {}
    by_first_user: list[Node] = []
    current: LayerKey = EMBEDDING
    for i, n in enumerate(nodes):
        if n.op == "output":
            layers[n] = HEAD
        elif n.op in ("placeholder", "get_attr") or _joins_its_user(n):
            by_first_user.append(n)
        elif from_path[n] is not None:
            current = layers[n] = from_path[n]
        elif outside_layers(i, last) == HEAD:
            layers[n] = HEAD
        else:
            layers[n] = EMBEDDING if n.meta.get("nn_module_stack") else current
    for n in reversed(by_first_user):  # users come later in the graph, so they have a layer by now
        first = min(n.users, key=position.__getitem__, default=None)
        layers[n] = layers[first] if first is not None else EMBEDDING
    return layers


def layer_stage(key: LayerKey, plan: ParallelPlan) -> int:
    if key == EMBEDDING:
        chunk = plan.embedding_chunk
    elif key == HEAD:
        chunk = plan.head_chunk
    else:
        chunk = plan.layer_chunks[int(key)] if plan.layer_chunks else 0
    return plan.pp_rank_of_chunk(chunk)


def layer_order(key: LayerKey) -> tuple[int, int]:
    if key == EMBEDDING:
        return (0, 0)
    if key == HEAD:
        return (2, 0)
    return (1, int(key))


# ---- collectives --------------------------------------------------------------------


def _collectives(node: Node, tp: int, hw: HardwareProfile, local: list[TensorInfo]) -> tuple[CollectiveCost, ...]:
    def cost(kind: Collective, direction: Direction, nbytes: int, ranks: int = tp, overlapped: bool = False) -> CollectiveCost:
        return CollectiveCost(kind, direction, nbytes, ranks, group_collective_s(kind, nbytes, ranks, ranks, hw), overlapped)

    tag = node.meta.get(meta_keys.COLLECTIVE)
    if node.op == "call_function" and node.target is ops.FP8_LINEAR:
        out = []
        if tag == CollectiveTag.FP8_ALL_GATHER:  # the tokens travel in FP8 (1 byte each); their grad in the model's dtype
            tokens = global_tensors(node.args[0])[0]
            ranks = node.meta[meta_keys.COLLECTIVE_RANKS]
            out += [cost(Collective.ALL_GATHER, Direction.FORWARD, tokens.numel, ranks),
                    cost(Collective.REDUCE_SCATTER, Direction.BACKWARD, tokens.nbytes, ranks)]  # fmt: skip
        if node.args[-1]:  # the amaxes of split operands, max-reduced once per direction
            forward, backward = amax_reduce_bytes(node, lambda n: local_tensors(n, tp))
            out += [cost(Collective.ALL_REDUCE, d, b) for d, b in ((Direction.FORWARD, forward), (Direction.BACKWARD, backward)) if b]
        return tuple(out)
    if tag is not None:
        assert tag in TAG_COMMUNICATION, f"unknown collective tag {tag!r} on {node.name}"
        # the gathered input of all_gather_matmul is its first output
        tensors = global_tensors(node)[:1] if tag == CollectiveTag.ALL_GATHER_MATMUL else global_tensors(node)
        nbytes = sum(t.nbytes for t in tensors)
        ranks = node.meta[meta_keys.COLLECTIVE_RANKS]
        return tuple(cost(c.collective, c.direction, nbytes, ranks, c.overlapped) for c in TAG_COMMUNICATION[CollectiveTag(tag)])
    forward, backward = Direction.FORWARD, Direction.BACKWARD
    if node.op == "call_function" and node.target is ops.STAGE_BOUNDARY:
        nbytes = sum(t.nbytes for t in local)
        return (cost(Collective.P2P, forward, nbytes, 2), cost(Collective.P2P, backward, nbytes, 2))
    if node.op == "call_function" and node.target is ops.VOCAB_PARALLEL_CROSS_ENTROPY:
        tokens = global_tensors(node.args[1])[0].numel
        return (
            cost(Collective.ALL_REDUCE, forward, tokens * _FLOAT32_BYTES),
            cost(Collective.ALL_REDUCE, forward, 2 * tokens * _FLOAT32_BYTES),
        )
    return ()


# ---- the report ---------------------------------------------------------------------


def zero_counts() -> dict[str, dict[str, int]]:
    return {kind: {d: 0 for d in DIRECTIONS} for kind in KINDS}


def layer_report(key: LayerKey, stage: int | None, members: list[NodeReport]) -> LayerReport:
    counts, nbytes = zero_counts(), zero_counts()
    for r in members:
        for c in r.collectives:
            counts[c.kind][c.direction] += 1
            nbytes[c.kind][c.direction] += c.bytes
    return LayerReport(
        layer=key,
        stage=stage,
        ops=sum(1 for r in members if r.node.op == "call_function"),
        collectives=counts,
        collective_bytes=nbytes,
        param_bytes_per_rank=sum(r.param_bytes for r in members),
        flops_per_rank=sum(r.flops for r in members),
        compute_time_s=sum(r.time_s for r in members),
        comm_time_s=sum(c.time_s for r in members for c in r.collectives),
    )


def by_layer(plan: ParallelPlan, nodes: list[NodeReport], stage: int | None = None) -> tuple[LayerReport, ...]:
    """Per-layer sums; a stage's view runs all its nodes on that stage, so its rows say so."""
    grouped: dict[LayerKey, list[NodeReport]] = {}
    for r in nodes:
        grouped.setdefault(r.layer, []).append(r)
    return tuple(
        layer_report(k, layer_stage(k, plan) if stage is None else stage, grouped[k])
        for k in sorted(grouped, key=layer_order)
    )


def build_report(gm: GraphModule, plan: ParallelPlan, rank: int, hardware: HardwareProfile = H200) -> GraphReport:
    """Annotate every node of a compiled rank graph and sum them per layer."""
    tp = plan.tp
    layers = assign_layers(gm)
    params = {name: id(p) for name, p in gm.named_parameters(remove_duplicate=False)}
    cache: dict[Node, list[TensorInfo]] = {}

    def tensors(n: Node) -> list[TensorInfo]:
        if n not in cache:
            cache[n] = local_tensors(n, tp)
        return cache[n]

    # Tied parameters are one tensor under several names; an unused name holds no bytes.
    seen_params: set[int] = set()
    reports = []
    for n in gm.graph.nodes:
        cost = node_cost(n, tensors)
        param_bytes = 0
        param = params.get(str(n.target)) if n.op == "get_attr" and n.users else None
        if param is not None and param not in seen_params:
            seen_params.add(param)
            param_bytes = sum(t.nbytes for t in tensors(n))
        chunk = n.meta.get(meta_keys.CHUNK) if plan.num_chunks > 1 else 0
        reports.append(
            NodeReport(
                node=n,
                layer=layers[n],
                op=op_name(n.target) if n.op == "call_function" else n.op,
                tensors=tuple(tensors(n)),
                layout=describe_layout(n, tp),
                collectives=_collectives(n, tp, hardware, tensors(n)),
                flops=cost.flops,
                bytes=cost.bytes,
                time_s=compute_time_s(cost, hardware),
                param_bytes=param_bytes,
                chunk=chunk,
                stage=None if chunk is None else plan.pp_rank_of_chunk(chunk),
            )
        )
    return GraphReport(gm, plan, rank, hardware, tuple(reports), by_layer(plan, reports))

