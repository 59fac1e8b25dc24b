"""Weight reparametrizations made of ops the layout rules know.

A weight computed from parameters alone by an op that has no layout rule (weight norm's
``aten._weight_norm``: ``v * g / ‖v‖``, which picks a fused kernel by device) is opaque to
the walk, so the weight and its parameters stay whole. ``decompose_parameter_ops``
replaces each such node by PyTorch's own decomposition of the op (its
``CompositeImplicitAutograd`` kernel, then ``torch._decomp``'s table for the ops that
leads to, again only those without a rule), traced on the node's fake values: the norm
becomes ``linalg_vector_norm``, which the statistic rules split. Ops reading an
activation are left as they are, and so are in-place and random ops.
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
