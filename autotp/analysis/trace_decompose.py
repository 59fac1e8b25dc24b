"""Weight reparametrizations made of ops the layout rules know.

A weight computed from parameters alone by an op that has no layout rule (weight norm's
``aten._weight_norm``: ``v * g / ‖v‖``, which picks a fused kernel by device) is opaque to
the walk, so the weight and its parameters stay whole. ``decompose_parameter_ops``
replaces each such node by PyTorch's own decomposition of the op (its
``CompositeImplicitAutograd`` kernel, then ``torch._decomp``'s table for the ops that
leads to, again only those without a rule), traced on the node's fake values: the norm
becomes ``linalg_vector_norm``, which the statistic rules split. Ops reading an
activation are left as they are, and so are in-place and random ops.

``draw_by_size`` rewrites a random draw shaped like a tensor (``randn_like(x)``) into the
draw of x's size (``randn(x.shape)``), which reads no tensor: the same numbers, from the
same generator calls, and a draw the walk can keep whole while x is split
(``value_rules.random_draw``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autotp.analysis.op_rules import rule_for

log = logging.getLogger(__name__)
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


def _decomposition(target: Any) -> Callable[..., Any] | None:
    """PyTorch's decomposition of an op that has no layout rule (None: keep the op)."""
    if not isinstance(target, torch._ops.OpOverload) or rule_for(target) is not None:
        return None
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return None
    if target in decomposition_table:
        return decomposition_table[target]
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target.decompose
    return None


aten = torch.ops.aten
# a draw shaped like its first argument -> (the same draw by size, its arguments before the size)
_DRAWS_BY_SIZE: dict[Any, tuple[Any, int]] = {
    aten.rand_like.default: (aten.rand.default, 0),
    aten.randn_like.default: (aten.randn.default, 0),
    aten.randint_like.default: (aten.randint.default, 1),
    aten.randint_like.low_dtype: (aten.randint.low, 2),
}


def draw_by_size(gm: GraphModule) -> None:
    """Replace ``rand_like``/``randn_like``/``randint_like`` of a tensor of static shape by the
    same draw at that tensor's size, dtype and device (in place), where the draw fills a
    contiguous tensor. One into a tensor of other strides (``preserve_format`` of a transposed
    dense tensor) fills it in memory order, other numbers than by size: kept."""
    for node in list(gm.graph.nodes):
        by_size = _DRAWS_BY_SIZE.get(node.target) if node.op == "call_function" else None
        like = node.args[0].meta.get("val") if by_size is not None else None
        if not isinstance(like, torch.Tensor) or not all(isinstance(d, int) for d in like.shape):
            continue
        if not _fills_in_order(like, node.kwargs.get("memory_format", torch.preserve_format)):
            continue
        target, before = by_size
        kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
        kwargs = {"dtype": like.dtype, "device": like.device, **{k: v for k, v in kwargs.items() if v is not None}}
        with gm.graph.inserting_before(node):
            drawn = gm.graph.call_function(target, (*node.args[1 : 1 + before], list(like.shape)), kwargs)
        drawn.meta.update(node.meta)
        node.replace_all_uses_with(drawn)
        gm.graph.erase_node(node)


def _fills_in_order(like: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """Whether ``empty_like(like, memory_format)`` is contiguous, so a draw into it gives the
    numbers of the draw by size (a split or sliced view is, a transposed dense one is not)."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return like.is_contiguous()
    with mode:
        return torch.empty_like(like, memory_format=memory_format).is_contiguous()


def _of_parameters_alone(node: Node, params: set[str]) -> bool:
    """Whether every tensor ``node`` reads is a parameter (no activation, no buffer)."""
    inputs = node.all_input_nodes
    return bool(inputs) and all(a.op == "get_attr" and str(a.target) in params for a in inputs)


def decompose_parameter_ops(gm: GraphModule) -> None:
    """Replace each op of parameters alone that has no rule by its decomposition (in place)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    table = {op: fn for op, fn in decomposition_table.items() if _decomposition(op) is not None}
    for node in list(gm.graph.nodes):
        decompose = _decomposition(node.target) if node.op == "call_function" else None
        if decompose is None or not _of_parameters_alone(node, params):
            continue
        leaves, spec = tree_flatten((node.args, node.kwargs))
        at = [i for i, a in enumerate(leaves) if isinstance(a, Node)]

        def run(*tensors: torch.Tensor) -> Any:
            values = list(leaves)
            for i, t in zip(at, tensors):
                values[i] = t
            args, kwargs = tree_unflatten(values, spec)
            return decompose(*args, **kwargs)

        fakes = [leaves[i].meta["val"] for i in at]
        with fakes[0].fake_mode:
            body = make_fx(run, decomposition_table=table)(*fakes)
        log.debug("decomposed %s (%s) of parameters alone", node.name, node.target)
        _inline(gm, node, body, [leaves[i] for i in at])
    gm.graph.lint()


def _inline(gm: GraphModule, node: Node, body: GraphModule, inputs: list[Node]) -> None:
    graph = gm.graph
    env: dict[Node, Any] = {}
    placeholders = iter(inputs)
    result: Any = None
    with graph.inserting_before(node):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = torch.fx.map_arg(n.args[0], lambda a: env[a])
            else:
                assert n.op == "call_function", f"a decomposition holds a {n.op} node"
                new = graph.node_copy(n, lambda a: env[a])
                new.meta.update({k: node.meta[k] for k in _KEPT_META if k in node.meta})
                env[n] = new
    if isinstance(result, (list, tuple)) and isinstance(node.meta.get("val"), (list, tuple)):
        for user in list(node.users):
            assert user.target is operator.getitem
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result[0] if isinstance(result, (list, tuple)) else result)
    graph.erase_node(node)
