"""Run the GEMMs that the plan puts in FP8 as ``autotp::fp8_linear`` (``plan.fp8``).

A *GEMM site* is a matmul whose second operand is a 2-d parameter (read directly or
through Megatron's *f*): ``linear(x, W[, b])`` (W stored [N, K]), ``mm(x, W)``,
``addmm(b, x, W)`` and ``matmul(x, W)`` (W stored [K, N], GPT-2's Conv1D; the op reads
``t(W)``). The planner (``autotp.cost_model.fp8``) lists every site's weight in
``plan.fp8_linears`` with its recipe, or why it stays in the model's dtype; this pass
only rewrites.

The sites that read the same input with the same recipe become one op (q/k/v, gate/up):
x is quantized once and each output is a ``getitem``. Each op gets, from the layouts,
which dims the tp group splits: x's token dims and K, and each weight's N (its amaxes
are max-reduced over the group there, ``autotp.ir.fp8``). With ``plan.fp8_all_gather``
a sequence-parallel ``all_gather`` read only by such sites is absorbed: the op takes
this rank's tokens, quantizes them with the group's scale and all-gathers the FP8 bytes
(half of bf16's); its backward reduce-scatters the input gradient as the all-gather's did.

A delayed recipe's op reads and updates an amax history (``autotp.ir.fp8_delayed``): each op
gets its own, a float32 buffer of the graph named after its first weight
(``fp8_delayed.history_name``; zeros, ``plan.fp8_amax_history`` rows) on the rank's device,
passed as the op's ``history``; the runtime shares it between signatures.

Runs after ``sequence_parallel`` (which recognises plain linears) and before
``tp_overlap``, which fuses only the plain GEMMs left: the FP8 ops' collectives are not
overlapped with their GEMMs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from autotp.ir import fp8, fp8_delayed, meta_keys, ops
from autotp.ir.layouts import Layout
from autotp.ir.op_facts import CollectiveTag
from autotp.passes.runner import PassContext
from autotp.passes.tp_overlap import transposed_weight

aten = torch.ops.aten
FP8_OPS: dict[str, torch._ops.OpOverload] = {"torch": ops.FP8_LINEAR}
"""``plan.fp8_backend`` -> the op that runs its GEMMs (same schema as ``autotp::fp8_linear``).
A backend (Transformer Engine's GEMMs, say) registers its op here."""


@dataclass(frozen=True)
class GemmSite:
    """A matmul of activation ``x`` by a 2-d parameter: ``weight`` is the node read (the
    parameter or its *f*), ``param`` its name, ``kn`` whether it is stored [K, N]."""

    node: Node
    x: Node
    weight: Node
    param: str
    kn: bool
    bias: Node | None


def param_of(node: object, params: set[str]) -> str | None:
    """The parameter ``node`` reads, directly or through *f*."""
    if isinstance(node, Node) and node.op == "call_function" and node.target is ops.COPY_TO_TP:
        node = node.args[0]
    if isinstance(node, Node) and node.op == "get_attr" and str(node.target) in params:
        return str(node.target)
    return None


def _two_d(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 2


def gemm_site(node: Node, params: set[str]) -> GemmSite | None:
    """``node`` as a GEMM site, or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        x, w, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        kn = False
    elif node.target in (aten.mm.default, aten.matmul.default):
        (x, w), bias, kn = node.args, None, True
    elif node.target is aten.addmm.default and not node.kwargs and len(node.args) == 3:
        bias, x, w = node.args
        kn = True
    else:
        return None
    name = param_of(w, params)
    if name is None or not isinstance(x, Node) or not _two_d(w) or x is w:
        return None
    return GemmSite(node, x, w, name, kn, bias if isinstance(bias, Node) else None)


def gemm_sites(gm: GraphModule) -> list[GemmSite]:
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    return [s for n in gm.graph.nodes if (s := gemm_site(n, params)) is not None]


def split_bits(x: Node) -> int:
    """``fp8_linear``'s ``x_split``: whether the group splits x's token dims, its last dim."""
    lay, val = x.meta.get(meta_keys.LAYOUT), x.meta.get("val")
    if not isinstance(lay, Layout) or not isinstance(val, torch.Tensor):
        return 0
    last = val.dim() - 1
    dims = {d % val.dim() for d, _ in lay.dims}
    return (fp8.X_ROWS if dims - {last} else 0) | (fp8.X_K if last in dims else 0)


def n_split(site: GemmSite) -> bool:
    """Whether the group splits the weight's output features."""
    lay = site.weight.meta.get(meta_keys.LAYOUT)
    return isinstance(lay, Layout) and lay.var_at(1 if site.kn else 0) is not None


def fp8_linear(gm: GraphModule, ctx: PassContext) -> GraphModule:
    plan = ctx.plan
    if not plan.fp8:
        return gm
    target = FP8_OPS.get(plan.fp8_backend)
    if target is None:
        raise AssertionError(f"plan.fp8_backend {plan.fp8_backend!r} has no op; registered: {sorted(FP8_OPS)}")
    recipes = {e.weight: e.recipe for e in plan.fp8_linears if e.recipe}
    groups: dict[tuple[Node, str], list[GemmSite]] = {}
    for site in gemm_sites(gm):
        if site.param in recipes:
            groups.setdefault((site.x, recipes[site.param]), []).append(site)
    for (x, recipe), sites in groups.items():
        history = _new_history(gm, sites, ctx) if fp8.RECIPES[recipe].delayed else None
        _rewrite(gm.graph, x, recipe, sites, ctx, target, history)
    return gm


def _new_history(gm: GraphModule, sites: list[GemmSite], ctx: PassContext) -> str:
    name = fp8_delayed.history_name(sites[0].param)
    gm.register_buffer(name, fp8_delayed.new_history(ctx.plan.fp8_amax_history, len(sites), ctx.device))
    return name


def _absorbed_gather(x: Node, sites: list[GemmSite], ctx: PassContext, recipe: str) -> Node | None:
    """The sequence all-gather ``x`` when its FP8 form replaces it: every user is one of ``sites``."""
    if not ctx.plan.fp8_all_gather or recipe != fp8.TENSORWISE:
        return None
    if x.op != "call_function" or x.target is not ops.ALL_GATHER or x.meta.get(meta_keys.COLLECTIVE) != CollectiveTag.SEQUENCE_ALL_GATHER:
        return None
    return x if set(x.users) == {s.node for s in sites} else None


def _rewrite(graph: Graph, x: Node, recipe: str, sites: list[GemmSite], ctx: PassContext, target: object,
             history: str | None) -> None:  # fmt: skip
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((s.node for s in sites), key=order.__getitem__)
    gather = _absorbed_gather(x, sites, ctx, recipe)
    source, bits, gather_args = x, split_bits(x), (-1, 1)
    if gather is not None:
        source, dim, group_size, _ = gather.args
        bits, gather_args = split_bits(source) | fp8.X_ROWS, (dim, group_size)
    group = ctx.group if ctx.plan.tp > 1 else ""
    with graph.inserting_before(first):
        weights = [_as_nk(graph, s) for s in sites]
        args = (source, weights, [s.bias for s in sites], recipe, bits, [int(n_split(s)) for s in sites],
                *gather_args, group)  # fmt: skip
        if history is not None:
            args += (graph.get_attr(history),)
        fused = graph.call_function(target, args, name="fp8_linear")
    fused.meta.update({k: v for k, v in first.meta.items() if k not in ("val", meta_keys.LAYOUT)})
    fused.meta["val"] = [s.node.meta["val"] for s in sites]
    fused.meta[meta_keys.LAYOUT] = tuple(s.node.meta.get(meta_keys.LAYOUT) for s in sites)
    fused.meta[meta_keys.NEEDS_GRAD] = any(s.node.meta.get(meta_keys.NEEDS_GRAD) for s in sites)
    if gather is not None:
        fused.meta[meta_keys.COLLECTIVE] = CollectiveTag.FP8_ALL_GATHER
        fused.meta[meta_keys.COLLECTIVE_RANKS] = gather.meta[meta_keys.COLLECTIVE_RANKS]
    for i, s in enumerate(sites):
        with graph.inserting_before(s.node):
            out = graph.call_function(operator.getitem, (fused, i))
        out.meta.update(s.node.meta)
        s.node.replace_all_uses_with(out)
        graph.erase_node(s.node)
    if gather is not None:
        graph.erase_node(gather)


def _as_nk(graph: Graph, site: GemmSite) -> Node:
    """The weight as [N, K]: itself for a linear, ``t(W)`` for a [K, N] weight."""
    return transposed_weight(graph, site.weight) if site.kn else site.weight
