"""Views and tables of a ``GraphReport`` (``autotp.cost_model.graph_costs``): one pipeline
stage, totals, Megatron's minimum, and ``autotp explain``'s JSON and table.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from autotp.cost_model.graph_costs import DIRECTIONS, GraphReport, LayerReport, by_layer, layer_report
from autotp.ir import meta_keys, ops
from autotp.ir.op_facts import Collective, Direction
from autotp.ir.plan import RECOMPUTE_MEMORY, RECOMPUTE_MODEL, RECOMPUTE_USER, Gathered, KeptWhole, ParallelPlan, UnreadParam
from autotp.ir.errors import UserInputError

def stage_view(report: GraphReport, stage: int) -> GraphReport:
    """What pipeline stage ``stage`` runs: its nodes, the repeated nodes they read, and the
    boundaries it sends across."""
    assert report.stage is None, "stage_view takes the whole rank's report"
    plan = report.plan
    if not 0 <= stage < plan.pp:
        raise UserInputError(f"stage {stage} is outside pp={plan.pp}; pick 0..{plan.pp - 1}")
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
    return GraphReport(report.graph, plan, report.rank, report.hardware, tuple(nodes), by_layer(plan, nodes, stage), stage)


# ---- explain: totals, the Megatron comparison, JSON and table ------------------------


def totals(report: GraphReport) -> LayerReport:
    return layer_report("total", report.stage, list(report.nodes))


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
    plan = {d: sum(l.collectives[Collective.ALL_REDUCE][d] for l in decoder) for d in DIRECTIONS}
    return {
        "decoder_layers": len(decoder),
        Collective.ALL_REDUCE: {d: minimum for d in DIRECTIONS},
        "plan_all_reduce": plan,
        "meets": all(plan[d] <= minimum for d in DIRECTIONS),
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
    # Sequence parallelism turns all-reduces into reduce-scatters and all-gathers, each the other's backward.
    split = report.plan.sequence_parallel or any(l.collectives["reduce_scatter"]["forward"] + l.collectives["reduce_scatter"]["backward"] for l in report.layers)

    def cells(name: str, l: LayerReport) -> tuple[str, ...]:
        stage = ("" if l.stage is None else str(l.stage),) if pipelined else ()
        p2p = (str(l.collectives[Collective.P2P][Direction.FORWARD]),) if pipelined else ()
        return (
            name,
            *stage,
            str(l.collectives[Collective.ALL_REDUCE][Direction.FORWARD]),
            str(l.collectives[Collective.ALL_REDUCE][Direction.BACKWARD]),
            str(l.collectives[Collective.ALL_GATHER][Direction.FORWARD]),
            *((str(l.collectives[Collective.ALL_GATHER][Direction.BACKWARD]),
               str(l.collectives[Collective.REDUCE_SCATTER][Direction.FORWARD]),
               str(l.collectives[Collective.REDUCE_SCATTER][Direction.BACKWARD])) if split else ()),
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
        *(("bwd AG", "fwd RS", "bwd RS") if split else ()),
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
    legend = "AR all-reduce, AG all-gather" + (", RS reduce-scatter" if split else "") + (", p2p stage-boundary sends" if pipelined else "")
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
            *([] if m["meets"] else _first_layer_all_reduces(report)),
            *_replicated_lines(report.plan.kept_whole),
            *_gathered_lines(report.plan.gathered),
            *_unread_lines(report.plan.unread),
            *_recompute_lines(report.plan),
        ]
    )


def _first_layer_all_reduces(report: GraphReport) -> list[str]:
    """Why a plan exceeds Megatron's minimum: every all-reduce of the first decoder layer,
    with the op it serves and that op's source line."""
    layers = [l.layer for l in report.layers if isinstance(l.layer, int)]
    if not layers:
        return []
    lines = [f"all-reduces of decoder layer {layers[0]} (Megatron needs 2 forward, 2 backward):"]
    for r in report.nodes:
        if r.layer != layers[0]:
            continue
        for c in r.collectives:
            if c.kind != Collective.ALL_REDUCE:
                continue
            served = r.node.all_input_nodes[0] if c.direction == Direction.FORWARD else next(iter(r.node.users), r.node)
            where = served.meta.get("stack_trace", "").strip().splitlines()
            source = where[-2].strip() if len(where) >= 2 else ""
            relation = "sums the partial output of" if c.direction == Direction.FORWARD else "sums the grads of the input of"
            read = r.node.all_input_nodes[0]
            if c.direction == Direction.BACKWARD and read.op == "get_attr":  # a weight read by rank-local tokens or blocks
                relation = f"sums the grads of parameter '{read.target}' read by"
            lines.append(f"  {c.direction:8s} {r.node.name}: {relation} '{served.name}' ({served.target}) {source}")
            if meta_keys.KEPT_ALL_REDUCE in r.node.meta:
                lines.append(f"           kept under sequence parallelism: {r.node.meta[meta_keys.KEPT_ALL_REDUCE]}")
    return ["", *lines]


def _replicated_lines(kept: tuple[KeptWhole, ...], limit: int = 10) -> list[str]:
    """The parameters that the planner kept whole, each with why (the node that blocked its sharding)."""
    blocked = [f"{k.name}; {k.detail or k.reason}" for k in kept]
    if not blocked:
        return []
    more = [f"  ... and {len(blocked) - limit} more"] if len(blocked) > limit else []
    return ["", f"replicated parameters ({len(blocked)}), with the node that blocked sharding:"] + [
        f"  {b}" for b in blocked[:limit]
    ] + more


def _gathered_lines(gathered: tuple[Gathered, ...], limit: int = 10) -> list[str]:
    """The split activations the planner gathers whole, each with the op that needs it whole."""
    if not gathered:
        return []
    more = [f"  ... and {len(gathered) - limit} more"] if len(gathered) > limit else []
    return ["", f"activations gathered whole ({len(gathered)}), with the op that needs them whole:"] + [
        f"  {g.tensor} at {g.node} ({g.op}): {g.bytes} bytes, all-gather {g.comm_s * 1e6:.1f} us" for g in gathered[:limit]
    ] + more


def _unread_lines(unread: tuple[UnreadParam, ...], limit: int = 5) -> list[str]:
    """The parameters the traced forward never reads (stored split, no grad), largest first."""
    if not unread:
        return []
    total = sum(u.bytes for u in unread)
    largest = ", ".join(u.name for u in sorted(unread, key=lambda u: -u.bytes)[:limit])
    return ["", f"parameters the traced forward never reads ({len(unread)}, {total / 2**20:.1f} MiB): stored split, no grad "
            f"(plan.unread); largest: {largest}"]


_RECOMPUTE_WHY = {RECOMPUTE_MODEL: "the model checkpoints them itself", RECOMPUTE_MEMORY: "the planner's, so the plan fits",
                  RECOMPUTE_USER: "asked for"}


def _recompute_lines(plan: ParallelPlan) -> list[str]:
    """The decoder layers whose activations the backward recomputes (plan.recompute_layers), and why."""
    if not plan.recompute_layers:
        return []
    return ["", f"recomputed in the backward: decoder layers {_spans(plan.recompute_layers)} "
            f"({_RECOMPUTE_WHY[plan.recompute_reason]}; plan.recompute_layers)"]


def _spans(indices: tuple[int, ...]) -> str:
    """``0-3, 6``: runs of consecutive indices."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
