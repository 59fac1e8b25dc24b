"""What one compiled rank graph does, node by node and layer by layer.

Shared by ``autotp dump`` (which draws it) and ``autotp explain`` (which tabulates it).

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
from autotp.cost_model.flops import compute_time_s, node_cost, op_name
from autotp.cost_model.hardware import H200, HardwareProfile
from autotp.analysis.layers import EMBEDDING, HEAD, LayerKey, last_layer_position, layer_of, outside_layers
from autotp.ir.layouts import Layout
from autotp.ir.plan import ParallelPlan

KINDS = ("all_reduce", "all_gather", "p2p")
DIRECTIONS = ("forward", "backward")

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class CollectiveCost:
    kind: str
    direction: str
    bytes: int
    ranks: int
    time_s: float


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
    if node.meta.get(meta_keys.COLLECTIVE) == "all_reduce_backward":
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
    def cost(kind: str, direction: str, nbytes: int, ranks: int = tp) -> CollectiveCost:
        return CollectiveCost(kind, direction, nbytes, ranks, group_collective_s(kind, nbytes, ranks, ranks, hw))

    tag = node.meta.get(meta_keys.COLLECTIVE)
    if tag is not None:
        nbytes = sum(t.nbytes for t in global_tensors(node))
        ranks = node.meta[meta_keys.COLLECTIVE_RANKS]
        if tag == "all_reduce":
            return (cost("all_reduce", "forward", nbytes, ranks),)
        if tag == "all_gather":
            return (cost("all_gather", "forward", nbytes, ranks),)
        assert tag == "all_reduce_backward", f"unknown collective tag {tag!r} on {node.name}"
        return (cost("all_reduce", "backward", nbytes, ranks),)
    if node.op == "call_function" and node.target is ops.STAGE_BOUNDARY:
        nbytes = sum(t.nbytes for t in local)
        return (cost("p2p", "forward", nbytes, 2), cost("p2p", "backward", nbytes, 2))
    if node.op == "call_function" and node.target is ops.VOCAB_PARALLEL_CROSS_ENTROPY:
        tokens = global_tensors(node.args[1])[0].numel
        return (
            cost("all_reduce", "forward", tokens * _FLOAT32_BYTES),
            cost("all_reduce", "forward", 2 * tokens * _FLOAT32_BYTES),
        )
    return ()


# ---- the report ---------------------------------------------------------------------


def _zero_counts() -> dict[str, dict[str, int]]:
    return {kind: {d: 0 for d in DIRECTIONS} for kind in KINDS}


def _layer_report(key: LayerKey, stage: int | None, members: list[NodeReport]) -> LayerReport:
    counts, nbytes = _zero_counts(), _zero_counts()
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


def _by_layer(plan: ParallelPlan, nodes: list[NodeReport], stage: int | None = None) -> tuple[LayerReport, ...]:
    """Per-layer sums; a stage's view runs all its nodes on that stage, so its rows say so."""
    grouped: dict[LayerKey, list[NodeReport]] = {}
    for r in nodes:
        grouped.setdefault(r.layer, []).append(r)
    return tuple(
        _layer_report(k, layer_stage(k, plan) if stage is None else stage, grouped[k])
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
    return GraphReport(gm, plan, rank, hardware, tuple(reports), _by_layer(plan, reports))


def stage_view(report: GraphReport, stage: int) -> GraphReport:
    """What pipeline stage ``stage`` runs: its nodes, the repeated nodes they read, and the
    boundaries it sends across."""
    assert report.stage is None, "stage_view takes the whole rank's report"
    plan = report.plan
    if not 0 <= stage < plan.pp:
        raise ValueError(f"stage {stage} is outside pp={plan.pp}; pick 0..{plan.pp - 1}")
    by_node = {r.node: r for r in report.nodes}
    keep: set[Node] = set()
    pending = [
        r.node
        for r in report.nodes
        if r.stage == stage
        or (r.node.op == "call_function" and r.node.target is ops.STAGE_BOUNDARY and plan.pp_rank_of_chunk(r.node.args[1] - 1) == stage)
    ]
    while pending:
        node = pending.pop()
        if node in keep:
            continue
        keep.add(node)
        pending += [a for a in node.all_input_nodes if by_node[a].stage is None]
    nodes = [r for r in report.nodes if r.node in keep]
    return GraphReport(report.graph, plan, report.rank, report.hardware, tuple(nodes), _by_layer(plan, nodes, stage), stage)


# ---- explain: totals, the Megatron comparison, JSON and table ------------------------


def totals(report: GraphReport) -> LayerReport:
    return _layer_report("total", report.stage, list(report.nodes))


def stage_totals(report: GraphReport) -> list[LayerReport]:
    """Totals of every pipeline stage in the report (one, for a stage's view)."""
    if report.stage is not None:
        return [totals(report)]
    return [totals(stage_view(report, s)) for s in range(report.plan.pp)]


def megatron_minimum(report: GraphReport) -> dict[str, Any]:
    """Megatron's 2 forward + 2 backward all-reduces per decoder layer (none at tp=1),
    against the plan's."""
    decoder = [l for l in report.layers if isinstance(l.layer, int)]
    minimum = 2 * len(decoder) if report.tp > 1 else 0
    plan = {d: sum(l.collectives["all_reduce"][d] for l in decoder) for d in DIRECTIONS}
    return {
        "decoder_layers": len(decoder),
        "all_reduce": {"forward": minimum, "backward": minimum},
        "plan_all_reduce": plan,
        "meets": plan["forward"] <= minimum and plan["backward"] <= minimum,
    }


def _without(entry: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in keys}


def explain_json(report: GraphReport, model: str) -> dict[str, Any]:
    """Per layer, per pipeline stage (what each stage's ranks hold and run) and in total."""
    return {
        "model": model,
        "tp": report.tp,
        "pp": report.plan.pp,
        "rank": report.rank,
        "inputs": report.inputs(),
        "flops": "forward, per rank",
        "layers": [l.to_json() for l in report.layers],
        "stages": [_without(t.to_json(), "layer") for t in stage_totals(report)],
        "totals": _without(totals(report).to_json(), "layer", "stage"),
        "megatron_minimum": megatron_minimum(report),
    }


def _row_key(layer: LayerReport) -> dict[str, Any]:
    key = layer.to_json()
    del key["layer"]
    return key


def _runs(layers: tuple[LayerReport, ...]) -> list[tuple[str, LayerReport]]:
    """Rows of the table: runs of identical consecutive decoder layers share one row."""
    rows: list[tuple[str, LayerReport]] = []
    run: list[LayerReport] = []

    def flush() -> None:
        if run:
            name = str(run[0].layer) if len(run) == 1 else f"{run[0].layer}-{run[-1].layer} (each)"
            rows.append((name, run[0]))
            run.clear()

    for layer in layers:
        if isinstance(layer.layer, int) and run and _row_key(run[-1]) == _row_key(layer):
            run.append(layer)
            continue
        flush()
        if isinstance(layer.layer, int):
            run.append(layer)
        else:
            rows.append((str(layer.layer), layer))
    flush()
    return rows


def explain_table(report: GraphReport, model: str) -> str:
    mb = 1e6
    pipelined = report.plan.pp > 1

    def cells(name: str, l: LayerReport) -> tuple[str, ...]:
        stage = ("" if l.stage is None else str(l.stage),) if pipelined else ()
        p2p = (str(l.collectives["p2p"]["forward"]),) if pipelined else ()
        return (
            name,
            *stage,
            str(l.collectives["all_reduce"]["forward"]),
            str(l.collectives["all_reduce"]["backward"]),
            str(l.collectives["all_gather"]["forward"]),
            *p2p,
            f"{sum(sum(d.values()) for d in l.collective_bytes.values()) / mb:.1f}",
            f"{l.param_bytes_per_rank / mb:.1f}",
            f"{l.flops_per_rank / 1e9:.2f}",
        )

    header = (
        "layer",
        *(("stage",) if pipelined else ()),
        "fwd AR",
        "bwd AR",
        "fwd AG",
        *(("p2p",) if pipelined else ()),
        "comm MB",
        "params MB/rank",
        "GFLOPs/rank",
    )
    body = [cells(name, l) for name, l in _runs(report.layers)]
    whole = report.stage is None
    stages = [cells(f"stage {t.stage} total", t) for t in stage_totals(report)] if pipelined and whole else []
    total = cells("total", totals(report))
    widths = [max(len(r[i]) for r in [header, *body, *stages, total]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    inputs = ", ".join(f"{k} {v}" for k, v in report.inputs().items())
    legend = "AR all-reduce, AG all-gather" + (", p2p stage-boundary sends" if pipelined else "")
    m = megatron_minimum(report)
    verdict = "meets it" if m["meets"] else "exceeds it"
    rule = "-" * len(line(header))
    layers = f"{m['decoder_layers']} decoder layer{'' if m['decoder_layers'] == 1 else 's'}"
    megatron = (
        f"Megatron minimum for {layers}: {m['all_reduce']['forward']} forward + {m['all_reduce']['backward']} "
        f"backward all-reduces; this plan: {m['plan_all_reduce']['forward']} + {m['plan_all_reduce']['backward']} "
        f"({verdict})"
    )
    return "\n".join(
        [
            f"{model}, tp={report.tp}, pp={report.plan.pp}, rank {report.rank}; inputs {inputs}",
            f"{legend}; MB = 1e6 bytes; FLOPs are forward, per rank",
            "",
            line(header),
            *(line(r) for r in body),
            rule,
            *(line(r) for r in stages),
            line(total),
            "",
            megatron,
        ]
    )
