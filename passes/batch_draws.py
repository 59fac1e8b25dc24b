"""Draw a pipelined or split graph's random numbers as the unmodified forward draws them
(``autotp.ir.batch_draws``).

In a graph that runs as pipeline chunks, or as one piece of a split step (the trace marked
each draw with the dim that holds the batch's rows, ``meta_keys.BATCH_DRAW_ROWS``), each draw
from the default generator becomes ``batch_draw`` with a ``DrawProgram`` (in the graph's
order, ``meta_keys.BATCH_DRAWS`` on the graph):

* a draw by size (``rand``, ``randn``, ``randint``...) draws that size;
* a fill of a tensor whose values it ignores (``x.uniform_()``, ``x.bernoulli_(0.5)``,
  ``torch.bernoulli(x, p=0.5)``...) fills one of the whole size; an in-place fill copies the
  drawn values into its tensor;
* ``bernoulli(p)`` of a tensor of probabilities is ``rand(p.shape) < p``, and ``normal(mean,
  std)`` of tensors ``randn(shape) * std + mean`` (a zero gradient to each, as torch's): the
  kernels' own formulas (the same numbers on the CPU), so that the draw does not read the
  piece's values.

Dropout has the tp streams (``passes/tp_dropout``). Other draws (``multinomial``, a draw whose
rows the trace could not place) stay as they are, with a warning.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys
from autotp.ir.batch_denominators import DenominatorProgram
from autotp.ir.batch_draws import BATCH_DRAW, BY_FORMULA, BY_SIZE, FILL, FILLS, SIZE, DrawProgram, from_default_generator, register
from autotp.ir.errors import UserInputError, describe
from autotp.ir.layouts import REPLICATE
from autotp.ir.rank_log import warn_once
from autotp.passes.runner import PassContext

log = logging.getLogger(__name__)
aten = torch.ops.aten


def batch_draws(gm: GraphModule, ctx: PassContext) -> GraphModule:
    every = [n for n in gm.graph.nodes if n.op == "call_function" and from_default_generator(n)]
    split = any(meta_keys.BATCH_DRAW_ROWS in n.meta for n in every)
    if not every or (ctx.plan.num_chunks == 1 and not split):
        return gm
    draws = [n for n in every if replayable(n)]
    left = next((n for n in every if n not in draws), None)
    if left is not None:
        warn_once(log, "the forward draws random numbers (%s) that autotp cannot draw for the whole batch at once: each "
                  "pipeline stage and each piece of a split step draws them itself, other numbers than one process's run", describe(left))
    programs = {}
    for node in draws:
        rows, name = node.meta.get(meta_keys.BATCH_DRAW_ROWS, ()), node.name
        if node.target in BY_FORMULA:
            node = _by_formula(gm, node)
        programs[name] = _through_op(gm, node, rows[0] if rows else None)
    gm.meta[meta_keys.BATCH_DRAWS] = list(programs.values())
    denominators = gm.meta.get(meta_keys.BATCH_DENOMINATORS, ())
    gm.meta[meta_keys.BATCH_DENOMINATORS] = tuple(replace(d, core=_core_drawing_pieces(d, programs)) for d in denominators)
    gm.recompile()
    return gm


def _core_drawing_pieces(denominator: DenominatorProgram, programs: dict[str, DrawProgram]) -> GraphModule:
    """A copy of the denominator's core (``autotp.ir.batch_denominators``) whose draws are the
    forward's (``programs``, by the name of the draw they replaced): the core of a piece then
    reads the numbers that piece's forward reads (a random mask's count)."""
    core = GraphModule(denominator.core, copy.deepcopy(denominator.core.graph))
    for node in list(core.graph.nodes):
        if node.op != "call_function" or not from_default_generator(node):
            continue
        program = programs.get(node.name)
        if program is None:
            raise UserInputError(f"the loss divides by a statistic of the batch that reads the random draw {describe(node)}, which autotp "
                                 "cannot draw as the unmodified forward does in a split step; train with dp=1 and num_microbatches=1")  # fmt: skip
        _through_op(core, _by_formula(core, node) if node.target in BY_FORMULA else node, program.rows, program)
    core.recompile()
    return core


def replayable(node: Node) -> bool:
    """Whether ``batch_draws`` draws ``node``'s numbers as the unmodified forward does."""
    rows = node.meta.get(meta_keys.BATCH_DRAW_ROWS, ())
    if rows is None or len(rows) > 1 or node.kwargs.get("generator") is not None:
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.target in BY_SIZE:
        return not any(isinstance(a, Node) for a in node.args) and (not rows or _size_arg(node) is not None)
    if node.target in FILLS:  # a fill of a strided view fills in another order than a new tensor
        filled = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        contiguous = isinstance(filled, torch.Tensor) and filled.is_contiguous()
        return contiguous and not any(isinstance(a, Node) for a in node.args[1:])
    return node.target in BY_FORMULA


def _size_arg(node: Node) -> int | None:
    """The position of the argument that is the drawn size."""
    shape = list(node.meta["val"].shape)
    return next((i for i, a in enumerate(node.args) if isinstance(a, (list, tuple)) and list(a) == shape), None)


def _by_formula(gm: GraphModule, node: Node) -> Node:
    """``bernoulli(p)`` -> ``rand < p``; ``normal(mean, std)`` -> ``randn * std + mean``: the
    new draw node by size, with ``node``'s rows; ``node`` becomes the formula's last op. As
    torch's own ops, the result gives its tensor inputs a zero gradient (not none): the value
    is computed from them detached and selected by ``where`` over each of them."""
    val = node.meta["val"]
    inputs = [a for a in node.args[:2] if isinstance(a, Node)]
    with gm.graph.inserting_before(node):
        drawn = gm.graph.call_function(aten.rand.default if node.target is aten.bernoulli.default else aten.randn.default,
                                       (list(val.shape),), {"dtype": val.dtype, "device": val.device})  # fmt: skip
        drawn.meta.update({k: v for k, v in node.meta.items() if k != meta_keys.ROLE})
        drawn.meta[meta_keys.NEEDS_GRAD] = False
        detached = {a: _emit(gm, node, aten.detach.default, (a,), a.meta["val"]) for a in inputs}
        args = [detached.get(a, a) for a in node.args[:2]]
        if node.target is aten.bernoulli.default:
            below = _emit(gm, node, aten.lt.Tensor, (drawn, args[0]), val.to(torch.bool))
            value = _emit(gm, node, aten._to_copy.default, (below,), val, dtype=val.dtype)
        else:
            value = _emit(gm, node, aten.add.Tensor, (_emit(gm, node, aten.mul.Tensor, (drawn, args[1]), val), args[0]), val)
        true = _emit(gm, node, aten.full.default, ([], True), torch.ones((), dtype=torch.bool, device=val.device), dtype=torch.bool, device=val.device)
        for a in inputs[1:]:
            value = _emit(gm, node, aten.where.self, (true, value, a), val)
    node.target, node.args, node.kwargs = aten.where.self, (true, value, inputs[0]), {}
    return drawn


def _emit(gm: GraphModule, like: Node, target: Any, args: tuple, val: torch.Tensor, **kwargs: Any) -> Node:
    new = gm.graph.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in like.meta.items() if k not in (meta_keys.ROLE, meta_keys.BATCH_DRAW_ROWS)})
    new.meta["val"] = val
    new.meta[meta_keys.LAYOUT] = REPLICATE
    return new


def _through_op(gm: GraphModule, node: Node, rows: int | None, program: DrawProgram | None = None) -> DrawProgram:
    """``node`` draws through ``batch_draw``, of ``program`` (None: a new one); its program."""
    val = node.meta["val"]
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("generator", "memory_format")}
    if node.target in BY_SIZE:
        at = _size_arg(node)
        args = tuple(SIZE if i == at else a for i, a in enumerate(node.args))
    else:
        args = (FILL, *node.args[1:])
    program = program or register(node.name, node.target, args, kwargs, val, rows)
    call = (program.key, list(val.shape), val.dtype, val.device)
    if node.target in FILLS and node.target.overloadpacket.__name__.endswith("_"):  # in place: its tensor takes the drawn values
        with gm.graph.inserting_before(node):
            drawn = _emit(gm, node, BATCH_DRAW, call, val)
        node.target, node.args, node.kwargs = aten.copy_.default, (node.args[0], drawn), {}
    else:
        node.target, node.args, node.kwargs = BATCH_DRAW, call, {}
    node.meta.pop(meta_keys.BATCH_DRAW_ROWS, None)
    return program
