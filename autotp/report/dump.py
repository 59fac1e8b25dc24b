"""Writers for ``autotp dump``: annotated code, DOT, SVG (through Graphviz) and JSON.

All of them draw a ``GraphReport``. The code and JSON list every node. DOT and SVG stay
readable for deep models: the embedding, the first decoder layer and the head are
expanded node by node, every other decoder layer is one summary node (its ops,
collectives and FLOPs). Edges into a summarized layer are drawn from the layer before
it only; the inputs every layer shares (mask, rotary tables) are left out there.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.fx import Node

from autotp.ir import meta_keys, ops
from autotp.ir.op_facts import Collective
from autotp.analysis.layers import LayerKey
from autotp.cost_model.graph_costs import GraphReport, LayerReport, NodeReport, layer_order
from autotp.report import DUMP_FORMATS
from autotp.report.graph_report import explain_json, explain_table
from autotp.ir.errors import UserInputError

GRAPHVIZ_MISSING = "SVG needs Graphviz's `dot` program (apt-get install graphviz)"

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
}
_FILL = {
    "all_reduce forward": "#f4a6a6",
    "all_reduce backward": "#f9d29d",
    "all_gather forward": "#a6c8f4",
    "p2p forward": "#d7bde2",
    "Partial": "#fff3b0",
    "Shard": "#c8e6c9",
    "Replicate": "white",
}
_LEGEND = [
    ("all-reduce forward (g, vocab-parallel loss)", _FILL["all_reduce forward"]),
    ("all-reduce backward (f: identity forward)", _FILL["all_reduce backward"]),
    ("all-gather forward", _FILL["all_gather forward"]),
    ("stage boundary (p2p send/recv)", _FILL["p2p forward"]),
    ("sharded", _FILL["Shard"]),
    ("partial (a summand)", _FILL["Partial"]),
    ("replicated", _FILL["Replicate"]),
]


# ---- text pieces ----------------------------------------------------------------------


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def _seconds(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e9:.0f} ns"


def _tensors(r: NodeReport) -> str:
    return ", ".join(f"{_DTYPE_NAMES.get(t.dtype, str(t.dtype))}{list(t.shape)}" for t in r.tensors)


def _target(r: NodeReport) -> str:
    node = r.node
    if node.op == "call_function":
        # autotp's own ops print short (``copy_to_tp(x, 'tp2')``), aten's in full
        return str(node.target) if isinstance(node.target, torch._ops.OpOverload) and not ops.is_autotp_op(node.target) else r.op
    if node.op == "get_attr":
        return f"get_attr {node.target}"
    return node.op


def _arg(a: Any) -> str:
    if isinstance(a, Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v)}" for k, v in a.items()) + "}"
    return repr(a)


def _collective_text(r: NodeReport) -> list[str]:
    return [
        f"{c.kind} {c.direction} {_si(c.bytes, 'B')}{'' if c.kind == 'p2p' else f' over {c.ranks} ranks'}, "
        f"{_seconds(c.time_s)}{', overlapped with its GEMM' if c.overlapped else ''}"
        for c in r.collectives
    ]


def _stage_text(r: NodeReport) -> str:
    if r.stage is None:
        return "repeated by each chunk that reads it"
    return f"stage {r.stage} (chunk {r.chunk})"


def _annotation(r: NodeReport, pipelined: bool) -> str:
    parts = [r.layout] if r.layout else []
    if pipelined:
        parts.append(_stage_text(r))
    parts += _collective_text(r)
    if r.param_bytes:
        parts.append(f"param {_si(r.param_bytes, 'B')}")
    if r.flops or r.bytes:
        parts.append(f"{_si(r.flops, 'FLOP')}, {_si(r.bytes, 'B')} moved, {_seconds(r.time_s)}")
    return " | ".join(parts)


def _layer_title(key: LayerKey) -> str:
    return f"layer {key}" if isinstance(key, int) else str(key)


def _header(report: GraphReport, model: str) -> list[str]:
    inputs = ", ".join(f"{k} {v}" for k, v in report.inputs().items())
    pp = report.plan.pp
    if report.stage is None:
        stages = f"all {pp} pipeline stages" if pp > 1 else "pipeline stage 0 of 1 (pp=1)"
    else:
        stages = f"pipeline stage {report.stage} of {pp} (its nodes, the repeated ones they read, its boundaries)"
    return [
        f"autotp dump: {model}, tp={report.tp}, tp rank {report.rank}, {stages}",
        f"inputs: {inputs}",
        (
            "shapes are this rank's; layouts: Replicate, Partial (a summand an all-reduce completes), "
            "Shard(dim:local/global)"
        ),
        (
            "collectives: all_reduce forward (Megatron g, the vocab-parallel loss), all_reduce backward "
            "(Megatron f: identity forward), all_gather forward, p2p (stage boundary: activation forward, "
            "gradient backward)"
        ),
        f"FLOPs are forward; times are estimates for {report.hardware.name} (autotp.cost_model.flops)",
        "CUDA-graph regions: set when the plan asks for CUDA graphs (autotp explain --cudagraphs lists them)",
    ]


# ---- code -----------------------------------------------------------------------------


def to_code(report: GraphReport, model: str) -> str:
    """Every node as one annotated line, grouped by layer (graph order within a layer),
    after a summary table."""
    lines = [f"# {line}" for line in _header(report, model)]
    lines += ["#"] + [f"# {line}".rstrip() for line in explain_table(report, model).splitlines()]
    layer: LayerKey | None = None
    for r in sorted(report.nodes, key=lambda r: layer_order(r.layer)):
        if r.layer != layer:
            layer = r.layer
            lines += ["", f"# ---- {_layer_title(layer)} ----"]
        node = r.node
        if node.op == "output":
            code = f"return {_arg(node.args[0])}"
        else:
            call = ""
            if node.op == "call_function":
                args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
                call = f"({', '.join(args)})"
            shapes = _tensors(r)
            code = f"{node.name}{': ' + shapes if shapes else ''} = {_target(r)}{call}"
        note = _annotation(r, report.plan.pp > 1)
        lines.append(f"{code}  # {note}" if note else code)
    return "\n".join(lines) + "\n"


# ---- DOT ------------------------------------------------------------------------------


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**attrs: str) -> str:
    return "[" + ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items()) + "]"


def _fill(r: NodeReport) -> str:
    if r.collectives:
        c = r.collectives[0]
        return _FILL[f"{c.kind} {c.direction}"]
    layout = (r.layout or "Replicate").lstrip("(")
    return next((color for prefix, color in _FILL.items() if layout.startswith(prefix)), "white")


def _node_line(r: NodeReport, pipelined: bool) -> str:
    node = r.node
    label = [f"{node.name} = {_target(r)}" if node.op == "call_function" else str(node.target)]
    if r.tensors:
        label.append(_tensors(r) + (f" {r.layout}" if r.layout else ""))
    if pipelined:
        label.append(_stage_text(r))
    label += _collective_text(r)
    if r.param_bytes:
        label.append(f"param {_si(r.param_bytes, 'B')}")
    if r.flops:
        label.append(f"{_si(r.flops, 'FLOP')}, {_seconds(r.time_s)}")
    shape = "ellipse" if node.op in ("get_attr", "placeholder", "output") else "box"
    return f"  n_{node.name} {_attrs(label=chr(10).join(label), fillcolor=_fill(r), shape=shape)};"


def _group_title(layer: LayerReport, pipelined: bool) -> str:
    return _layer_title(layer.layer) + (f" (stage {layer.stage})" if pipelined else "")


def _summary_label(layer: LayerReport, pipelined: bool) -> str:
    ar, ag, p2p = (layer.collectives[kind] for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.P2P))
    comm = sum(sum(d.values()) for d in layer.collective_bytes.values())
    lines = [
        f"{_group_title(layer, pipelined)}, collapsed",
        f"{layer.ops} ops, params {_si(layer.param_bytes_per_rank, 'B')}",
        f"all-reduce {ar['forward']} fwd + {ar['backward']} bwd"
        + (f", all-gather {ag['forward']}" if ag["forward"] else "")
        + (f", stage boundary {p2p['forward']}" if p2p["forward"] else "")
        + f", {_si(comm, 'B')}",
        (
            f"{_si(layer.flops_per_rank, 'FLOP')}, compute {_seconds(layer.compute_time_s)}, "
            f"comm {_seconds(layer.comm_time_s)}"
        ),
    ]
    return "\n".join(lines)


def _expanded_layers(report: GraphReport) -> set[LayerKey]:
    decoder = [l.layer for l in report.layers if isinstance(l.layer, int)]
    return {l.layer for l in report.layers if not isinstance(l.layer, int)} | set(decoder[:1])


def _edges(report: GraphReport, box: dict[Node, str], previous: dict[LayerKey, LayerKey | None]) -> Iterable[str]:
    layer_of = {r.node: r.layer for r in report.nodes}
    seen: dict[tuple[str, str], None] = {}
    for r in report.nodes:
        dst = box[r.node]
        for source in r.node.all_input_nodes:
            src = box.get(source)  # a stage's view lacks what other stages send it
            if src is None or src == dst:
                continue
            if dst.startswith("layer_") and layer_of[source] != previous[r.layer]:
                continue
            seen.setdefault((src, dst), None)
    return (f"  {src} -> {dst};" for src, dst in seen)


def to_dot(report: GraphReport, model: str) -> str:
    expanded = _expanded_layers(report)
    order = [l.layer for l in report.layers]
    previous: dict[LayerKey, LayerKey | None] = {k: (order[i - 1] if i else None) for i, k in enumerate(order)}
    box = {r.node: f"n_{r.node.name}" if r.layer in expanded else f"layer_{r.layer}" for r in report.nodes}
    by_layer: dict[LayerKey, list[NodeReport]] = {}
    for r in report.nodes:
        by_layer.setdefault(r.layer, []).append(r)

    first = next((l.layer for l in report.layers if isinstance(l.layer, int)), None)
    note = [] if first is None else [f"(layer {first} expanded as the example; other decoder layers collapsed)"]
    title = "\n".join(_header(report, model)[:1] + note)
    lines = [
        "digraph autotp {",
        f"  graph {_attrs(label=title, labelloc='t', fontname='Helvetica', newrank='true', rankdir='TB')};",
        f"  node {_attrs(shape='box', style='rounded,filled', fontname='Helvetica', fontsize='10')};",
        f"  edge {_attrs(color='gray40', arrowsize='0.6')};",
    ]
    pipelined = report.plan.pp > 1
    for layer in report.layers:
        key = layer.layer
        if key in expanded:
            comm = sum(sum(d.values()) for d in layer.collective_bytes.values())
            label = (
                f"{_group_title(layer, pipelined)}: {layer.ops} ops, {_si(layer.flops_per_rank, 'FLOP')}, "
                f"comm {_si(comm, 'B')}"
            )
            lines.append(f"  subgraph cluster_{key} {{")
            lines.append(f"    graph {_attrs(label=label, style='rounded', color='gray50')};")
            lines += ["  " + _node_line(r, pipelined) for r in by_layer[key]]
            lines.append("  }")
        else:
            summary = _summary_label(layer, pipelined)
            lines.append(f"  layer_{key} {_attrs(label=summary, shape='box3d', fillcolor='#e0e0e0')};")
    lines += list(_edges(report, box, previous))
    lines.append(f"  subgraph cluster_legend {{\n    graph {_attrs(label='legend', color='gray50')};")
    for i, (text, color) in enumerate(_LEGEND):
        lines.append(f"    legend_{i} {_attrs(label=text, fillcolor=color)};")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def render_svg(dot_path: Path, svg_path: Path) -> bool:
    """Render with Graphviz; False when its ``dot`` program is not installed."""
    dot = shutil.which("dot")
    if dot is None:
        return False
    subprocess.run([dot, "-Tsvg", str(dot_path), "-o", str(svg_path)], check=True, capture_output=True)
    return True


# ---- JSON -----------------------------------------------------------------------------


def _node_json(r: NodeReport) -> dict[str, Any]:
    return {
        "name": r.node.name,
        "op": r.node.op,
        "target": _target(r),
        "layer": r.layer,
        "chunk": r.chunk,
        "stage": r.stage,
        "cudagraph_region": r.node.meta.get(meta_keys.CUDAGRAPH_REGION),
        "shapes": [list(t.shape) for t in r.tensors],
        "dtypes": [_DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in r.tensors],
        "layout": r.layout,
        "inputs": [n.name for n in r.node.all_input_nodes],
        "collectives": [
            {"kind": c.kind, "direction": c.direction, "bytes": c.bytes, "ranks": c.ranks, "est_time_s": c.time_s}
            for c in r.collectives
        ],
        "flops": r.flops,
        "bytes": r.bytes,
        "param_bytes": r.param_bytes,
        "est_time_s": r.time_s,
    }


def to_json(report: GraphReport, model: str) -> dict[str, Any]:
    """The explain summary plus every node; times are estimates for ``report.hardware``."""
    out = explain_json(report, model)
    out["stage"] = report.stage
    out["hardware"] = dataclasses.asdict(report.hardware)
    for entry, layer in zip(out["layers"], report.layers):
        entry["est_compute_s"], entry["est_comm_s"] = layer.compute_time_s, layer.comm_time_s
    out["nodes"] = [_node_json(r) for r in report.nodes]
    return out


# ---- writing --------------------------------------------------------------------------


def write(report: GraphReport, model: str, fmt: str, out_dir: Path, stem: str) -> tuple[Path, str | None]:
    """Write ``stem.<ext>`` into ``out_dir``; returns the path and a warning, if any.

    ``svg`` also leaves the DOT file beside it; without Graphviz only the DOT is written.
    """
    if fmt not in DUMP_FORMATS:
        raise UserInputError(f"unknown dump format {fmt!r}; use one of {', '.join(DUMP_FORMATS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if fmt == "code":
        path = out_dir / f"{stem}.py"
        path.write_text(to_code(report, model))
    elif fmt == "json":
        path = out_dir / f"{stem}.json"
        path.write_text(json.dumps(to_json(report, model), indent=1) + "\n")
    else:
        path = out_dir / f"{stem}.dot"
        path.write_text(to_dot(report, model))
        if fmt == "svg":
            svg = out_dir / f"{stem}.svg"
            if not render_svg(path, svg):
                return path, f"{GRAPHVIZ_MISSING}; wrote DOT instead: {path}"
            path = svg
    return path, None
