"""Run attention whose explicit mask is provably causal-only as ``is_causal=True``.

HF builds a 4-D mask and hands it to ``aten.scaled_dot_product_attention``, which keeps
the fused (flash) kernels from running. When the mask depends on no graph input and no
parameter or buffer, it is a function of the traced (concrete) shapes alone: the pass
evaluates that subgraph on the CPU and compares the value with the pattern SDPA's
``is_causal=True`` applies (``ones(L, S).tril()``, top-left aligned). Only an exact
match, for every batch and head entry, drops the mask; the mask stays whenever an
``attention_mask`` input, padding or anything else could change it.

A float mask matches when it is 0 on the allowed entries and ``-inf`` or the dtype's
most negative finite value (HF's choice) on the others: either adds a term whose
``exp`` is exactly 0 in softmax, so the result is the same.

Sliding-window masks (Mistral, Gemma 2's local layers) keep their explicit mask unless the
window covers the whole sequence (the mask is then causal-only and matches above):
``aten.scaled_dot_product_attention`` (torch 2.11 to 2.13) takes no window, so no fused SDPA
kernel runs them either way, and autotp emits no flex attention.

Each SDPA node gets ``meta_keys.CAUSAL_MASK``: ``CAUSAL`` when rewritten, else why the
mask stays. The plan's ``causal_attention`` switches the rewrite off; the compiler
records the rewritten nodes in ``plan.causal_attention_nodes``.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from autotp.ir import meta_keys
from autotp.passes.runner import PassContext

log = logging.getLogger(__name__)

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CAUSAL = "causal"
_MASK_ARG, _DROPOUT_ARG, _IS_CAUSAL_ARG = 3, 4, 5
_MAX_EVAL_ELEMENTS = 2**31
_proven: dict[tuple, str] = {}  # subgraph description -> CAUSAL or why not (shapes are concrete)


def causal_attention(gm: GraphModule, ctx: PassContext) -> GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = _arg(node, _MASK_ARG, "attn_mask")
        if not isinstance(mask, Node):
            continue
        verdict = _mask_verdict(node, mask) if ctx.plan.causal_attention else "the plan turns causal_attention off"
        node.meta[meta_keys.CAUSAL_MASK] = verdict
        if verdict != CAUSAL:
            log.debug("%s keeps its attention mask: %s", node.name, verdict)
            continue
        q, k, v = node.args[:3]
        node.args = (q, k, v, None, _arg(node, _DROPOUT_ARG, "dropout_p", 0.0), True)
        node.kwargs = {key: val for key, val in node.kwargs.items() if key not in ("attn_mask", "dropout_p", "is_causal")}
        changed = True
    if changed:
        _erase_dead_pure(gm)
    return gm


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _mask_verdict(node: Node, mask: Node) -> str:
    if _arg(node, _IS_CAUSAL_ARG, "is_causal", False):
        return "is_causal is already set next to a mask"
    subgraph, why = _constant_subgraph(mask)
    if why:
        return why
    q_len, kv_len = node.args[0].meta["val"].shape[-2], node.args[1].meta["val"].shape[-2]
    key = (_describe(subgraph), q_len, kv_len)
    if key not in _proven:
        _proven[key] = _compare(_evaluate(subgraph), q_len, kv_len)
    return _proven[key]


def _constant_subgraph(mask: Node) -> tuple[list[Node], str]:
    """The nodes computing ``mask`` in graph order, or why they are not a constant of the shapes."""
    seen: set[Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return [], f"the mask depends on the input '{n.target}'"
        if n.op == "get_attr":
            return [], f"the mask depends on the parameter or buffer '{n.target}'"
        if n.op != "call_function" or not _pure(n.target):
            return [], f"the mask is computed by {n.format_node()}, which autotp does not evaluate"
        stack.extend(n.all_input_nodes)
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() > _MAX_EVAL_ELEMENTS:
        return [], "the mask is too large to evaluate"
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__), ""


def _pure(target: Any) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def _describe(nodes: list[Node]) -> tuple:
    index = {n: i for i, n in enumerate(nodes)}
    ref = lambda a: ("node", index[a]) if isinstance(a, Node) else repr(a)  # noqa: E731
    return tuple((str(n.target), map_aggregate(n.args, ref), tuple(sorted((k, map_aggregate(v, ref)) for k, v in n.kwargs.items())))
                 for n in nodes)  # fmt: skip


def _evaluate(nodes: list[Node]) -> torch.Tensor:
    values: dict[Node, Any] = {}
    on_cpu = lambda a: values[a] if isinstance(a, Node) else (torch.device("cpu") if isinstance(a, torch.device) else a)  # noqa: E731
    for n in nodes:
        values[n] = n.target(*map_aggregate(n.args, on_cpu), **map_aggregate(n.kwargs, on_cpu))
    return values[nodes[-1]]


def _compare(mask: torch.Tensor, q_len: int, kv_len: int) -> str:
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return f"the mask has shape {tuple(mask.shape)}, not [..., {q_len}, {kv_len}]"
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | blocked).all()):
            return "the float mask adds values other than 0 and the dtype's minimum (a bias)"
        allowed = mask == 0
    else:
        return f"the mask has dtype {mask.dtype}"
    if not bool((allowed == causal).all()):
        return "the mask is a constant of the shapes but not the causal pattern"
    return CAUSAL


def _erase_dead_pure(gm: GraphModule) -> None:
    """Erase the mask builders left without users (pure aten ops only; collectives stay)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users and _pure(node.target):
            gm.graph.erase_node(node)
