"""What a rank's graph would capture as CUDA graphs: regions, declined regions, blockers.

Reads the candidates of ``find_cudagraph_candidates`` and the regions the plan chose
(``plan.cudagraph_regions``; compile with ``cuda_graphs=True``).
``explain_cudagraphs`` is ``autotp explain MODEL --cudagraphs [--format json]``:

* ``cudagraph_regions``: every captured region with its ``id``, pipeline ``chunk``,
  ``nodes`` (op nodes in it), ``first``/``last`` node, ``layers`` (first and last
  layer it touches: a decoder layer index, ``embedding`` or ``head``), ``launches``
  (kernel launches per forward+backward that one replay replaces, the cost model's
  estimate), ``static_bytes`` (inputs, outputs and intermediates one capture pins) and
  ``slots`` (captures its pipeline stage holds, one per microbatch in flight);
* ``declined_regions``: candidates the cost model did not take, with its ``reason``;
* ``blockers``: every node a CUDA graph cannot capture, with ``kind``, ``reason``,
  ``node`` and ``source`` (the model's source line; library paths are shortened to
  the part after ``site-packages/``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from torch.fx import GraphModule, Node
from transformers.utils import logging as hf_logging

from autotp import presets
from autotp.ir import meta_keys
from autotp.api import compile_rank
from autotp.cost_model.cudagraphs import choose_regions, region_stats
from autotp.analysis.local_shapes import local_tensors
from autotp.cost_model.graph_costs import assign_layers, layer_order
from autotp.passes.find_cudagraph_candidates import Blocker, candidate_regions, region_slots
from autotp.ir.plan import ParallelPlan
from autotp.ir.errors import UserInputError


_SITE_PACKAGES = re.compile(r'File "[^"]*site-packages/')
_IMPL_NAMES = {"torch": "torch.cuda.make_graphed_callables", "transformer_engine": "transformer_engine.pytorch.make_graphed_callables"}


def _short(source: str) -> str:
    return _SITE_PACKAGES.sub('File "', source)


def _region(nodes: list[Node], layers: dict[Node, Any], plan: ParallelPlan) -> dict[str, Any]:
    stats = region_stats(nodes, lambda n: local_tensors(n, plan.tp), plan.tp, plan.hardware, region_slots(nodes, plan))
    keys = sorted({layers[n] for n in nodes}, key=layer_order)
    return {
        "id": nodes[0].meta[meta_keys.CUDAGRAPH_CANDIDATE],
        "chunk": nodes[0].meta.get(meta_keys.CHUNK) or 0,
        "nodes": stats.nodes,
        "first": nodes[0].name,
        "last": nodes[-1].name,
        "layers": [keys[0], keys[-1]],
        "launches": stats.launches,
        "static_bytes": stats.static_bytes,
        "slots": stats.slots,
    }


def cudagraph_report(gm: GraphModule, plan: ParallelPlan) -> dict[str, Any]:
    """Regions, declined regions and blockers of a graph compiled with ``cuda_graphs``."""
    if not plan.cudagraphs:
        raise UserInputError("the plan does not ask for CUDA graphs, so no node carries regions; compile with cuda_graphs=True")
    layers = assign_layers(gm)
    regions, declined = [], []
    candidates = candidate_regions(gm)
    for index, (nodes, verdict) in enumerate(zip(candidates, choose_regions(candidates, plan))):
        entry = _region(nodes, layers, plan)
        if index in plan.cudagraph_regions:
            regions.append(entry)
        else:
            declined.append({**entry, "reason": verdict or "not chosen by the plan"})
    blockers = []
    for node in gm.graph.nodes:
        blocker = node.meta.get(meta_keys.CUDAGRAPH_BLOCKER)
        if isinstance(blocker, Blocker):
            blockers.append({**blocker.to_json(), "source": _short(blocker.source), "layer": layers[node]})
    return {"cudagraph_impl": plan.cudagraph_impl, "cudagraph_regions": regions, "declined_regions": declined, "blockers": blockers}


def _table(report: dict[str, Any], title: str) -> str:
    mb = 1e6
    lines = [title, f"captured by {_IMPL_NAMES.get(report['cudagraph_impl'], report['cudagraph_impl'])}", ""]
    header = ("region", "chunk", "nodes", "first .. last", "layers", "launches", "static MB", "slots")
    rows = [
        (str(r["id"]), str(r["chunk"]), str(r["nodes"]), f"{r['first']} .. {r['last']}",
         f"{r['layers'][0]}-{r['layers'][1]}" if r["layers"][0] != r["layers"][1] else str(r["layers"][0]),
         str(r["launches"]), f"{r['static_bytes'] / mb:.1f}", str(r["slots"]))
        for r in report["cudagraph_regions"]
    ]  # fmt: skip
    if rows:
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) if i in (0, 3, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    else:
        lines.append("no regions")
    for d in report["declined_regions"]:
        lines.append(f"declined {d['id']} ({d['nodes']} nodes, {d['first']} .. {d['last']}): {d['reason']}")
    lines += ["", f"blockers: {len(report['blockers'])}"]
    for b in report["blockers"]:
        where = f"  [{b['source']}]" if b["source"] else ""
        lines.append(f"  {b['node']} (layer {b['layer']}, {b['kind']}): {b['reason']}{where}")
    return "\n".join(lines)


def explain_cudagraphs(
    model_name_or_path: str,
    tp: int,
    pp: int,
    rank: int,
    fmt: str,
    *,
    batch: int = 1,
    seq: int | None = None,
    dtype: str = "bfloat16",
    labels: bool = True,
) -> str:
    """``autotp explain MODEL --cudagraphs``: compile tp rank ``rank`` offline (model on
    meta, as a GPU rank on NCCL) and list its regions and blockers, as a table or JSON."""
    if fmt not in ("table", "json"):
        raise UserInputError(f"format {fmt!r} is not one of table, json")
    if dtype not in presets.DTYPES:
        raise UserInputError(f"dtype {dtype!r} is not one of {', '.join(presets.DTYPES)}")
    hf_logging.set_verbosity_error()
    model = presets.build_model(model_name_or_path, device="meta", dtype=presets.DTYPES[dtype])
    inputs = presets.inspection_inputs(model, batch, seq, labels)
    compiled = compile_rank(model, tp=tp, rank=rank, pp=pp, example_inputs=inputs, cuda_graphs=True)
    report = cudagraph_report(compiled.graph, compiled.plan)
    head = {"model": model_name_or_path, "tp": tp, "pp": pp, "rank": rank, "dtype": dtype,
            "inputs": {k: list(v.shape) for k, v in inputs.items()}}  # fmt: skip
    if fmt == "json":
        return json.dumps({**head, **report}, indent=2)
    shapes = ", ".join(f"{k} {v}" for k, v in head["inputs"].items())
    return _table(report, f"{model_name_or_path}, tp={tp}, pp={pp}, rank {rank}, {dtype}; inputs {shapes}")
