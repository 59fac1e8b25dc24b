"""``autotp explain``'s expert-parallel section: how each MoE layer dispatches its rows.

Per layer of ``plan.moe_layers``, read from the compiled graph: the experts a rank holds,
the router, the dispatch mode, the rows a rank sends (its tp slice of tokens x top-k), the
rows it computes with balanced routing (sync-free too: its grouped matmuls skip the
padding) and, sync-free, the capacity per (rank, expert); the all-to-alls
(one per moved tensor each way, forward, and as many backward) with their bytes per rank,
and the host syncs of a dropless dispatch.
"""

from __future__ import annotations

from typing import Any

from torch.fx import GraphModule, Node

from autotp.analysis.shapes import size_int
from autotp.ir.moe_ops import MOE_FROM_EXPERTS, MOE_ROUTE, MOE_TO_EXPERTS, SYNC_FREE
from autotp.ir.plan import ParallelPlan


def _bytes(node: Node, rows: int) -> int:
    val = node.meta.get("val")
    if val is None:
        return 0
    per_row = val.dtype.itemsize
    for s in val.shape[1:]:
        per_row *= size_int(s)
    return rows * per_row


def moe_dispatch_report(gm: GraphModule, plan: ParallelPlan) -> list[dict[str, Any]]:
    """One entry per expert-parallel MoE layer of ``gm`` (empty without any)."""
    out = []
    for layer in plan.moe_layers:
        routes = [n for n in gm.graph.nodes if n.target is MOE_ROUTE and n.args[-1] == layer.name]
        if not routes:
            continue
        route = routes[0]
        rows = route.args[1] if isinstance(route.args[1], int) else layer.rows * plan.tp
        capacity = route.args[3]
        sent = -(-rows // plan.tp)
        moved_rows = layer.num_experts * capacity if capacity else sent  # sync-free moves padded buffers
        consumers = {u for n in route.users for u in n.users}
        to_experts = [n for n in consumers if n.target is MOE_TO_EXPERTS]
        back = [n for n in consumers if n.target is MOE_FROM_EXPERTS]
        moved = sum(_bytes(n.args[0], moved_rows) for n in to_experts)
        returned = sum(_bytes(n, moved_rows) for n in back)
        out.append({
            "layer": layer.name, "form": layer.form, "experts": layer.num_experts, "experts_per_rank": layer.num_experts // plan.ep,
            "ep": plan.ep, "top_k": layer.top_k, "router": layer.router, "dispatch": plan.moe_dispatch,
            "rows_sent_per_rank": sent, "capacity": capacity, "rows_computed_per_rank": sent,
            "all_to_alls_forward": len(to_experts) + len(back), "all_to_alls_backward": len(to_experts) + len(back),
            "bytes_to_experts": moved, "bytes_back": returned,
            "host_syncs_per_step": 0 if plan.moe_dispatch == SYNC_FREE else 2 * (len(to_experts) + len(back)),
        })  # fmt: skip
    return out


def moe_dispatch_table(entries: list[dict[str, Any]]) -> str:
    """The entries as text, one line per layer."""
    first = entries[0]
    mode = first["dispatch"] + (f", capacity {first['capacity']} rows per rank and expert" if first["capacity"] else "")
    lines = [f"expert parallelism: ep={first['ep']}, etp=1, {mode}; bytes per rank and all-to-all (expected for dropless)",
             f"{'layer':<28} {'form':<7} {'experts':>9} {'router':<44} {'rows sent':>9} {'computed':>9} "
             f"{'a2a fwd+bwd':>11} {'MiB out':>8} {'MiB back':>8} {'syncs':>5}"]  # fmt: skip
    for e in entries:
        lines.append(
            f"{e['layer']:<28} {e['form']:<7} {e['experts_per_rank']:>4}/{e['experts']:<4} {e['router']:<44} "
            f"{e['rows_sent_per_rank']:>9} {e['rows_computed_per_rank']:>9} "
            f"{e['all_to_alls_forward'] + e['all_to_alls_backward']:>11} {e['bytes_to_experts'] / 2**20:>8.2f} "
            f"{e['bytes_back'] / 2**20:>8.2f} {e['host_syncs_per_step']:>5}"
        )
    return "\n".join(lines)
