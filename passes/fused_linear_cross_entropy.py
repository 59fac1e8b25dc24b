"""Fuse the lm_head ``linear`` into the cross entropy that reads its logits, chunked over tokens.

A loss ``cross_entropy_loss(view(to(linear(h, W))), target)`` (or the vocab-parallel loss
of ``passes/vocab_parallel_cross_entropy``) becomes one ``autotp::linear_cross_entropy``
(``autotp.ir.fused_loss``) that runs the GEMM and the loss
``plan.loss_chunk_tokens`` tokens at a time and computes both gradients in its forward: the
float32 logits over the whole vocabulary (a 128k-152k vocabulary at 8k tokens: 4-5 GB)
are never materialized, and no GEMM is recomputed.

It applies only where nothing else reads the logits: between the ``linear`` (no bias)
and the loss only views, ``alias``, ``contiguous`` and casts to a floating dtype at least as
wide, each read once. A model that returns its logits keeps them (and the unfused loss)
unless the caller reads only the loss (``passes/drop_unread_outputs`` drops the logits
first: ``train_step``). Only the mean and sum reductions, without class weights or label
smoothing, fuse. ``plan.loss_chunk_tokens`` = 0 switches the pass off; the cost model sets it
(``autotp.cost_model.fused_loss``).

With the vocabulary sharded over tp (a column-parallel lm_head), the loss takes the
vocab-parallel loss's range and group; a replicated lm_head (every rank holds the whole
vocabulary) needs no communication.

Where ``plan.fp8_linears`` runs the lm_head weight in FP8 (a user's edit: the planner keeps
it in the model's dtype), the fused op runs its GEMMs in FP8 with that recipe; it has
tensorwise only, so another recipe leaves the lm_head unfused, to ``passes/fp8_linear``.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule, Node

import autotp.ir.fused_loss  # noqa: F401 (registers the implementation of the op this pass inserts)
from autotp.ir import fp8, meta_keys, ops
from autotp.ir.errors import UserInputError
from autotp.passes.fp8_linear import param_of
from autotp.passes.runner import PassContext

log = logging.getLogger(__name__)

aten = torch.ops.aten
_CROSS_ENTROPY = aten.cross_entropy_loss.default
_LINEAR = aten.linear.default
_PASS_THROUGH = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
                           aten.contiguous.default, aten.to.dtype, aten._to_copy.default})  # fmt: skip
_MEAN, _SUM = 1, 2
_DEFAULT_IGNORE_INDEX = -100


def fused_linear_cross_entropy(gm: GraphModule, ctx: PassContext) -> GraphModule:
    chunk = ctx.plan.loss_chunk_tokens
    if chunk <= 0:
        return gm
    for node in list(gm.graph.nodes):
        loss = _loss_args(node, ctx)
        if loss is None:
            continue
        logits, target, vocab_start, vocab_size, ignore_index, reduction, group = loss
        linear, chain = _producer(logits)
        if linear is None:
            log.debug("%s keeps its logits: %s", node.name, chain)
            continue
        hidden, weight = linear.args[0], linear.args[1]
        if not _shapes_fit(hidden, weight, target, logits):
            log.debug("%s keeps its logits: the loss does not read one row per token of %s", node.name, linear.name)
            continue
        recipe = _fp8_recipe(gm, weight, ctx)
        if recipe not in ("", fp8.TENSORWISE):
            log.debug("%s keeps its logits: the fused loss has no %s FP8 GEMMs", node.name, recipe)
            continue
        args = (hidden, weight, target, vocab_start, vocab_size, ignore_index, reduction, chunk, ctx.plan.tp, group, recipe)
        _fuse(gm, node, linear, chain, args)
    return gm


def _fp8_recipe(gm: GraphModule, weight: Node, ctx: PassContext) -> str:
    """The FP8 recipe that ``plan.fp8_linears`` gives the lm_head weight ("": its own dtype)."""
    if not ctx.plan.fp8:
        return ""
    name = param_of(weight, {n for n, _ in gm.named_parameters(remove_duplicate=False)})
    recipe = next((e.recipe for e in ctx.plan.fp8_linears if e.weight == name), "")
    shape = weight.meta["val"].shape
    if recipe and any(d % fp8.CUDA_DIM_MULTIPLE for d in shape):
        raise UserInputError(f"plan.fp8_linears runs {name} in FP8, but its local shape {tuple(shape)} is not a multiple "
                             f"of {fp8.CUDA_DIM_MULTIPLE} (FP8 GEMMs): set its recipe to \"\"")  # fmt: skip
    return recipe


def _loss_args(node: Node, ctx: PassContext) -> tuple | None:
    """(logits, target, vocab_start, vocab_size, ignore_index, reduction, group) of a loss this pass fuses."""
    if node.op != "call_function":
        return None
    if node.target is ops.VOCAB_PARALLEL_CROSS_ENTROPY:
        logits, target, vocab_start, vocab_size, ignore_index, reduction, group = node.args
        return (logits, target, vocab_start, vocab_size, ignore_index, reduction, group) if reduction in (_MEAN, _SUM) else None
    if node.target is not _CROSS_ENTROPY:
        return None
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    args = dict(zip(names, node.args)) | dict(node.kwargs)
    reduction = args.get("reduction", _MEAN)
    if args.get("weight") is not None or args.get("label_smoothing", 0.0) != 0.0 or reduction not in (_MEAN, _SUM):
        return None
    logits = args["self"]
    vocab = logits.meta["val"].shape[-1]
    return logits, args["target"], 0, vocab, args.get("ignore_index", _DEFAULT_IGNORE_INDEX), reduction, ctx.group


def _producer(logits: Node) -> tuple[Node | None, list[Node] | str]:
    """The bias-free ``linear`` the logits come from, and the nodes in between; or why not."""
    chain: list[Node] = []
    node = logits
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        if len(node.users) != 1:
            return None, f"{node.name} is read by {len(node.users)} nodes"
        if node.target in (aten.to.dtype, aten._to_copy.default) and not _widens(node):
            return None, f"{node.name} casts to a narrower or non-float dtype"
        chain.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not _LINEAR or (len(node.args) > 2 and node.args[2] is not None):
        return None, f"the logits come from {node.format_node()}, not a linear without bias"
    if len(node.users) != 1:
        return None, f"{node.name}'s logits are read by {len(node.users)} nodes (an output the caller reads?)"
    return node, chain


def _widens(cast: Node) -> bool:
    before, after = cast.args[0].meta["val"].dtype, cast.meta["val"].dtype
    return after.is_floating_point and before.is_floating_point and after.itemsize >= before.itemsize


def _shapes_fit(hidden: Node, weight: Node, target: Node, logits: Node) -> bool:
    h, w, t, x = (n.meta.get("val") for n in (hidden, weight, target, logits))
    if not all(isinstance(v, torch.Tensor) for v in (h, w, t, x)) or w.dim() != 2:
        return False
    tokens = h.numel() // h.shape[-1]
    return t.numel() == tokens and x.dim() == 2 and x.shape[0] == tokens and h.shape[-1] == w.shape[1]


def _fuse(gm: GraphModule, loss: Node, linear: Node, chain: list[Node], args: tuple) -> None:
    hidden, weight, target = args[:3]
    with gm.graph.inserting_before(loss):
        fused = gm.graph.call_function(ops.LINEAR_CROSS_ENTROPY, args)
    fused.meta.update({k: v for k, v in loss.meta.items() if k not in ("val", "tensor_meta", meta_keys.ROLE)})
    fused.meta["val"] = hidden.meta["val"].new_empty((), dtype=torch.float32)  # the loss, in float32
    result = fused
    if loss.meta["val"].dtype != fused.meta["val"].dtype:
        with gm.graph.inserting_after(fused):
            result = gm.graph.call_function(aten.to.dtype, (fused, loss.meta["val"].dtype))
        result.meta.update(fused.meta)
        result.meta["val"] = loss.meta["val"]
    loss.replace_all_uses_with(result)
    for node in [loss, *chain, linear]:
        gm.graph.erase_node(node)
