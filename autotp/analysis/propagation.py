"""Propagate tensor-parallel layouts from the parameters through the aten ops of a graph.

The engine (this module) walks the traced graph once, in order, and gives every node an output
``Layout``. Parameters are the only sources of sharding:

* In *planning* mode a parameter is undecided until its first use decides it: a matmul
  whose activation is replicated makes its weight column-parallel (a fresh ``DimVar`` on
  the out features); a matmul whose activation is sharded on the contracted dim makes
  it row-parallel (output partial); an embedding makes its table vocab-parallel; a
  pointwise op with a sharded operand makes a bias or norm weight follow that sharding;
  any other use replicates it. ``policy`` may forbid sharding a parameter.
* In *fixed* mode (``plan`` given) every parameter's layout is read from the plan.

An op with no rule in ``op_rules`` takes the sharding strategy DTensor registers for it
(``dtensor_rules``) when that keeps its inputs where they are, and is opaque otherwise
(its inputs must be replicated).

Ops that cannot keep a sharded input sharded (a softmax over the router's experts, an
unbind of a sharded dim...) record a ``ShardingConflict`` naming the parameters that
caused it and the reshape choices behind it; the conflicting output is treated as
replicated so the walk goes on and finds every conflict in one sweep. The planner
(``cost_model.tensor_parallel``) then walks again with other reshape choices, or stops
sharding those parameters. In fixed mode a conflict is an error: the plan does not fit.

Partial tensors stay partial through ops that are linear in them (add of two partials,
mul/div by a replicated tensor, views, sums, row gathers) as long as each partial value
has one user; any other consumer, and every user of a shared partial value, gets the
partial input listed in ``reduce_inputs`` (an all-reduce goes there).

Where things live: the per-op rules are looked up in ``op_rules.RULES``; which use
makes a parameter column/row/vocab-parallel is ``sharding_policy``; where partial sums
are all-reduced is ``partials``; the result types are ``propagation_result``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autotp.analysis.dtensor_rules import dtensor_rule
from autotp.analysis.op_rules import rule_for
from autotp.analysis.padded_dims import check_padding, pad, padded_inputs
from autotp.analysis.partials import PartialSums
from autotp.analysis.propagation_result import ParamDecision, ParamView, Propagation, ShardPolicy, Sliced, StatisticPolicy, Tiled
from autotp.analysis.shapes import is_float, replicated_like
from autotp.ir.errors import UserInputError, describe
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, Layout, ShardingConflict, fixed_var, follow, select_range, shard, tile, unify
from autotp.ir.op_facts import is_alias, mutated_base
from autotp.ir.plan import ParallelPlan


class Walker:
    """One walk over a graph: the layouts so far and the parameter decisions. Rules
    (``op_rules``) read and decide through it.

    ``avoid`` maps a reshape node's name to output factors it must not shard
    (``reshape_rules._split``); ``statistics`` decides whether a reduction or norm over a
    sharded dim may use a tp-reduced statistic at a node (always, with a plan); ``hints``
    decides parameters at their read, before their first use (``Propagation.hints``: the
    parameters of a weight reparametrization, split as the matmul reading the weight asks);
    ``gathers`` names nodes whose split value every reader gets whole (all-gathered:
    ``Propagation.gathered``; with a plan, its ``gathered`` entries); ``padded`` names parameters
    whose split is padded where they decide it (``padded_dims``).
    """

    def __init__(
        self,
        gm: GraphModule,
        tp: int,
        plan: ParallelPlan | None,
        policy: ShardPolicy | None,
        avoid: dict[str, frozenset[int]] | None = None,
        statistics: StatisticPolicy | None = None,
        hints: dict[str, tuple[str, int]] | None = None,
        gathers: frozenset[str] = frozenset(),
        padded: frozenset[str] = frozenset(),
    ) -> None:
        self.gm = gm
        self.padded = padded
        self.gathers = frozenset(g.tensor for g in plan.gathered) if plan is not None else gathers
        self.hints = hints or {}
        self.tp = tp
        self.plan = plan
        self.policy = policy or (lambda name, kind, shape: True)
        self.avoid = avoid or {}
        self.allow_statistic: StatisticPolicy = statistics if plan is None and statistics is not None else (lambda node: True)
        self.out = Propagation(tp)
        self.partials = PartialSums(self.out.layouts, self.out.reduce_inputs)
        self.params: dict[str, torch.nn.Parameter] = dict(gm.named_parameters(remove_duplicate=False))
        self.fixed_vars: dict[str, Layout] = {}
        self.current: Node | None = None
        self.input_readers: dict[Node, bool] = {}  # ``shapes.reads_input``'s answers for this graph
        self._tiles: dict[tuple[str, int], DimVar] = {}
        self._reaching: set[Node] | None = None  # nodes with a path to the outputs through no detach
        if plan is not None:
            for pl in plan.params:
                self.fixed_vars[pl.name] = shard({pl.dim: fixed_var(pl.sharding, pl.name)})

    # ---- layout access -------------------------------------------------------------

    def get(self, arg: Any) -> Layout | ParamView:
        """Layout of an argument; decided parameters are returned concrete."""
        if not isinstance(arg, Node):
            return REPLICATE
        lay = self.out.layouts.get(arg, REPLICATE)
        if arg.name in self.gathers and isinstance(lay, Layout) and lay.dims:
            self.out.gathered[arg] = lay
            return REPLICATE
        if lay == PARTIAL and self.current is not None and self.partials.reduce_at_source(arg):
            self.reduce_first(self.current, [arg])
            return REPLICATE
        if isinstance(lay, ParamView):
            dec = self.out.decisions.get(lay.name)
            if dec is None:
                return lay
            if dec.dim is None:
                return REPLICATE
            dims = {i: dec.var for i, d in enumerate(lay.dim_map) if d == dec.dim}
            for i, d in enumerate(lay.dim_map):
                if isinstance(d, Tiled) and d.dim == dec.dim:
                    dims[i] = self._tiled_param(lay.name, d.count, dec.var, lay.name)
                if isinstance(d, Sliced) and d.dim == dec.dim:
                    dims[i] = self._sliced_part(d, dec.var)
                if isinstance(d, tuple) and d[0] == dec.dim:  # the outer factor: the blocks the parameter dim follows
                    outer = dec.var.find().follows
                    if outer is None or outer.find().size * d[1] != dec.var.find().size:
                        raise ShardingConflict(f"{lay.name} is split where a reshape cuts it into factors", dec.var.find().origins)
                    dims[i] = outer
            return shard(dims)
        return lay

    def concrete(self, arg: Any, node: Node) -> Layout:
        """Layout of an argument, replicating an undecided parameter."""
        lay = self.get(arg)
        if isinstance(lay, ParamView):
            self.decide(lay.name, ParamDecision("replicate"), node)
            return REPLICATE
        return lay

    def summed(self, arg: Any, node: Node) -> Layout:
        """Layout of an input that ``node`` needs as a whole value: a partial one is
        all-reduced first (and read as replicated)."""
        lay = self.concrete(arg, node)
        self.reduce_first(node, [arg])
        return REPLICATE if lay.partial else lay

    def decide(self, name: str, dec: ParamDecision, node: Node) -> None:
        prev = self.out.decisions.get(name)
        if prev is not None:
            raise AssertionError(f"{name} decided twice at {node.name}")
        dec.node = dec.node or node
        self.out.decisions[name] = dec

    def param_view_shard(self, view: ParamView, view_dim: int, var: DimVar, kind: str, node: Node) -> None:
        """Decide ``view``'s parameter: sharded by ``var`` on the dim behind ``view_dim``."""
        pdim = view.dim_map[view_dim]
        if pdim is None:
            raise ShardingConflict(f"{describe(node)}: cannot shard a broadcast dim of {view.name}", var.find().origins)
        if isinstance(pdim, tuple):  # the outer factor of a parameter dim: the dim is split in its blocks
            pdim, whole = pdim[0], DimVar(self.params[view.name].shape[pdim[0]], var.find().origins)
            follow(whole, var, describe(node))
            var = whole
        elif isinstance(pdim, Tiled):  # parameter dims merged: the inner one is split, once per outer element
            whole = DimVar(self.params[view.name].shape[pdim.dim], var.find().origins)
            unify(self._tiled_param(view.name, pdim.count, whole, describe(node)), var, describe(node))
            pdim, var = pdim.dim, whole
        elif isinstance(pdim, Sliced):  # a range of the parameter dim: one segment of it, split as ``var``
            whole = DimVar(self.params[view.name].shape[pdim.dim], var.find().origins)
            unify(self._sliced_part(pdim, whole), var, describe(node))
            pdim, var = pdim.dim, whole
        elif view.name in self.padded:
            pad(var)
        self.decide(view.name, ParamDecision(kind, pdim, var), node)

    def _sliced_part(self, sliced: Sliced, whole: DimVar) -> DimVar:
        """The segment of a parameter dim split by ``whole`` that ``sliced`` keeps; its slice node
        then reads the rank's part of it (whichever use decided the parameter)."""
        part = select_range(whole, sliced.start, sliced.end, describe(sliced.node))
        self.out.slice_fixups[sliced.node] = (whole, part, sliced.start)
        return part

    def _tiled_param(self, name: str, count: int, var: DimVar, where: str) -> DimVar:
        """The one tiled dim (``layouts.tile``) of parameter ``name`` split by ``var``, merged with ``count`` outer elements."""
        key = (name, count)
        if key not in self._tiles:
            self._tiles[key] = tile(var, count, where)
        return self._tiles[key]

    def allowed(self, name: str, kind: str) -> bool:
        return self.policy(name, kind, tuple(self.params[name].shape))

    def reduce_first(self, node: Node, args: list[Any]) -> None:
        """Mark every partial input of ``node`` for an all-reduce."""
        self.partials.reduce_first(node, args)

    # ---- walk ----------------------------------------------------------------------

    def run(self) -> Propagation:
        for node in self.gm.graph.nodes:
            self.current = node
            try:
                lay = self.visit(node)
                self.check_splits(node, lay)
            except ShardingConflict as c:
                c.node = node
                if not c.retries:  # a reshape's choice of factor behind an input may be to blame
                    c.retries = self.input_choices(node)
                if self.plan is not None:
                    raise UserInputError(f"the plan does not fit the graph at {describe(node)}: {c}") from c
                self.out.conflicts.append(c.with_traceback(None))  # its frames would hold the caller's model until gc
                lay = replicated_like(node)
            self.out.layouts[node] = lay
            self.out.needs_grad[node] = self.grad_of(node)
            if self.out.needs_grad[node] and mutated_base(node) is not None:
                self._written_with_grad(mutated_base(node))
        if self.plan is None:
            for name in self.params:
                self.out.decisions.setdefault(name, ParamDecision("replicate"))
        return self.out

    def check_splits(self, node: Node, lay: Any) -> None:
        """A rank holds one piece of a tensor per mesh axis: split on two dims over one axis it would hold
        one block of a grid whose other blocks no rank holds."""
        for l in lay if isinstance(lay, tuple) else (lay,):
            if not isinstance(l, Layout):
                continue
            by_axis: dict[Any, list[int]] = {}
            for d, v in l.dims:
                by_axis.setdefault(v.find().axis, []).append(d)
            for axis, dims in by_axis.items():
                if len(dims) > 1:
                    raise ShardingConflict(f"{describe(node)}: its output would be split on dims {dims} over the {axis} axis", l.origins())

    def input_choices(self, node: Node) -> frozenset[tuple[str, int]]:
        """The reshape choices (``DimVar.made_by``) behind the sharded inputs of ``node``."""
        found = set()
        for a in node.all_input_nodes:
            lay = self.out.layouts.get(a)
            for l in lay if isinstance(lay, tuple) else (lay,):
                if isinstance(l, Layout):
                    found |= {v.find().made_by for _, v in l.dims if v.find().made_by is not None}
        return frozenset(found)

    def _written_with_grad(self, base: Node) -> None:
        """An in-place write of a value that needs a gradient into ``base`` (FNO's
        ``out_ft[..., :modes] = einsum(...)`` into ``zeros``): autograd rebases ``base`` and
        every view of it onto the write, so those read later need a gradient too."""
        aliases = [base]
        while aliases:
            n = aliases.pop()
            self.out.needs_grad[n] = True
            aliases.extend(u for u in n.users if u in self.out.needs_grad and is_alias(u) and u.args[0] is n and not self.out.needs_grad[u])

    def grad_reaches_loss(self, node: Node) -> bool:
        """Whether ``node`` takes a gradient that reaches an output: it needs one and some path from
        it to the outputs passes no ``detach`` (a straight-through estimator detaches what it adds)."""
        if self._reaching is None:
            self._reaching = set()
            for n in reversed(self.gm.graph.nodes):
                if n.op == "output" or any(u in self._reaching and u.target is not torch.ops.aten.detach.default for u in n.users):
                    self._reaching.add(n)
        return self.grad_of(node) and node in self._reaching

    def grad_of(self, node: Node) -> bool:
        if node.op == "get_attr":
            p = self.params.get(str(node.target))
            return p is not None and p.requires_grad
        if node.op != "call_function" or not (is_float(node) or isinstance(node.meta.get("val"), (tuple, list))):
            return False
        if node.target is torch.ops.aten.detach.default:
            return False
        if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and node.args[0] is False:
            return False
        return any(self.out.needs_grad.get(n, False) for n in node.all_input_nodes)

    def visit(self, node: Node) -> Any:
        if node.op == "placeholder":
            return REPLICATE
        if node.op == "get_attr":
            name = str(node.target)
            if name not in self.params:
                return REPLICATE
            if self.plan is not None:
                return self.fixed_vars.get(name, REPLICATE)
            if name in self.hints and self.allowed(name, "column"):
                kind, dim = self.hints[name]
                var = DimVar(self.params[name].shape[dim], frozenset({name}))
                self.decide(name, ParamDecision(kind, dim, var), node)
                return shard({dim: var})
            ndim = self.params[name].dim()
            return ParamView(name, tuple(range(ndim)))
        if node.op == "output":
            outs = [a for a in torch.utils._pytree.tree_leaves(node.args) if isinstance(a, Node)]
            for a in outs:
                self.concrete(a, node)
            self.reduce_first(node, outs)
            return REPLICATE
        if node.op != "call_function":
            return self.opaque(node)
        if node.target is operator.getitem:
            src = self.out.layouts.get(node.args[0])
            if isinstance(src, (tuple, list)):
                return src[node.args[1]]
            return self.opaque(node)
        before = padded_inputs(self.out, node, self.gathers)
        rule = rule_for(node.target)
        if rule is not None:
            out = rule(self, node)
        else:
            derived = dtensor_rule(self, node)
            out = derived if derived is not None else self.opaque(node)
        if before:
            check_padding(self.out, node, before, out)
        return out

    def opaque(self, node: Node) -> Any:
        """Unknown op: fine on replicated inputs; partial inputs are reduced first."""
        inputs = node.all_input_nodes
        for a in inputs:
            lay = self.concrete(a, node)
            if lay.dims:
                raise ShardingConflict(f"{describe(node)} does not accept a sharded input", lay.origins(), tuple(v for _, v in lay.dims))
        self.reduce_first(node, inputs)
        return replicated_like(node)


def propagate(
    gm: GraphModule,
    tp: int,
    *,
    plan: ParallelPlan | None = None,
    policy: ShardPolicy | None = None,
    avoid: dict[str, frozenset[int]] | None = None,
    statistics: StatisticPolicy | None = None,
    hints: dict[str, tuple[str, int]] | None = None,
    gathers: frozenset[str] = frozenset(),
    padded: frozenset[str] = frozenset(),
) -> Propagation:
    """Walk ``gm`` once; see the module docstring for the two modes."""
    return Walker(gm, tp, plan, policy, avoid, statistics, hints, gathers, padded).run()
