"""Find a traced loss's data-dependent denominators and make them the whole batch's.

A split step (``train_step`` over dp ranks x microbatches) averages the pieces' losses;
``autotp.ir.batch_denominators`` explains why a denominator that depends on the data (a count
of the labels that are not ignored, a sum of class weights, ``mask.sum()``) must then be
the whole batch's. This module rewrites a split step's traced graph (in place):

* a class loss with ``reduction="mean"`` and class-index targets that hold the batch's rows
  (``cross_entropy``, ``nll_loss``), whose denominator is its count (the targets that are not
  ``ignore_index``, each weighted by its class weight), is rescaled to the whole batch's count;
* so is ``n / d``, where ``d`` is a scalar computed from the inputs alone (no parameter), a
  sum or mean over the rows (its *core*) followed by ``clamp``, casts and scalar arithmetic,
  and ``n`` a sum or mean over the rows too (through sums and scalings).

Where the rows are, ``rows_at`` says (``batch_rows.batch_rows_at``): a loss over one row
(``cross_entropy(logits[i], labels[i])``, averaged over the rows) is not rescaled.

A piece's ``n / d`` becomes ``(n / d) * (d / batch_denominator(d))`` (``_rescaled``): where
every piece counts alike the factor is exactly 1, so the common case computes what the
unsplit graph computes to the bit.

Each rewrite keeps a ``DenominatorProgram`` in ``gm.meta`` (``meta_keys.BATCH_DENOMINATORS``):
the core computed from a piece's inputs, and the ops after it. The rewrite is made only
for the graphs of split steps (``trace(..., split_batch=True)``): elsewhere the graph stays
as the model wrote it. A division by another statistic of the batch (``labels.max()``)
cannot be split: ``unnormalized_division`` names it, and ``batch_rows`` refuses to split
such a forward.

A loss that is not linear in a trained statistic of the rows (a router's load-balancing loss,
a product of per-expert means; a squared mean activation as a sparsity penalty) is computed
by each piece over its own rows, as Megatron and HF's Trainer compute it per microbatch:
``per_piece_statistic`` names it, for the plan (``ParallelPlan.batch_statistics``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Graph, GraphModule, Node
from torch.utils._pytree import tree_flatten, tree_map, tree_structure

from autotp.analysis.shapes import is_float, schema_arg, selecting_mask, shape_of, sized_by_data
from autotp.analysis.statistic_rules import REDUCTIONS, reduced_dims
from autotp.analysis.summed_terms import CASTS, SCALINGS, fixed_scalings, has_reduction, reduction_kind, summed_terms
from autotp.ir import meta_keys
from autotp.ir.batch_denominators import BATCH_DENOMINATOR, MEAN, SUM, DenominatorProgram
from autotp.ir.errors import describe
from autotp.ir.op_facts import is_alias, writes_by_base

aten = torch.ops.aten

_MEAN_REDUCTION = 1
_WEIGHT, _REDUCTION, _IGNORE = 2, 3, 4  # argument positions of the class losses below
_CLASS_LOSSES = frozenset({aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default, aten.nll_loss2d.default})
_REDUCTIONS = {aten.sum.default: SUM, aten.sum.dim_IntList: SUM, aten.count_nonzero.default: SUM,
               aten.count_nonzero.dim_IntList: SUM, aten.mean.default: MEAN, aten.mean.dim: MEAN}  # fmt: skip
_MEANS = frozenset({aten.mean.default, aten.mean.dim})
_SHIFTED = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.clamp.default,
                      aten.clamp_min.default, aten.clamp_max.default})  # fmt: skip
_ZEROS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})
_FULLS = frozenset({aten.full.default, aten.new_full.default, aten.full_like.default})
RowsAt = Callable[[Node], set[int]]


def normalize_loss_denominators(gm: GraphModule, rows_at: RowsAt, doubled: Callable[[], GraphModule]) -> None:
    """Rewrite ``gm`` for a split step (module docstring); ``rows_at(node)``: the dims of
    ``node`` that hold the batch's rows (``batch_rows.batch_rows_at``); ``doubled()``: ``gm``
    traced with the batch doubled."""
    graph = gm.graph
    _selection_means_as_sums(gm, rows_at)
    programs: list[DenominatorProgram] = []
    summed = _sums_scaled_by_pieces(gm, rows_at, doubled)
    if summed is not None:
        programs.append(summed)
    for node, found in _divisions(gm, rows_at):
        if found is None:
            programs.append(_class_loss_rescaled(gm, node))
            continue
        d, core, kind, per_piece = found
        n = node.args[0]
        with graph.inserting_before(node.next):
            nonzero = _add(graph, aten.ne.Scalar, (d, 0), like=node)
            safe = _add(graph, aten.where.ScalarOther, (nonzero, d, 1), like=node)
            quotient = _add(graph, aten.div.Tensor, (n, safe), like=node)
            out = _rescaled(graph, quotient, d, d.name, node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        programs.append(_program(gm, d.name, core, kind, d, per_piece))
    if programs:
        gm.meta[meta_keys.BATCH_DENOMINATORS] = tuple(programs)
    graph.lint()


def summed_loss_terms(gm: GraphModule, rows_at: RowsAt, doubled: Callable[[], GraphModule]) -> list[tuple[Node, Node]]:
    """(term, the node it enters) for each term of a scalar output that sums over the rows
    (``cross_entropy(reduction="sum")``, a sum over a count the caller passes in: HF's
    ``num_items_in_batch``; the whole output, or a term of a sum, ``summed_terms``), scaled by
    nothing that changes with the batch's size: the whole batch's value is the pieces' sum."""
    reads, output = _Reads(gm, rows_at), next(iter(gm.graph.find_nodes(op="output")))
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}

    def is_sum(n: Node, path: tuple[Node, ...]) -> bool:
        val = n.meta.get("val")
        return (isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
                and _numerator_kind(n, reads, rows_at) == SUM and fixed_scalings(n, path, doubled, reads, params))  # fmt: skip

    roots = [a for a in dict.fromkeys(tree_flatten(output.args)[0]) if isinstance(a, Node)]
    return summed_terms(roots, output, is_sum, reads)


def piece_denominators(gm: GraphModule, rows_at: RowsAt) -> list[Node]:
    """The divisions by a statistic of the batch's rows (``mask.sum()``, a mean class loss's count of targets
    that are not ignored) that ``normalize_loss_denominators`` makes the whole batch's, means of the elements
    a mask selects rewritten in ``gm`` as such divisions first."""
    _selection_means_as_sums(gm, rows_at)
    return [node for node, _ in _divisions(gm, rows_at)]


def _sums_scaled_by_pieces(gm: GraphModule, rows_at: RowsAt, doubled: Callable[[], GraphModule]) -> DenominatorProgram | None:
    """Each term of ``summed_loss_terms`` times the number of pieces, ``batch_denominator`` of a 1
    summed over them: the step averages the pieces, and the whole batch's sum is their sum."""
    sums = summed_loss_terms(gm, rows_at, doubled)
    if not sums:
        return None
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    with gm.graph.inserting_before(min((user for _, user in sums), key=position.__getitem__)):
        one = _add(gm.graph, aten.ones.default, ([],), {"dtype": sums[0][0].meta["val"].dtype}, like=sums[0][0])
        pieces = _add(gm.graph, BATCH_DENOMINATOR, (one, one.name), like=sums[0][0])
    for term, user in sums:
        with gm.graph.inserting_before(user):
            user.replace_input_with(term, _add(gm.graph, aten.mul.Tensor, (term, pieces), like=term))
    return _program(gm, one.name, one, SUM, one, False)


def _selection_means_as_sums(gm: GraphModule, rows_at: RowsAt) -> None:
    """``mean`` of the elements a boolean mask of the inputs selects over the rows
    (``loss.masked_select(mask).mean()``, ``loss[mask].mean()``) as their sum over the mask's
    count: a division that ``_divisions`` makes the whole batch's."""
    reads = _Reads(gm, rows_at)
    for node in list(gm.graph.nodes):
        if node.target not in _MEANS or not isinstance(node.args[0], Node) or (node.meta["val"].dim() != 0):
            continue
        selected = node.args[0]
        found = _normalizable_selection(selected, reads, rows_at)
        if found is None:
            continue
        mask, per_true = found
        with gm.graph.inserting_before(node):
            total = _add(gm.graph, aten.sum.default, (selected,), like=node)
            count = _add(gm.graph, aten.sum.default, (mask,), like=node)
            count = _add(gm.graph, aten._to_copy.default, (count,), {"dtype": node.meta["val"].dtype}, like=node)
            count = _add(gm.graph, aten.mul.Tensor, (count, per_true), like=node) if per_true != 1 else count
            mean = _add(gm.graph, aten.div.Tensor, (total, count), like=node)
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)


def _normalizable_selection(selected: Node, reads: _Reads, rows_at: RowsAt) -> tuple[Node, int] | None:
    """``selecting_mask`` of ``selected``, a mask made from the batch (no parameter), both holding its rows."""
    found = selecting_mask(selected)
    if found is None or not rows_at(selected) or not rows_at(found[0]) or reads.of(found[0]) != (True, False):
        return None
    return found


def _rescaled(graph: Graph, value: Node, d: Node, key: str, like: Node) -> Node:
    """``value * (d / batch_denominator(d))``, 0 where ``d`` is 0: the piece's ``n / d`` as
    ``n / whole``. Where the piece's denominator is the whole batch's per piece, the factor is
    exactly 1 and the loss and its gradients are the unsplit graph's to the bit."""
    whole = _add(graph, BATCH_DENOMINATOR, (d, key), like=like)
    factor = _add(graph, aten.div.Tensor, (d, whole), like=like)
    scaled = _add(graph, aten.mul.Tensor, (value, factor), like=like)
    counted = _add(graph, aten.ne.Scalar, (d, 0), like=like)
    return _add(graph, aten.where.ScalarOther, (counted, scaled, 0.0), like=like)


def unnormalized_division(gm: GraphModule, rows_at: RowsAt) -> str:
    """The first division by a statistic of the batch rows that a split step cannot make the
    whole batch's (described; "" if there is none)."""
    reads = _Reads(gm, rows_at)
    for node in gm.graph.nodes:
        division = node.op == "call_function" and node.target is aten.div.Tensor and isinstance(node.args[1], Node)
        if division and reads.is_batch_statistic(node.args[1]) and _normalizable(node, reads, rows_at) is None:
            if _reduces_rows(node.args[1], rows_at):
                return describe(node)
        selected = node.args[0] if node.target in _MEANS else None  # the row walk may not follow rows into a selection
        if isinstance(selected, Node) and sized_by_data(selected) and any(reads.of(a)[0] for a in selected.all_input_nodes):
            if _normalizable_selection(selected, reads, rows_at) is None:
                return f"{describe(node)} (a mean over the elements a selection of the batch keeps, each piece dividing by its own count)"
        weight = _arg(node, _WEIGHT, "weight", None) if node.target in _CLASS_LOSSES else None
        if isinstance(weight, Node) and reads.of(weight)[1] and _reduction(node) == _MEAN_REDUCTION and rows_at(node.args[1]):
            return f"{describe(node)} (its mean over the class weights, which are trained)"
    return ""


_COUNTS = frozenset({aten.histc.default, aten.bincount.default})
_LINEAR = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.neg.default,
                     aten.mul.Scalar, aten.div.Scalar, aten.expand.default, aten.cat.default, aten.stack.default})  # fmt: skip


def per_piece_statistic(gm: GraphModule, rows_at: RowsAt) -> str:
    """The first op through which a reduction over the batch rows of values computed from
    parameters reaches the graph's outputs other than linearly (a product of two such
    statistics, a power, an ``exp``), described with that reduction; "" if there is none. The
    mean of the pieces' values is then not the whole batch's."""
    reads, source = _Reads(gm, rows_at), {}  # a node computed from a trained statistic of the rows -> that statistic
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        tainted = [a for a in node.all_input_nodes if a in source]
        if not tainted:
            if _trained_statistic(node, reads, rows_at):
                source[node] = node
            continue
        if not is_float(node):  # bookkeeping: expert counts read as split sizes
            continue
        if not _linear_in(node, tainted):
            return f"{describe(node)}, a function of {describe(source[tainted[0]])}"
        source[node] = source[tainted[0]]
    return ""


def _trained_statistic(node: Node, reads: _Reads, rows_at: RowsAt) -> bool:
    """A float reduction over dims holding the batch rows (a class loss over its targets' rows,
    a count of values over the rows: an MoE's tokens per expert) of values computed from
    parameters."""
    if node.target in _COUNTS:
        return bool(rows_at(node.args[0])) and reads.of(node.args[0])[1]
    if node.target in _CLASS_LOSSES:
        return _reduction(node) != 0 and bool(rows_at(node.args[1])) and reads.of(node.args[0])[1]
    x = node.args[0] if node.args else None
    if node.target not in REDUCTIONS or not isinstance(x, Node) or not is_float(x) or not reads.of(x)[1]:
        return False
    return bool(set(reduced_dims(node, len(shape_of(x) or ()))) & rows_at(x))


def _linear_in(node: Node, tainted: list[Node]) -> bool:
    """Whether ``node`` is linear in its operands computed from statistics (``tainted``)."""
    if node.target in _LINEAR or node.target in CASTS or node.target in _REDUCTIONS or is_alias(node):
        return True
    if node.target is aten.mul.Tensor:
        return len(tainted) == 1
    if node.target is aten.div.Tensor:
        return tainted == [node.args[0]]
    return False


def _reduces_rows(d: Node, rows_at: RowsAt) -> bool:
    """Whether ``d`` is computed through an op that folds batch rows together (a sum, a max...
    over them), not from one row alone (``mask[i].sum()``)."""
    seen, stack = set(), [d]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        inputs = [a for a in n.all_input_nodes if rows_at(a)]
        if inputs and not rows_at(n) and not is_alias(n):
            return True
        stack.extend(n.all_input_nodes)
    return False


def _is_mean_class_loss(node: Node, reads: _Reads, rows_at: RowsAt) -> bool:
    """A class loss averaged over its counted targets, which hold the batch's rows, and whose
    class weights (if any) are not trained."""
    if node.target not in _CLASS_LOSSES or _reduction(node) != _MEAN_REDUCTION or not _has_class_targets(node):
        return False
    weight = _arg(node, _WEIGHT, "weight", None)
    return bool(rows_at(node.args[1])) and not (isinstance(weight, Node) and reads.of(weight)[1])


def _divisions(gm: GraphModule, rows_at: RowsAt) -> list[tuple[Node, tuple[Node, Node, str, bool] | None]]:
    """The nodes to rewrite: each mean class loss (None), and each division by a statistic of
    the batch with (its denominator, the denominator's core, the core's kind, whether the
    numerator sums over the rows)."""
    reads, found = _Reads(gm, rows_at), []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if _is_mean_class_loss(node, reads, rows_at):
            found.append((node, None))
        elif node.target is aten.div.Tensor and isinstance(node.args[1], Node) and reads.is_batch_statistic(node.args[1]):
            normalizable = _normalizable(node, reads, rows_at)
            if normalizable is not None:
                found.append((node, normalizable))
    return found


def _normalizable(div: Node, reads: _Reads, rows_at: RowsAt) -> tuple[Node, Node, str, bool] | None:
    """``n / d`` whose ``d`` is a sum or mean over the batch rows (through casts and scalar
    arithmetic) and whose ``n`` is one too: (d, its core, the core's kind, whether n sums)."""
    n, d = div.args[0], div.args[1]
    core, kind = _core(d)
    numerator = _numerator_kind(n, reads, rows_at) if isinstance(n, Node) else None
    if core is None or numerator is None or not rows_at(core.args[0]):
        return None
    return d, core, kind, numerator == SUM


class _Reads:
    """Per node of a graph, whether its value reads the batch's inputs (those with a dim, and a
    tensor made from none that holds the batch's rows, ``rows_at``: a mask ``torch.ones(b, n)``)
    and whether it reads a parameter, the in-place writes into it included (``targets[:, :-1] =
    labels[:, 1:]``)."""

    def __init__(self, gm: GraphModule, rows_at: RowsAt) -> None:
        params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        writes = writes_by_base(gm.graph.nodes)
        self._memo: dict[Node, tuple[bool, bool]] = {}
        changed = True
        while changed:  # a write comes after the tensor it writes: again until nothing changes
            changed = False
            for n in gm.graph.nodes:  # in topological order
                inputs = [self._memo.get(a, (False, False)) for a in [*n.all_input_nodes, *writes.get(n, ())]]
                batch_input = (n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
                               or n.op == "call_function" and not n.all_input_nodes and bool(rows_at(n)))  # fmt: skip
                reads = (batch_input or any(i for i, _ in inputs),
                         (n.op == "get_attr" and str(n.target) in params) or any(p for _, p in inputs))  # fmt: skip
                changed |= self._memo.get(n) != reads
                self._memo[n] = reads

    def of(self, node: Node) -> tuple[bool, bool]:
        return self._memo[node]

    def is_batch_statistic(self, node: Node) -> bool:
        """A scalar computed from the batch's inputs and no parameter."""
        val = node.meta.get("val")
        reads_input, reads_param = self.of(node)
        return isinstance(val, torch.Tensor) and val.dim() == 0 and reads_input and not reads_param

    def is_constant(self, arg: Any) -> bool:
        """A Python number, or a tensor computed from no input (a parameter, a buffer)."""
        return not isinstance(arg, Node) or not self.of(arg)[0]


def behind_parameter_free_scalars(gm: GraphModule) -> set[Node]:
    """The nodes from which ``gm`` computes a scalar tensor that reads no parameter (a count a
    loss may divide by, ``mask.sum()``)."""
    reads = _Reads(gm, lambda node: set())
    stack = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 0 and not reads.of(n)[1]]
    behind: set[Node] = set()
    while stack:
        n = stack.pop()
        if n not in behind:
            behind.add(n)
            stack.extend(n.all_input_nodes)
    return behind


def _reduction(node: Node) -> int:
    return node.args[_REDUCTION] if len(node.args) > _REDUCTION else node.kwargs.get("reduction", _MEAN_REDUCTION)


def _arg(node: Node, pos: int, name: str, default: Any) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _has_class_targets(node: Node) -> bool:
    target = node.args[1].meta.get("val") if isinstance(node.args[1], Node) else None
    return isinstance(target, torch.Tensor) and not target.is_floating_point()


def _add(graph: Graph, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *, like: Node) -> Node:
    """A new node of ``target``, with its fake value and ``like``'s source."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake = like.meta["val"].fake_mode if isinstance(like.meta.get("val"), FakeTensor) else None
    values = tree_map(lambda a: a.meta.get("val") if isinstance(a, Node) else a, (args, kwargs))
    if fake is not None:
        with fake:
            node.meta["val"] = target(*values[0], **values[1])
    for k in ("stack_trace", "nn_module_stack"):
        if k in like.meta:
            node.meta[k] = like.meta[k]
    return node


def _class_loss_rescaled(gm: GraphModule, node: Node) -> DenominatorProgram:
    """``loss(mean)`` -> ``loss(mean) * count / batch_denominator(count)``, 0 where nothing is
    counted (the mean is NaN there; its backward writes no gradient for ignored targets)."""
    graph = gm.graph
    target, weight = node.args[1], _arg(node, _WEIGHT, "weight", None)
    ignore = _arg(node, _IGNORE, "ignore_index", -100)
    users = list(node.users)
    with graph.inserting_before(node.next):
        counted = _add(graph, aten.ne.Scalar, (target, ignore), like=node)
        if isinstance(weight, Node):
            safe = _add(graph, aten.where.ScalarOther, (counted, target, 0), like=node)
            picked = _add(graph, aten.index.Tensor, (weight, [safe]), like=node)
            counted = _add(graph, aten.mul.Tensor, (picked, counted), like=node)
        core = _add(graph, aten.sum.default, (counted,), like=node)
        out = _rescaled(graph, node, core, core.name, node)
    for user in users:
        user.replace_input_with(node, out)
    return _program(gm, core.name, core, SUM, core, True)


def _core(d: Node) -> tuple[Node | None, str]:
    """The sum or mean over the batch that ``d`` is computed from by casts and scalar
    arithmetic, and which of the two; (None, "") if there is none."""
    node = d
    while node.target not in _REDUCTIONS:
        if node.target not in CASTS | SCALINGS | _SHIFTED:
            return None, ""
        tensors = list(node.all_input_nodes)
        if len(tensors) != 1 or tensors[0] is not node.args[0]:
            return None, ""
        node = tensors[0]
    val = node.meta.get("val")
    return (node, _REDUCTIONS[node.target]) if isinstance(val, torch.Tensor) and val.dim() == 0 else (None, "")


def _numerator_kind(n: Node, reads: _Reads, rows_at: RowsAt) -> str | None:
    """``SUM`` if ``n`` is a sum over the rows (through scalings by constants, sums and casts),
    ``MEAN`` if a mean; None otherwise."""
    if n.target in _REDUCTIONS or has_reduction(n):
        if not isinstance(n.args[0], Node) or not rows_at(n.args[0]):
            return None
        return _REDUCTIONS[n.target] if n.target in _REDUCTIONS else reduction_kind(n)
    if n.target in CASTS or n.target is aten.neg.default:
        return _numerator_kind(n.args[0], reads, rows_at) if isinstance(n.args[0], Node) else None
    if n.target in SCALINGS:
        a, b = n.args[0], n.args[1]
        if isinstance(a, Node) and reads.is_constant(b):
            return _numerator_kind(a, reads, rows_at)
        if n.target is aten.mul.Tensor and isinstance(b, Node) and reads.is_constant(a):
            return _numerator_kind(b, reads, rows_at)
        return None
    if n.target in (aten.add.Tensor, aten.sub.Tensor) and all(isinstance(a, Node) for a in n.args[:2]):
        kinds = {_numerator_kind(a, reads, rows_at) for a in n.args[:2] if not _is_zero(a)}  # a loop's sum starts from 0
        return kinds.pop() if len(kinds) == 1 else None
    return None


def _is_zero(n: Node) -> bool:
    """A tensor of zeros made from no value (``x.new_zeros(())``, ``torch.zeros(())``)."""
    if n.target in _ZEROS:
        return True
    return n.target in _FULLS and schema_arg(n, "fill_value") == 0


def _program(gm: GraphModule, key: str, core: Node, combine: str, d: Node, per_piece: bool) -> DenominatorProgram:
    return DenominatorProgram(key, _core_program(gm, core), combine, _post(core, d), per_piece)


def _core_program(gm: GraphModule, core: Node) -> GraphModule:
    """``core`` computed from the traced graph's inputs (called like ``gm``, with a piece's
    inputs). The buffers it reads hold the trace's values until the runtime attaches the rank's."""
    writes = writes_by_base(gm.graph.nodes)
    needed: set[Node] = set()
    stack = [core]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend([*n.all_input_nodes, *writes.get(n, ())])
    root, graph, env = nn.Module(), Graph(), {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op == "get_attr":
                _set_attr(root, str(n.target), operator.attrgetter(str(n.target))(gm))
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None:
        graph.output(env[core])
    else:  # called with a piece's keyword inputs, as gm is
        graph.output((env[core],))
        graph._codegen = type(gm.graph._codegen)(info._replace(out_spec=tree_structure(0)))
    return GraphModule(root, graph)


def _post(core: Node, d: Node) -> GraphModule:
    """The ops from ``core`` to ``d``, as a graph of one input (the whole batch's core)."""
    chain = []
    node = d
    while node is not core:
        chain.append(node)
        node = node.args[0]
    graph = Graph()
    env = {core: graph.placeholder("core")}
    for n in reversed(chain):
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[d])
    return GraphModule(nn.Module(), graph)


def _set_attr(root: nn.Module, target: str, value: torch.Tensor) -> None:
    *path, name = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_buffer(name, value)
