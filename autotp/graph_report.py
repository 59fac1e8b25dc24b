"""What one compiled rank graph does, node by node and layer by layer.

Shared by ``autotp dump`` (which draws it) and ``autotp explain`` (which tabulates it).

* **Shapes** are this rank's: the global ``node.meta["val"]`` shape with every sharded
  dim of the node's layout replaced by its local size.
* **Layer** of a node: the first integer in its innermost ``nn_module_stack`` path
  (``model.layers.3.mlp`` -> 3, ``transformer.h.3`` -> 3), or in a parameter's name.
  Other nodes belong to ``"embedding"`` before the first layer, ``"head"`` after the
  last one, and to the layer in progress in between. A collective without a module
  path (the gradient all-reduce of a replicated KV weight) takes its input's layer; a
  parameter without an index takes its first user's.
* **Collectives**: *g* (``reduce_from_tp``) is a forward all-reduce, *f* (``copy_to_tp``)
  a backward all-reduce of the gradient, ``gather_from_tp`` a forward all-gather. The
  vocab-parallel cross-entropy all-reduces twice forward: the row max [N] and the
  stacked sum-exp and target logit [2, N], both float32. Bytes are the full tensor's
  (an all-reduced tensor is whole on every rank; an all-gather's is its output).
* **FLOPs** are forward only (``autotp.cost_model.flops``); times are estimates for a
  ``HardwareProfile``.
* Pipeline stages are not implemented yet: every node is in stage 0. CUDA-graph
  regions are not implemented yet either: nodes carry none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule, Node

from autotp import meta_keys
from autotp.cost_model.flops import (
    TensorInfo,
    collective_time_s,
    compute_time_s,
    global_tensors,
    node_cost,
    op_name,
)
from autotp.cost_model.hardware import H200, HardwareProfile
from autotp.layouts import Layout, local_size

EMBEDDING, HEAD = "embedding", "head"
LayerKey = int | str
KINDS = ("all_reduce", "all_gather")
DIRECTIONS = ("forward", "backward")

_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
# Mirrors ``replica_group_key``: f over the ranks that hold the same KV-head slice.
_REPLICA_GROUP = re.compile(r"_replicas(\d+)$")
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
    stage: int = 0

    @property
    def is_param(self) -> bool:
        return self.param_bytes > 0


@dataclass(frozen=True)
class LayerReport:
    layer: LayerKey
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
            "ops": self.ops,
            "collectives": self.collectives,
            "collective_bytes": self.collective_bytes,
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "flops_per_rank": self.flops_per_rank,
        }


@dataclass(frozen=True)
class GraphReport:
    graph: GraphModule
    tp: int
    rank: int
    hardware: HardwareProfile
    nodes: tuple[NodeReport, ...]
    layers: tuple[LayerReport, ...]

    def inputs(self) -> dict[str, list[int]]:
        """Shapes of the graph's tensor inputs (``input_ids``, ``labels``...)."""
        return {r.node.name: list(r.tensors[0].shape) for r in self.nodes if r.node.op == "placeholder" and r.tensors}


# ---- shapes and layouts -------------------------------------------------------------


def _layouts_for(node: Node, count: int) -> tuple[Layout | None, ...]:
    lay = node.meta.get(meta_keys.LAYOUT)
    if isinstance(lay, tuple) and len(lay) == count:
        return tuple(l if isinstance(l, Layout) else None for l in lay)
    return (lay if isinstance(lay, Layout) else None,) * count


def local_tensors(node: Node, tp: int) -> list[TensorInfo]:
    """The tensors a node produces on one rank."""
    global_infos = global_tensors(node)
    out = []
    for info, lay in zip(global_infos, _layouts_for(node, len(global_infos))):
        shape = list(info.shape)
        for d, var in lay.dims if lay is not None else ():
            shape[d] = local_size(var, tp)
        for d, merged, outer in node.meta.get(meta_keys.EXPAND_FIXUPS, []):
            shape[d] = local_size(merged, tp) // local_size(outer, tp)
        out.append(TensorInfo(tuple(shape), info.dtype))
    return out


def describe_layout(node: Node, tp: int) -> str | None:
    lay = node.meta.get(meta_keys.LAYOUT)
    if isinstance(lay, Layout):
        return lay.describe(tp)
    if isinstance(lay, tuple):
        return "(" + ", ".join(l.describe(tp) if isinstance(l, Layout) else "-" for l in lay) + ")"
    return None


# ---- layers -------------------------------------------------------------------------


def _index_in(path: str) -> int | None:
    m = _INDEX.search(path)
    return int(m.group(1)) if m else None


def _stack_layer(node: Node) -> int | None:
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        index = _index_in(path)
        if index is not None:
            return index
    return None


def _explicit_layer(node: Node) -> int | None:
    if node.op == "get_attr":
        return _index_in(str(node.target))
    return _stack_layer(node)


def assign_layers(gm: GraphModule) -> dict[Node, LayerKey]:
    """Layer of every node (rules in the module docstring)."""
    nodes = list(gm.graph.nodes)
    stack = {n: _stack_layer(n) for n in nodes if n.op == "call_function"}
    last = max((i for i, n in enumerate(nodes) if stack.get(n) is not None), default=-1)
    layers: dict[Node, LayerKey] = {}
    current: LayerKey = EMBEDDING
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            layers[n] = EMBEDDING
        elif n.op == "output":
            layers[n] = HEAD
        elif n.op == "call_function":
            if stack[n] is not None:
                current = layers[n] = stack[n]
            elif meta_keys.COLLECTIVE in n.meta and n.all_input_nodes and _explicit_layer(n.all_input_nodes[0]) is not None:
                layers[n] = _explicit_layer(n.all_input_nodes[0])  # type: ignore[assignment]
            else:
                layers[n] = HEAD if i > last else current
    position = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "get_attr":
            explicit = _explicit_layer(n)
            first_user = min(n.users, key=position.__getitem__, default=None)
            layers[n] = explicit if explicit is not None else (layers[first_user] if first_user else EMBEDDING)
    return layers


def layer_order(key: LayerKey) -> tuple[int, int]:
    if key == EMBEDDING:
        return (0, 0)
    if key == HEAD:
        return (2, 0)
    return (1, int(key))


# ---- collectives --------------------------------------------------------------------


def _collectives(node: Node, tp: int, hw: HardwareProfile) -> tuple[CollectiveCost, ...]:
    def cost(kind: str, direction: str, nbytes: int, ranks: int = tp) -> CollectiveCost:
        return CollectiveCost(kind, direction, nbytes, ranks, collective_time_s(kind, nbytes, ranks, hw))

    tag = node.meta.get(meta_keys.COLLECTIVE)
    if tag is not None:
        nbytes = sum(t.nbytes for t in global_tensors(node))
        if tag == "all_reduce":
            return (cost("all_reduce", "forward", nbytes),)
        if tag == "all_gather":
            return (cost("all_gather", "forward", nbytes),)
        assert tag == "all_reduce_backward", f"unknown collective tag {tag!r} on {node.name}"
        replicas = _REPLICA_GROUP.search(str(node.args[1]))
        return (cost("all_reduce", "backward", nbytes, int(replicas.group(1)) if replicas else tp),)
    if node.op == "call_function" and op_name(node.target) == "vocab_parallel_cross_entropy":
        tokens = global_tensors(node.args[1])[0].numel
        return (
            cost("all_reduce", "forward", tokens * _FLOAT32_BYTES),
            cost("all_reduce", "forward", 2 * tokens * _FLOAT32_BYTES),
        )
    return ()


# ---- the report ---------------------------------------------------------------------


def _zero_counts() -> dict[str, dict[str, int]]:
    return {kind: {d: 0 for d in DIRECTIONS} for kind in KINDS}


def _layer_report(key: LayerKey, members: list[NodeReport]) -> LayerReport:
    counts, nbytes = _zero_counts(), _zero_counts()
    for r in members:
        for c in r.collectives:
            counts[c.kind][c.direction] += 1
            nbytes[c.kind][c.direction] += c.bytes
    return LayerReport(
        layer=key,
        ops=sum(1 for r in members if r.node.op == "call_function"),
        collectives=counts,
        collective_bytes=nbytes,
        param_bytes_per_rank=sum(r.param_bytes for r in members),
        flops_per_rank=sum(r.flops for r in members),
        compute_time_s=sum(r.time_s for r in members),
        comm_time_s=sum(c.time_s for r in members for c in r.collectives),
    )


def build_report(gm: GraphModule, tp: int, rank: int, hardware: HardwareProfile = H200) -> GraphReport:
    """Annotate every node of a compiled rank graph and sum them per layer."""
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
        reports.append(
            NodeReport(
                node=n,
                layer=layers[n],
                op=op_name(n.target) if n.op == "call_function" else n.op,
                tensors=tuple(tensors(n)),
                layout=describe_layout(n, tp),
                collectives=_collectives(n, tp, hardware),
                flops=cost.flops,
                bytes=cost.bytes,
                time_s=compute_time_s(cost, hardware),
                param_bytes=param_bytes,
            )
        )
    grouped: dict[LayerKey, list[NodeReport]] = {}
    for r in reports:
        grouped.setdefault(r.layer, []).append(r)
    layer_reports = tuple(_layer_report(k, grouped[k]) for k in sorted(grouped, key=layer_order))
    return GraphReport(gm, tp, rank, hardware, tuple(reports), layer_reports)


# ---- explain: totals, the Megatron comparison, JSON and table ------------------------


def totals(report: GraphReport) -> LayerReport:
    return _layer_report("total", list(report.nodes))


def megatron_minimum(report: GraphReport) -> dict[str, Any]:
    """Megatron's 2 forward + 2 backward all-reduces per decoder layer, against the plan's."""
    decoder = [l for l in report.layers if isinstance(l.layer, int)]
    n = len(decoder)
    plan = {d: sum(l.collectives["all_reduce"][d] for l in decoder) for d in DIRECTIONS}
    return {
        "decoder_layers": n,
        "all_reduce": {"forward": 2 * n, "backward": 2 * n},
        "plan_all_reduce": plan,
        "meets": plan["forward"] <= 2 * n and plan["backward"] <= 2 * n,
    }


def explain_json(report: GraphReport, model: str) -> dict[str, Any]:
    total = totals(report).to_json()
    del total["layer"]
    return {
        "model": model,
        "tp": report.tp,
        "pp": 1,
        "rank": report.rank,
        "inputs": report.inputs(),
        "flops": "forward, per rank",
        "layers": [l.to_json() for l in report.layers],
        "totals": total,
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
    header = ("layer", "fwd AR", "bwd AR", "fwd AG", "comm MB", "params MB/rank", "GFLOPs/rank")
    rows = [
        (
            name,
            str(l.collectives["all_reduce"]["forward"]),
            str(l.collectives["all_reduce"]["backward"]),
            str(l.collectives["all_gather"]["forward"]),
            f"{sum(sum(d.values()) for d in l.collective_bytes.values()) / mb:.1f}",
            f"{l.param_bytes_per_rank / mb:.1f}",
            f"{l.flops_per_rank / 1e9:.2f}",
        )
        for name, l in [*_runs(report.layers), ("total", totals(report))]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    inputs = ", ".join(f"{k} {v}" for k, v in report.inputs().items())
    m = megatron_minimum(report)
    verdict = "meets it" if m["meets"] else "exceeds it"
    return "\n".join(
        [
            f"{model}, tp={report.tp}, rank {report.rank}; inputs {inputs}",
            "AR all-reduce, AG all-gather; MB = 1e6 bytes; FLOPs are forward, per rank",
            "",
            line(header),
            *(line(r) for r in rows[:-1]),
            "-" * len(line(header)),
            line(rows[-1]),
            "",
            f"Megatron minimum for {m['decoder_layers']} decoder layers: {m['all_reduce']['forward']} forward + "
            f"{m['all_reduce']['backward']} backward all-reduces; this plan: {m['plan_all_reduce']['forward']} + "
            f"{m['plan_all_reduce']['backward']} ({verdict})",
        ]
    )
