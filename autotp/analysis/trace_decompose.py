"""Weight reparametrizations made of ops the layout rules know.

A weight computed from parameters alone by an op that has no layout rule (weight norm's
``aten._weight_norm``: ``v * g / ‖v‖``, which picks a fused kernel by device) is opaque to
the walk, so the weight and its parameters stay whole. ``decompose_parameter_ops``
replaces each such node by PyTorch's own decomposition of the op (its
``CompositeImplicitAutograd`` kernel, then ``torch._decomp``'s table for the ops that
leads to, again only those without a rule), traced on the node's fake values: the norm
becomes ``linalg_vector_norm``, which the statistic rules split. Likewise:

* an op without a rule that reads a parameter and an activation (an RNN cell:
  ``aten.gru_cell``, ``lstm_cell``), where its decomposition is a short formula (at most
  ``MAX_DECOMPOSED_NODES`` ops; a whole ``lstm`` unrolls over the sequence and stays one op);
* a training-mode ``batch_norm`` of a weight computed from parameters (timm's weight
  standardization, ``F.batch_norm(w.reshape(1, out, -1), None, None, training=True)``),
  which its rule leaves to the fallback.

A composite that writes in place to its own temporaries (``gru_cell`` to the pieces of its
``unsafe_split``) gets the out-of-place forms of those ops; one whose write another read
would see, one reaching ``prims`` ops (no autograd), and random ops are left as they are,
and so is an op whose inputs other than parameters are themselves computed from parameters
(a LoKr delta ``kron(w1, a @ b)``: small factors, left whole and read through slices).

``decompose_simple_composites`` replaces an op with neither a rule nor a DTensor strategy whose
``CompositeImplicitAutograd`` kernel only moves data (``movedim``, ``swapaxes``, ``narrow``,
``tensor_split``, the ``*stack`` family) or is one op with a rule under another overload
(``var_mean.dim``) by that kernel's ops: what eager runs for it, through ops the rules know.
Composites that compute (``cdist``, ``cosine_similarity``) stay one op, for the rules that know
them by name.

``shape_by_size`` rewrites ``x.view_as(other)`` and ``reshape_as`` into the view to other's static
shape: a read of other's shape alone, which the walk then does not tie to other's split. (``expand_as``
stays: a broadcast dim taking other's split is what lets a whole operand meet a split one.)

``squeeze_traced_dims`` makes each ``squeeze`` name the dims the trace squeezed, so that a rank
whose piece of another dim is of size 1 keeps it.

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

from autotp.analysis.dtensor_rules import has_strategy
from autotp.analysis.op_rules import rule_for
from autotp.analysis.statistic_rules import batch_statistics

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


# an op that reads its second argument for its shape alone -> the same op given that shape
_SHAPED_LIKE: dict[Any, Any] = {
    aten.view_as.default: aten.view.default,
    aten.reshape_as.default: aten.reshape.default,
}


def shape_by_size(gm: GraphModule) -> None:
    """Replace ``x.view_as(other)`` and ``reshape_as`` of an ``other`` of static shape by the
    reshape to that shape (in place): ``other`` is read for its shape alone, so its
    split then constrains nothing (x-transformers' GRU gating reshapes its split output like a
    whole input)."""
    for node in list(gm.graph.nodes):
        target = _SHAPED_LIKE.get(node.target) if node.op == "call_function" else None
        like = node.args[1].meta.get("val") if target is not None and isinstance(node.args[1], Node) else None
        if not isinstance(like, torch.Tensor) or not all(isinstance(d, int) for d in like.shape):
            continue
        with gm.graph.inserting_before(node):
            shaped = gm.graph.call_function(target, (node.args[0], list(like.shape)))
        shaped.meta.update(node.meta)
        node.replace_all_uses_with(shaped)
        gm.graph.erase_node(node)


_SQUEEZES = frozenset({aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims})


def squeeze_traced_dims(gm: GraphModule) -> None:
    """Make every ``squeeze`` name the dims it squeezed in the trace (``squeeze.dims``): a rank's piece
    of a split dim, or a microbatch's rows, may be of size 1 where the traced tensor's dim was not
    (Informer's ``matmul(...).squeeze()`` over 4 heads at tp=4), and a squeeze of all size-1 dims, or of
    a dim named but not of size 1, would drop it on that rank alone."""
    for node in gm.graph.nodes:
        src = node.args[0].meta.get("val") if node.op == "call_function" and node.target in _SQUEEZES else None
        if not isinstance(src, torch.Tensor) or not all(isinstance(size, int) for size in src.shape):
            continue  # a size known only at run time is squeezed as the op finds it there
        named = node.args[1] if len(node.args) > 1 else range(src.dim())
        named = named if isinstance(named, (list, tuple, range)) else [named]
        dims = sorted({d % max(src.dim(), 1) for d in named if src.dim() and src.shape[d] == 1})
        if node.target is not aten.squeeze.default and len(dims) == len(named):  # names only size-1 dims: as it is
            continue
        node.target, node.args = aten.squeeze.dims, (node.args[0], dims)


def _fills_in_order(like: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """Whether ``empty_like(like, memory_format)`` is contiguous, so a draw into it gives the
    numbers of the draw by size (a split or sliced view is, a transposed dense one is not)."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return like.is_contiguous()
    with mode:
        return torch.empty_like(like, memory_format=memory_format).is_contiguous()


MAX_DECOMPOSED_NODES = 64


def _of_parameters(gm: GraphModule) -> tuple[set[Node], set[Node]]:
    """The parameters' nodes, and the nodes computed from parameters alone (those included)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    direct = {n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in params}
    derived = set(direct)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in derived for a in node.all_input_nodes):
            if not (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags):
                derived.add(node)
    return direct, derived


def _parameters_read(node: Node, parameters: set[Node]) -> int:
    """How many of the tensors ``node`` reads are in ``parameters``; -1 when it reads nothing else."""
    inputs = node.all_input_nodes
    read = sum(a in parameters for a in inputs)
    return -1 if inputs and read == len(inputs) else read


def decompose_parameter_ops(gm: GraphModule) -> None:
    """Replace each op reading parameters that has no rule by its decomposition (in place)."""
    direct, derived = _of_parameters(gm)
    table = {op: fn for op, fn in decomposition_table.items() if _decomposition(op) is not None}
    for node in list(gm.graph.nodes):
        decompose = _decomposition(node.target) if node.op == "call_function" else None
        read = _parameters_read(node, direct) if decompose is not None else 0
        if read > 0 and _parameters_read(node, derived) == -1:
            continue  # a weight computed from parameters and what they make: left whole, read through slices
        if node.op == "call_function" and batch_statistics(node) and _parameters_read(node, derived) == -1:
            decompose, read = node.target.decompose, -1  # a weight standardized by batch_norm (timm's StdConv)
        if read == 0:
            continue
        body = _traced(node, decompose, table)
        if body is None or _prims(body) or not _out_of_place(body) or read > 0 and sum(n.op == "call_function" for n in body.graph.nodes) > MAX_DECOMPOSED_NODES:
            continue
        log.debug("decomposed %s (%s), which reads parameters", node.name, node.target)
        _inline(gm, node, body, _tensor_args(node))
    gm.graph.lint()


_MOVES_DATA = frozenset({aten.cat.default, aten.stack.default, aten.clone.default, aten.repeat.default, aten.contiguous.default})


def decompose_simple_composites(gm: GraphModule) -> None:
    """Replace each op without a rule or a DTensor strategy whose decomposition only moves data
    (``movedim``, ``swapaxes``, ``narrow``, ``tensor_split``, ``hstack``: views, ``cat``, ``stack``,
    copies) or computes with one op that has a rule (``var_mean.dim`` is ``var_mean.correction``)
    by that decomposition (in place): the same values, through ops the rules know."""
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or rule_for(target) is not None or has_strategy(target):
            continue
        if target._schema.is_mutable or not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
            continue
        body = _traced(node, target.decompose, {})
        if body is None:
            continue
        computing = [n for n in body.graph.nodes if n.op == "call_function" and not _aliases_input(n) and n.target not in _MOVES_DATA]
        if not computing or len(computing) == 1 and rule_for(computing[0].target) is not None:
            log.debug("decomposed %s (%s) into ops with rules", node.name, target)
            _inline(gm, node, body, _tensor_args(node))
    gm.graph.lint()


def _tensor_args(node: Node) -> list[Node]:
    """The nodes among ``node``'s arguments in order, repeats kept (``hstack([h, h])``)."""
    return [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, Node)]


def _traced(node: Node, decompose: Callable[..., Any], table: dict[Any, Callable[..., Any]]) -> GraphModule | None:
    """``decompose`` run on ``node``'s arguments, traced on their fake values (None where a
    tensor argument has none)."""
    leaves, spec = tree_flatten((node.args, node.kwargs))
    at = [i for i, a in enumerate(leaves) if isinstance(a, Node)]

    def run(*tensors: torch.Tensor) -> Any:
        values = list(leaves)
        for i, t in zip(at, tensors):
            values[i] = t
        args, kwargs = tree_unflatten(values, spec)
        return decompose(*args, **kwargs)

    fakes = [leaves[i].meta.get("val") for i in at]
    if not fakes or not all(isinstance(f, torch.Tensor) for f in fakes):
        return None
    with fakes[0].fake_mode:
        return make_fx(run, decomposition_table=table)(*fakes)


def _prims(body: GraphModule) -> bool:
    """Whether a decomposition reached ``prims`` ops (PyTorch's references: no autograd)."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "prims" for n in body.graph.nodes)


def _aliases_input(node: Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument (a view, a piece of
    a split, or an in-place op's result)."""
    if node.target is operator.getitem:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)


def _view_chain(node: Any) -> list[tuple[Node, int | None]]:
    """(node, piece index) from ``node`` up through the views it was taken from."""
    chain: list[tuple[Node, int | None]] = []
    while isinstance(node, Node):
        piece = node.args[1] if node.target is operator.getitem else None
        chain.append((node, piece))
        if node.op != "call_function" or not _aliases_input(node):
            break
        node = node.args[0]
    return chain


def _may_overlap(a: Node, b: Node) -> bool:
    """Whether ``a`` and ``b`` may share memory: the same base, unless they are different
    pieces of one split."""
    chain_a, chain_b = _view_chain(a), _view_chain(b)
    if chain_a[-1][0] is not chain_b[-1][0]:
        return False
    pieces_a = {n.args[0]: i for n, i in chain_a if i is not None}
    return not any(i is not None and n.args[0] in pieces_a and pieces_a[n.args[0]] != i for n, i in chain_b)


def _out_of_place(body: GraphModule) -> bool:
    """Turn a decomposition's in-place ops into their out-of-place forms (in place), where each
    writes a temporary of its own that nothing reads afterwards (a composite such as
    ``gru_cell`` writes to the pieces of its own ``unsafe_split``); False if one does not."""
    nodes = list(body.graph.nodes)
    for i, node in enumerate(nodes):
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
            continue
        written = node.args[0]
        if _view_chain(written)[-1][0].op != "call_function":
            return False  # writes an input of the op
        later = {a for n in nodes[i + 1 :] for a in n.all_input_nodes}
        if any(_may_overlap(a, written) for a in later if all(n is not node for n, _ in _view_chain(a))):
            return False  # the old value is read after the write
        packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1].rstrip("_"), None)
        functional = getattr(packet, target._overloadname, None)
        if functional is None or functional._schema.is_mutable:
            return False
        node.target = functional
    for node in nodes:  # with nothing written, an unsafe split is a split
        if node.target is torch.ops.aten.unsafe_split.Tensor:
            node.target = torch.ops.aten.split.Tensor
    body.recompile()
    return True


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
