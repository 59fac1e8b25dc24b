"""Run causal attention on the kernel the plan names (``plan.attention_backend``).

``aten.scaled_dot_product_attention`` picks its kernel at run time, in a fixed order (flash,
then memory-efficient, then cuDNN since torch 2.5.1). On Hopper, cuDNN's fused attention runs
causal attention markedly faster than FlashAttention-2 (PyTorch 2.5 release notes: up to 75%;
``benchmarks/bench_single_gpu.py --sdpa`` measures it on the device), so the cost model may
choose ``"cudnn"`` (``autotp.cost_model.attention``), and this pass then calls
``aten._scaled_dot_product_cudnn_attention`` (which has its own backward) directly.

Only calls that cuDNN runs get rewritten: no explicit mask (``causal_attention`` turns
proven-causal masks into ``is_causal`` first), no dropout, 16-bit inputs, a head dim that is a
multiple of 8 up to 128, on a CUDA device. Grouped-query attention (``enable_gqa``) repeats
each key/value head for its queries first (``repeat_interleave`` over the heads, as SDPA does
with ``enable_gqa``; the repeat factor from this rank's local head counts). Every other call
keeps the default dispatch. ``""`` (the default) rewrites nothing.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autotp.analysis.local_shapes import local_shape
from autotp.ir import meta_keys
from autotp.ir.plan import ATTENTION_CUDNN
from autotp.passes.runner import PassContext

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CUDNN_SDPA = aten._scaled_dot_product_cudnn_attention.default
_MAX_HEAD_DIM = 128


def attention_backend(gm: GraphModule, ctx: PassContext) -> GraphModule:
    if ctx.plan.attention_backend != ATTENTION_CUDNN or ctx.device.type != "cuda":
        return gm
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is SDPA and cudnn_runs(node):
            _rewrite(gm, node, ctx.plan.tp)
    return gm


def cudnn_runs(node: Node) -> bool:
    """Whether cuDNN's attention runs this SDPA call unchanged."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args)) | dict(node.kwargs)
    if args.get("attn_mask") is not None or args.get("dropout_p", 0.0) != 0.0:
        return False
    q, k, v = (args[n].meta.get("val") for n in names[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    heads_fit = q.shape[1] == k.shape[1] == v.shape[1] or (args.get("enable_gqa", False) and k.shape[1] == v.shape[1])
    head_dims = {q.shape[-1], k.shape[-1], v.shape[-1]}
    fits = all(d % 8 == 0 and d <= _MAX_HEAD_DIM for d in head_dims)
    return heads_fit and fits and all(t.dtype in (torch.bfloat16, torch.float16) for t in (q, k, v))


def _rewrite(gm: GraphModule, node: Node, tp: int) -> None:
    q, k, v = node.args[:3]
    is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    groups = local_shape(q, tp)[1] // local_shape(k, tp)[1]
    if groups > 1:
        k, v = (_repeat_heads(gm, node, x, groups) for x in (k, v))
    args, kwargs = (q, k, v, None, True, 0.0, is_causal, False), {"scale": node.kwargs.get("scale")}
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(CUDNN_SDPA, args, kwargs)
        out = gm.graph.call_function(operator.getitem, (fused, 0))
    fused.meta.update({key: val for key, val in node.meta.items() if key not in ("val", "tensor_meta", meta_keys.LAYOUT)})
    vals = [a.meta["val"] for a in (q, k, v)]
    with detect_fake_mode(vals) or contextlib.nullcontext():
        fused.meta["val"] = CUDNN_SDPA(*vals, *args[3:], **kwargs)
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _repeat_heads(gm: GraphModule, before: Node, x: Node, groups: int) -> Node:
    """Each of ``x``'s heads (dim 1) ``groups`` times in a row, as SDPA's ``enable_gqa`` repeats them."""
    with gm.graph.inserting_before(before):
        out = gm.graph.call_function(aten.repeat_interleave.self_int, (x, groups), {"dim": 1})
    out.meta.update({key: val for key, val in x.meta.items() if key not in ("val", "tensor_meta")})
    out.meta["val"] = before.args[0].meta["val"].new_empty((*x.meta["val"].shape[:1], before.args[0].meta["val"].shape[1],
                                                            *x.meta["val"].shape[2:]))  # fmt: skip
    return out
