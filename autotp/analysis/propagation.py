"""Propagate tensor-parallel layouts from the parameters through the aten ops of a graph.

The engine walks the traced graph once, in order, and gives every node an output
``Layout``. Parameters are the only sources of sharding:

* In *planning* mode a parameter is undecided until its first use decides it: a matmul
  whose activation is replicated makes its weight column-parallel (a fresh ``DimVar`` on
  the out features); a matmul whose activation is sharded on the contracted dim makes
  it row-parallel (output partial); an embedding makes its table vocab-parallel; a
  pointwise op with a sharded operand makes a bias or norm weight follow that sharding;
  any other use replicates it. ``policy`` may forbid sharding a parameter.
* In *fixed* mode (``plan`` given) every parameter's layout is read from the plan.

Ops that cannot keep a sharded input sharded (a norm over the sharded dim, a softmax
over the router's experts, a slice of a sharded dim...) record a ``ShardingConflict``
naming the parameters that caused it; the conflicting output is treated as replicated
so the walk goes on and finds every conflict in one sweep. The planner then stops
sharding those parameters and walks again.

Partial tensors stay partial through ops that are linear in them (add of two partials,
mul/div by a replicated tensor, views, sums, row gathers) as long as each partial value
has one user; any other consumer, and every user of a shared partial value, gets the
partial input listed in ``reduce_inputs`` (an all-reduce goes there).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autotp.ir.errors import describe
from autotp.ir.layouts import (
    PARTIAL,
    REPLICATE,
    DimSharding,
    DimVar,
    Layout,
    ShardingConflict,
    fixed_var,
    resolve,
    select_range,
    set_groups,
    set_segments,
    shard,
    unify,
)
from autotp.ir.plan import ParallelPlan

aten = torch.ops.aten


class NodeRole(str, Enum):
    """What the rewrite passes must do with a node beyond sharding its inputs."""

    VOCAB_EMBEDDING = "vocab_embedding"
    VOCAB_CROSS_ENTROPY = "vocab_cross_entropy"
    ROW_WITH_BIAS = "row_with_bias"


@dataclass(frozen=True)
class ParamView:
    """An undecided parameter seen through views: ``dim_map[i]`` is the parameter dim
    behind view dim ``i`` (None for inserted dims)."""

    name: str
    dim_map: tuple[int | None, ...]


@dataclass
class ParamDecision:
    """Planning-mode decision for one parameter (``dim`` None: replicated)."""

    kind: str
    dim: int | None = None
    var: DimVar | None = None


ShardPolicy = Callable[[str, str, tuple[int, ...]], bool]
"""``policy(param_name, kind, shape) -> allowed``; kind is ``column`` or ``vocab``."""


@dataclass
class Propagation:
    """Result of one walk over the graph."""

    tp: int
    layouts: dict[Node, Any] = field(default_factory=dict)
    reduce_inputs: dict[Node, list[Node]] = field(default_factory=dict)
    roles: dict[Node, NodeRole] = field(default_factory=dict)
    decisions: dict[str, ParamDecision] = field(default_factory=dict)
    needs_grad: dict[Node, bool] = field(default_factory=dict)
    conflicts: list[ShardingConflict] = field(default_factory=list)
    # expand node -> [(dim, merged var, outer var)]: the broadcast dim that a later
    # reshape merges into a sharded dim gets local size local(merged) / local(outer).
    expand_fixups: dict[Node, list[tuple[int, DimVar, DimVar]]] = field(default_factory=dict)
    # slice node -> (sliced var, selected segment): its bounds become local offsets.
    slice_fixups: dict[Node, tuple[DimVar, DimVar]] = field(default_factory=dict)

    def layout(self, node: Node) -> Layout:
        lay = self.layouts.get(node, REPLICATE)
        assert isinstance(lay, Layout), f"{node.name} has layout {lay}"
        return lay


def shape_of(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def _is_float(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def reshape_chunks(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal product.

    Size-1 dims are left out (they carry nothing). Returns None if the shapes do not
    describe the same number of elements.
    """
    a = [i for i, s in enumerate(src) if s != 1]
    b = [j for j, s in enumerate(dst) if s != 1]
    chunks: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ca, cb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    return None
                ca.append(a[i])
                pa *= src[a[i]]
                i += 1
            else:
                if j >= len(b):
                    return None
                cb.append(b[j])
                pb *= dst[b[j]]
                j += 1
        chunks.append((ca, cb))
    if i != len(a) or j != len(b):
        return None
    return chunks


_VIEW_LIKE = {
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.type_as.default,
    aten.lift_fresh_copy.default,
}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SUM_LIKE = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}
_DIM_OPS = {  # ops that need the given dim whole; (position of dim arg, default)
    aten.softmax.int: (1, None),
    aten._softmax.default: (1, None),
    aten.log_softmax.int: (1, None),
    aten._log_softmax.default: (1, None),
    aten.cumsum.default: (1, None),
    aten.topk.default: (2, -1),
    aten.sort.default: (1, -1),
    aten.argmax.default: (1, None),
    aten.amax.default: (1, None),
    aten.max.dim: (1, None),
    aten.logsumexp.default: (1, None),
}
_LINEAR_IN_PARTIAL = {aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                      aten.alias.default, aten.contiguous.default, aten.detach.default}
_FACTORIES_LIKE = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}


class _Walker:
    def __init__(self, gm: GraphModule, tp: int, plan: ParallelPlan | None, policy: ShardPolicy | None) -> None:
        self.gm = gm
        self.tp = tp
        self.plan = plan
        self.policy = policy or (lambda name, kind, shape: True)
        self.out = Propagation(tp)
        self.params: dict[str, torch.nn.Parameter] = dict(gm.named_parameters(remove_duplicate=False))
        self.fixed_vars: dict[str, Layout] = {}
        # Partial tensors already all-reduced for an earlier consumer: later consumers
        # read the reduced value instead of staying partial.
        self.reduced: set[Node] = set()
        self.current: Node | None = None
        if plan is not None:
            for pl in plan.params:
                self.fixed_vars[pl.name] = shard({pl.dim: fixed_var(pl.sharding, pl.name)})

    # ---- layout access -------------------------------------------------------------

    def get(self, arg: Any) -> Layout | ParamView:
        """Layout of an argument; decided parameters are returned concrete."""
        if not isinstance(arg, Node):
            return REPLICATE
        lay = self.out.layouts.get(arg, REPLICATE)
        if lay == PARTIAL and self.current is not None and (arg in self.reduced or len(arg.users) > 1):
            # One all-reduce where a shared partial value is made, rather than one on
            # each value derived from it (a hand-written norm reads x twice).
            self.reduce_first(self.current, [arg])
            return REPLICATE
        if isinstance(lay, ParamView):
            dec = self.out.decisions.get(lay.name)
            if dec is None:
                return lay
            if dec.dim is None:
                return REPLICATE
            return shard({i: dec.var for i, d in enumerate(lay.dim_map) if d == dec.dim})
        return lay

    def concrete(self, arg: Any, node: Node) -> Layout:
        """Layout of an argument, replicating an undecided parameter."""
        lay = self.get(arg)
        if isinstance(lay, ParamView):
            self.decide(lay.name, ParamDecision("replicate"), node)
            return REPLICATE
        return lay

    def decide(self, name: str, dec: ParamDecision, node: Node) -> None:
        prev = self.out.decisions.get(name)
        if prev is not None:
            raise AssertionError(f"{name} decided twice at {node.name}")
        self.out.decisions[name] = dec

    def param_view_shard(self, view: ParamView, view_dim: int, var: DimVar, kind: str, node: Node) -> None:
        pdim = view.dim_map[view_dim]
        if pdim is None:
            raise ShardingConflict(f"{describe(node)}: cannot shard a broadcast dim of {view.name}", var.find().origins)
        self.decide(view.name, ParamDecision(kind, pdim, var), node)

    def allowed(self, name: str, kind: str) -> bool:
        return self.policy(name, kind, tuple(self.params[name].shape))

    # ---- walk ----------------------------------------------------------------------

    def run(self) -> Propagation:
        for node in self.gm.graph.nodes:
            self.current = node
            try:
                lay = self.visit(node)
            except ShardingConflict as c:
                if self.plan is not None:
                    raise ValueError(f"the plan does not fit the graph at {describe(node)}: {c}") from c
                self.out.conflicts.append(c)
                lay = _replicated_like(node)
            self.out.layouts[node] = lay
            self.out.needs_grad[node] = self.grad_of(node)
        if self.plan is None:
            self.finish_decisions()
        return self.out

    def grad_of(self, node: Node) -> bool:
        if node.op == "get_attr":
            p = self.params.get(str(node.target))
            return p is not None and p.requires_grad
        if node.op != "call_function" or not (_is_float(node) or isinstance(node.meta.get("val"), (tuple, list))):
            return False
        if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and node.args[0] is False:
            return False
        return any(self.out.needs_grad.get(n, False) for n in node.all_input_nodes)

    def finish_decisions(self) -> None:
        for name in self.params:
            self.out.decisions.setdefault(name, ParamDecision("replicate"))

    def reduce_first(self, node: Node, args: list[Any]) -> None:
        """Mark every partial input of ``node`` for an all-reduce."""
        for a in args:
            if isinstance(a, Node) and self.out.layouts.get(a) == PARTIAL:
                self.reduced.add(a)
                lst = self.out.reduce_inputs.setdefault(node, [])
                if a not in lst:
                    lst.append(a)

    def visit(self, node: Node) -> Any:
        if node.op == "placeholder":
            return REPLICATE
        if node.op == "get_attr":
            name = str(node.target)
            if name not in self.params:
                return REPLICATE
            if self.plan is not None:
                return self.fixed_vars.get(name, REPLICATE)
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
        target = node.target
        if target is operator.getitem:
            src = self.out.layouts.get(node.args[0])
            if isinstance(src, (tuple, list)):
                return src[node.args[1]]
            return self.opaque(node)
        rule = _RULES.get(target)
        if rule is not None:
            return rule(self, node)
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            return self.pointwise(node)
        if "grouped_mm" in str(target):
            return self.grouped_mm(node)
        return self.opaque(node)

    # ---- generic rules -------------------------------------------------------------

    def opaque(self, node: Node) -> Any:
        """Unknown op: fine on replicated inputs; partial inputs are reduced first."""
        inputs = node.all_input_nodes
        for a in inputs:
            lay = self.concrete(a, node)
            if lay.dims:
                raise ShardingConflict(f"{describe(node)} does not accept a sharded input", lay.origins())
        self.reduce_first(node, inputs)
        return _replicated_like(node)

    def pointwise(self, node: Node, tensor_args: list[Any] | None = None) -> Layout:
        """Elementwise op with broadcasting."""
        args = tensor_args if tensor_args is not None else [a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]
        out_shape = shape_of(node)
        if out_shape is None:
            return self.opaque(node)
        lays = [self.get(a) for a in args]
        partial = [a for a, l in zip(args, lays) if l == PARTIAL]
        sharded = [l for l in lays if isinstance(l, Layout) and l.dims]
        if partial:
            if not sharded and self.linear_in_partial(node, args, lays):
                for a, l in zip(args, lays):
                    if isinstance(l, ParamView):
                        self.concrete(a, node)
                return PARTIAL
            self.reduce_first(node, args)
            lays = [REPLICATE if l == PARTIAL else l for l in lays]
        if not sharded:
            for a in args:
                self.concrete(a, node)
            return REPLICATE
        nd = len(out_shape)
        dims: dict[int, DimVar] = {}
        for lay in sharded:
            for d, v in lay.dims:
                # align from the right
                arg_ndim = None
                for a, l in zip(args, lays):
                    if l is lay:
                        arg_ndim = len(shape_of(a) or ())
                od = d + nd - (arg_ndim or nd)
                dims[od] = unify(dims[od], v, describe(node)) if od in dims else v
        for a, lay in zip(args, lays):
            shp = shape_of(a) or ()
            off = nd - len(shp)
            for od, var in dims.items():
                d = od - off
                if d < 0 or shp[d] == 1:
                    continue
                if isinstance(lay, ParamView):
                    if lay.name in self.out.decisions:
                        continue
                    if len([x for x in range(len(shp)) if x + off in dims and shp[x] != 1]) > 1:
                        raise ShardingConflict(f"{describe(node)}: {lay.name} meets two sharded dims", var.find().origins)
                    self.param_view_shard(lay, d, var, "bias", node)
                elif lay.var_at(d) is None:
                    raise ShardingConflict(
                        f"{describe(node)}: a replicated operand of full size meets a sharded dim", var.find().origins
                    )
        for a in args:
            lay = self.get(a)
            if isinstance(lay, ParamView):
                self.concrete(a, node)
        return shard(dims)

    def linear_in_partial(self, node: Node, args: list[Any], lays: list[Any]) -> bool:
        target = node.target
        n_partial = sum(1 for l in lays if l == PARTIAL)
        if target in _LINEAR_IN_PARTIAL:
            return True
        if target in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor):
            return n_partial == 2 and len(args) == 2
        if target in (aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor):
            if n_partial != 1:
                return False
            if target in (aten.div.Tensor, aten.div_.Tensor) and node.args[0] is not args[lays.index(PARTIAL)]:
                return False
            return True
        return False

    # ---- matmuls -------------------------------------------------------------------

    def matmul(self, node: Node, a: Node, b: Any, b_t: bool, bias: Any, b_batch_free: bool = False) -> Layout:
        """``a @ op(b) (+ bias)``: ``b_t`` means b is stored [N, K] (``aten.linear``).

        ``b_batch_free``: b has leading dims that a does not (MoE experts).
        """
        la = self.get(a)
        if isinstance(la, ParamView):
            la = self.concrete(a, node)
        if la == PARTIAL:
            self.reduce_first(node, [a])
            la = REPLICATE
        a_shape = shape_of(a)
        b_shape = shape_of(b) if isinstance(b, Node) else None
        if a_shape is None or b_shape is None:
            return self.opaque(node)
        a_nd, b_nd = len(a_shape), len(b_shape)
        b_k, b_n = (b_nd - 1, b_nd - 2) if b_t else (b_nd - 2, b_nd - 1)
        if b_nd == 1:
            return self.opaque(node)
        ak = la.var_at(a_nd - 1)
        lb = self.get(b)
        kind_col = "expert_column" if b_batch_free else "column"
        kind_row = "expert_row" if b_batch_free else "row"
        if isinstance(lb, ParamView):
            if ak is not None:
                self.param_view_shard(lb, b_k, ak, kind_row, node)
            elif self.allowed(lb.name, "column"):
                var = DimVar(b_shape[b_n], frozenset({lb.name}))
                self.param_view_shard(lb, b_n, var, kind_col, node)
            else:
                self.decide(lb.name, ParamDecision("replicate"), node)
            lb = self.get(b)
        if lb == PARTIAL:
            self.reduce_first(node, [b])
            lb = REPLICATE
        assert isinstance(lb, Layout)
        bk, bn = lb.var_at(b_k), lb.var_at(b_n)
        out_nd = len(shape_of(node) or ())
        if (ak is None) != (bk is None):
            raise ShardingConflict(
                f"{describe(node)}: only one side of the contraction is sharded", (la.origins() | lb.origins())
            )
        dims: dict[int, DimVar] = {}
        for d, v in la.dims:
            if d != a_nd - 1:
                dims[d + out_nd - a_nd] = v
        if not b_batch_free:
            for d, v in lb.dims:
                if d not in (b_k, b_n):
                    od = d + out_nd - b_nd
                    dims[od] = unify(dims[od], v, describe(node)) if od in dims else v
        elif any(d not in (b_k, b_n) for d, _ in lb.dims):
            raise ShardingConflict(f"{describe(node)}: expert dim cannot be sharded here", lb.origins())
        if bn is not None:
            dims[out_nd - 1] = bn
        if ak is not None:
            unify(ak, bk, describe(node))
            if dims:
                raise ShardingConflict(f"{describe(node)}: contraction and output both sharded", la.origins())
            out: Layout = PARTIAL
        else:
            out = shard(dims)
        if bias is not None and isinstance(bias, Node):
            lbias = self.get(bias)
            if out == PARTIAL:
                self.concrete(bias, node)
                if self.get(bias) != REPLICATE:
                    raise ShardingConflict(f"{describe(node)}: bias of a row-parallel matmul is sharded", lb.origins())
                self.out.roles[node] = NodeRole.ROW_WITH_BIAS
                return REPLICATE
            if isinstance(lbias, ParamView):
                if bn is not None:
                    self.param_view_shard(lbias, len(lbias.dim_map) - 1, bn, "bias", node)
                else:
                    self.concrete(bias, node)
            elif lbias == PARTIAL:
                self.reduce_first(node, [bias])
            elif (lbias.var_at(len(shape_of(bias) or ()) - 1) is None) != (bn is None):
                raise ShardingConflict(f"{describe(node)}: bias and weight disagree", lb.origins() | lbias.origins())
            elif bn is not None:
                unify(lbias.dims[0][1], bn, describe(node))
        return out

    def grouped_mm(self, node: Node) -> Layout:
        a, b = node.args[0], node.args[1]
        return self.matmul(node, a, b, b_t=False, bias=None, b_batch_free=True)

    # ---- shape ops -----------------------------------------------------------------

    def permute_like(self, node: Node, perm: list[int]) -> Any:
        """Output dim i comes from input dim perm[i] (None: new dim)."""
        lay = self.get(node.args[0])
        if isinstance(lay, ParamView):
            return ParamView(lay.name, tuple(None if p is None else lay.dim_map[p] for p in perm))
        if lay.partial or not lay.dims:
            return lay
        return shard({i: lay.var_at(p) for i, p in enumerate(perm) if p is not None and lay.var_at(p) is not None})

    def reshape(self, node: Node) -> Layout:
        lay = self.concrete(node.args[0], node)
        if lay.partial or not lay.dims:
            return lay
        src, dst = shape_of(node.args[0]), shape_of(node)
        assert src is not None and dst is not None
        chunks = reshape_chunks(src, dst)
        if chunks is None:
            raise ShardingConflict(f"{describe(node)}: cannot map the reshape", lay.origins())
        dims: dict[int, DimVar] = {}
        for ca, cb in chunks:
            vars_in = [(d, lay.var_at(d)) for d in ca if lay.var_at(d) is not None]
            if not vars_in:
                continue
            if len(vars_in) > 1:
                raise ShardingConflict(f"{describe(node)}: reshape merges two sharded dims", lay.origins())
            d, var = vars_in[0]
            if len(ca) == 1 and len(cb) == 1:
                dims[cb[0]] = var
            elif len(ca) == 1:
                # split: the sharded dim becomes [blocks, rest...]; blocks carry the split
                blocks = dst[cb[0]]
                set_groups(var, blocks, describe(node))
                out_var = DimVar(blocks, var.find().origins)
                set_groups(out_var, blocks, describe(node))
                dims[cb[0]] = out_var
            elif len(cb) == 1:
                if d != ca[0]:
                    raise ShardingConflict(f"{describe(node)}: the sharded dim is not the outer one of a merge", lay.origins())
                merged = DimVar(dst[cb[0]], var.find().origins)
                merged.outer = var
                set_groups(merged, var.find().size, describe(node))
                dims[cb[0]] = merged
                self.note_broadcast_merge(node.args[0], ca[1:], merged, var)
            else:
                raise ShardingConflict(f"{describe(node)}: reshape regroups a sharded dim", lay.origins())
        return shard(dims)

    def note_broadcast_merge(self, src: Node, inner_dims: list[int], merged: DimVar, outer: DimVar) -> None:
        """``repeat_kv``: an expand whose broadcast dims are merged into a sharded dim."""
        producer = src
        while producer.target in (aten.clone.default, aten.contiguous.default) and isinstance(producer.args[0], Node):
            producer = producer.args[0]
        if producer.target is aten.expand.default and len(inner_dims) == 1:
            self.out.expand_fixups.setdefault(producer, []).append((inner_dims[0], merged, outer))

    def expand(self, node: Node) -> Any:
        lay = self.get(node.args[0])
        src, dst = shape_of(node.args[0]), shape_of(node)
        assert src is not None and dst is not None
        off = len(dst) - len(src)
        if isinstance(lay, ParamView):
            return ParamView(lay.name, (None,) * off + lay.dim_map)
        if lay.partial or not lay.dims:
            return lay
        return shard({d + off: v for d, v in lay.dims})

    def unsqueeze(self, node: Node) -> Any:
        nd = len(shape_of(node) or ())
        d = _norm_dim(node.args[1], nd)
        perm: list[int | None] = list(range(nd - 1))
        perm.insert(d, None)
        return self.permute_like(node, perm)  # type: ignore[arg-type]

    def squeeze(self, node: Node) -> Any:
        src = shape_of(node.args[0]) or ()
        if len(node.args) > 1:
            ds = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
            drop = {_norm_dim(d, len(src)) for d in ds if src[_norm_dim(d, len(src))] == 1}
        else:
            drop = {i for i, s in enumerate(src) if s == 1}
        return self.permute_like(node, [i for i in range(len(src)) if i not in drop])

    def transpose(self, node: Node) -> Any:
        nd = len(shape_of(node) or ())
        if node.target is aten.t.default:
            d0, d1 = 0, nd - 1
        else:
            d0, d1 = _norm_dim(node.args[1], nd), _norm_dim(node.args[2], nd)
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return self.permute_like(node, perm)

    def reverse_dims(self, node: Node) -> Any:
        """``x.T`` (``numpy_T``) reverses every dim; ``x.mT`` swaps the last two."""
        nd = len(shape_of(node) or ())
        perm = list(range(nd))
        if node.target is aten.numpy_T.default:
            perm.reverse()
        else:
            perm[-2], perm[-1] = perm[-1], perm[-2]
        return self.permute_like(node, perm)

    def permute(self, node: Node) -> Any:
        nd = len(shape_of(node) or ())
        return self.permute_like(node, [_norm_dim(d, nd) for d in node.args[1]])

    def slice_(self, node: Node) -> Any:
        lay = self.concrete(node.args[0], node)
        src = shape_of(node.args[0]) or ()
        d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(src))
        var = lay.var_at(d)
        if var is None:
            return lay
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else src[d]
        step = node.args[4] if len(node.args) > 4 else 1
        start, end = _norm_dim(start, src[d]), min(_norm_dim(end, src[d]) if end < 0 else end, src[d])
        if step != 1:
            raise ShardingConflict(f"{describe(node)}: strided slice of a sharded dim", lay.origins())
        part = select_range(var, start, end, describe(node))
        if part is not var.find():
            self.out.slice_fixups[node] = (var, part)
        return shard({**dict(lay.dims), d: part})

    def select(self, node: Node) -> Any:
        lay = self.concrete(node.args[0], node)
        src = shape_of(node.args[0]) or ()
        d = _norm_dim(node.args[1], len(src))
        if lay.var_at(d) is not None:
            raise ShardingConflict(f"{describe(node)}: selects along a sharded dim", lay.origins())
        return self.permute_like(node, [i for i in range(len(src)) if i != d])

    def split(self, node: Node) -> Any:
        lay = self.concrete(node.args[0], node)
        src = shape_of(node.args[0]) or ()
        outs = node.meta.get("val")
        n_out = len(outs) if isinstance(outs, (list, tuple)) else 1
        target = node.target
        if target is aten.chunk.default:
            d = _norm_dim(node.args[2] if len(node.args) > 2 else 0, len(src))
        elif target is aten.unbind.int:
            d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(src))
        else:
            d = _norm_dim(node.args[2] if len(node.args) > 2 else 0, len(src))
        if lay.partial:
            return tuple(PARTIAL for _ in range(n_out))
        var = lay.var_at(d)
        if var is None:
            if target is aten.unbind.int:
                return tuple(self.drop_dim(lay, d) for _ in range(n_out))
            return tuple(lay for _ in range(n_out))
        if target is aten.unbind.int:
            raise ShardingConflict(f"{describe(node)}: unbinds a sharded dim", lay.origins())
        sizes = [int(o.shape[d]) for o in outs]
        segs = set_segments(var, sizes, describe(node))
        return tuple(shard({**dict(lay.dims), d: seg}) for seg in segs)

    def drop_dim(self, lay: Layout, d: int) -> Layout:
        return shard({(i if i < d else i - 1): v for i, v in lay.dims if i != d})

    def cat(self, node: Node) -> Any:
        """``cat`` and ``stack``: inputs sharded alike, along another dim."""
        tensors = node.args[0]
        nd = len(shape_of(node) or ())
        d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
        stacking = node.target is aten.stack.default
        lays = [self.concrete(t, node) for t in tensors]
        if all(l.replicated for l in lays):
            return REPLICATE
        if any(l.partial for l in lays):
            self.reduce_first(node, list(tensors))
            lays = [REPLICATE if l.partial else l for l in lays]
        first = lays[0]
        for l in lays[1:]:
            if [x for x, _ in l.dims] != [x for x, _ in first.dims]:
                raise ShardingConflict(f"{describe(node)}: concatenates differently sharded tensors", first.origins() | l.origins())
            for (_, v1), (_, v2) in zip(first.dims, l.dims):
                unify(v1, v2, describe(node))
        if stacking:
            return shard({(i if i < d else i + 1): v for i, v in first.dims})
        if first.var_at(d) is not None:
            raise ShardingConflict(f"{describe(node)}: concatenates along a sharded dim", first.origins())
        return first

    def index(self, node: Node) -> Any:
        x, indices = node.args[0], node.args[1]
        lay = self.concrete(x, node)
        for i in indices:
            if isinstance(i, Node) and not self.concrete(i, node).replicated:
                raise ShardingConflict(f"{describe(node)}: sharded index tensor", self.get(i).origins())
        if lay.replicated or lay.partial:
            return lay
        k = len(indices)
        if any(i is None for i in indices) or any(lay.var_at(d) is not None for d in range(k)):
            raise ShardingConflict(f"{describe(node)}: indexes a sharded dim", lay.origins())
        src, dst = shape_of(x) or (), shape_of(node) or ()
        shift = len(dst) - len(src)
        return shard({d + shift: v for d, v in lay.dims})

    def reduction(self, node: Node) -> Any:
        x = node.args[0]
        lay = self.concrete(x, node)
        src = shape_of(x) or ()
        nd = len(src)
        target = node.target
        if target in (aten.sum.default, aten.mean.default):
            dims_r, keep = list(range(nd)), False
        else:
            dims_r = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(nd))
            dims_r = [dims_r] if isinstance(dims_r, int) else list(dims_r)
            dims_r = [_norm_dim(d, nd) for d in dims_r] or list(range(nd))
            keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if lay.partial:
            return PARTIAL
        reduced_vars = [lay.var_at(d) for d in dims_r if lay.var_at(d) is not None]
        if reduced_vars:
            if target in (aten.sum.dim_IntList, aten.sum.default) and len(lay.dims) == len(reduced_vars):
                return PARTIAL
            raise ShardingConflict(f"{describe(node)}: reduces over a sharded dim", lay.origins())
        if keep:
            return lay
        kept = [d for d in range(nd) if d not in dims_r]
        return shard({kept.index(d): v for d, v in lay.dims})

    def needs_whole_dim(self, node: Node) -> Any:
        pos, default = _DIM_OPS[node.target]
        x = node.args[0]
        lay = self.concrete(x, node)
        self.reduce_first(node, [x])
        if lay.partial:
            lay = REPLICATE
        nd = len(shape_of(x) or ())
        d = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
        if d is None:
            if lay.dims:
                raise ShardingConflict(f"{describe(node)}: reduces a sharded tensor", lay.origins())
        else:
            dl = [d] if isinstance(d, int) else list(d)
            for dd in dl:
                if lay.var_at(_norm_dim(dd, nd)) is not None:
                    raise ShardingConflict(f"{describe(node)}: needs a sharded dim whole", lay.origins())
        val = node.meta.get("val")
        keep_shape = isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(shape_of(x) or ())
        if isinstance(val, (tuple, list)):
            if all(tuple(v.shape) == shape_of(x) for v in val):
                return tuple(lay for _ in val)
            if lay.dims:
                raise ShardingConflict(f"{describe(node)}: unsupported sharded reduction", lay.origins())
            return tuple(REPLICATE for _ in val)
        if keep_shape or not lay.dims:
            return lay
        raise ShardingConflict(f"{describe(node)}: unsupported sharded reduction", lay.origins())

    def norm(self, node: Node) -> Any:
        """layer_norm / rms_norm: the normalized (last) dims must be whole."""
        x = node.args[0]
        lay = self.concrete(x, node)
        self.reduce_first(node, [x])
        if lay.partial:
            lay = REPLICATE
        nd = len(shape_of(x) or ())
        n_norm = len(node.args[1])
        for d, _ in lay.dims:
            if d >= nd - n_norm:
                raise ShardingConflict(f"{describe(node)}: normalizes over a sharded dim", lay.origins())
        for a in node.all_input_nodes[1:]:
            self.concrete(a, node)
            self.reduce_first(node, [a])
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return (lay,) + tuple(REPLICATE if not lay.dims else lay for _ in val[1:])
        return lay

    def embedding(self, node: Node) -> Layout:
        weight, ids = node.args[0], node.args[1]
        if not self.concrete(ids, node).replicated:
            raise ShardingConflict(f"{describe(node)}: sharded embedding indices", self.get(ids).origins())
        lw = self.get(weight)
        if isinstance(lw, ParamView):
            shape = tuple(self.params[lw.name].shape)
            if lw.dim_map == (0, 1) and self.allowed(lw.name, "vocab"):
                var = DimVar(shape[0], frozenset({lw.name}), padded=True)
                self.decide(lw.name, ParamDecision("vocab", 0, var), node)
            else:
                self.decide(lw.name, ParamDecision("replicate"), node)
            lw = self.get(weight)
        assert isinstance(lw, Layout)
        if lw.replicated:
            return REPLICATE
        if lw.partial or lw.var_at(0) is None:
            self.reduce_first(node, [weight])
            if lw.dims:
                raise ShardingConflict(f"{describe(node)}: embedding table sharded on its features", lw.origins())
            return REPLICATE
        self.out.roles[node] = NodeRole.VOCAB_EMBEDDING
        return PARTIAL

    def sdpa(self, node: Node) -> Layout:
        q, k, v = node.args[0], node.args[1], node.args[2]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        lays = [self.concrete(t, node) for t in (q, k, v)]
        self.reduce_first(node, [q, k, v])
        lays = [REPLICATE if l.partial else l for l in lays]
        if all(l.replicated for l in lays):
            if isinstance(mask, Node):
                self.concrete(mask, node)
                self.reduce_first(node, [mask])
            return REPLICATE
        heads = [l.var_at(1) for l in lays]
        if any(len(l.dims) != 1 or l.var_at(1) is None for l in lays):
            blame = lays[0].origins() | lays[1].origins() | lays[2].origins()
            raise ShardingConflict(f"{describe(node)}: attention needs q, k and v sharded on heads", blame)
        unify(heads[1], heads[2], describe(node))
        if heads[0].find().size == heads[1].find().size:
            unify(heads[0], heads[1], describe(node))
        if isinstance(mask, Node):
            lm = self.concrete(mask, node)
            mshape = shape_of(mask) or ()
            if not lm.replicated or (len(mshape) == 4 and mshape[1] != 1):
                raise ShardingConflict(f"{describe(node)}: per-head attention mask", lays[0].origins())
        return shard({1: heads[0]})

    def cross_entropy(self, node: Node) -> Layout:
        logits, target = node.args[0], node.args[1]
        lay = self.concrete(logits, node)
        self.concrete(target, node)
        if lay.partial:
            self.reduce_first(node, [logits])
            return REPLICATE
        if lay.replicated:
            return REPLICATE
        nd = len(shape_of(logits) or ())
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
        if nd != 2 or lay.var_at(1) is None or len(lay.dims) != 1 or weight is not None or smoothing:
            raise ShardingConflict(f"{describe(node)}: only plain 2-D cross-entropy is vocab-parallel", lay.origins())
        vocab = lay.var_at(1).find()
        if vocab.groups is None and vocab.segments is None and vocab.fixed is None:
            vocab.padded = True  # the loss masks padded classes, so V % tp may be nonzero
        self.out.roles[node] = NodeRole.VOCAB_CROSS_ENTROPY
        return REPLICATE

    def like_factory(self, node: Node) -> Layout:
        lay = self.concrete(node.args[0], node)
        return REPLICATE if lay.partial else lay

    def dropout(self, node: Node) -> Layout:
        x = node.args[0]
        lay = self.concrete(x, node)
        if lay.partial:
            self.reduce_first(node, [x])
            return REPLICATE
        return lay

    def where(self, node: Node) -> Layout:
        return self.pointwise(node)


def _replicated_like(node: Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(REPLICATE for _ in val)
    return REPLICATE


def _linear(w: _Walker, n: Node) -> Any:
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return w.matmul(n, n.args[0], n.args[1], b_t=True, bias=bias)


def _addmm(w: _Walker, n: Node) -> Any:
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
        return w.opaque(n)
    return w.matmul(n, n.args[1], n.args[2], b_t=False, bias=n.args[0])


def _mm(w: _Walker, n: Node) -> Any:
    return w.matmul(n, n.args[0], n.args[1], b_t=False, bias=None)


_RULES: dict[Any, Callable[[_Walker, Node], Any]] = {
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _mm,
    aten.bmm.default: _mm,
    aten.matmul.default: _mm,
    aten.embedding.default: _Walker.embedding,
    aten.scaled_dot_product_attention.default: _Walker.sdpa,
    aten.cross_entropy_loss.default: _Walker.cross_entropy,
    aten.view.default: _Walker.reshape,
    aten.reshape.default: _Walker.reshape,
    aten._unsafe_view.default: _Walker.reshape,
    aten.flatten.using_ints: _Walker.reshape,
    aten.unflatten.int: _Walker.reshape,
    aten.expand.default: _Walker.expand,
    aten.unsqueeze.default: _Walker.unsqueeze,
    aten.squeeze.dim: _Walker.squeeze,
    aten.squeeze.dims: _Walker.squeeze,
    aten.squeeze.default: _Walker.squeeze,
    aten.transpose.int: _Walker.transpose,
    aten.t.default: _Walker.transpose,
    aten.permute.default: _Walker.permute,
    aten.numpy_T.default: _Walker.reverse_dims,
    aten.mT.default: _Walker.reverse_dims,
    aten.slice.Tensor: _Walker.slice_,
    aten.select.int: _Walker.select,
    aten.split.Tensor: _Walker.split,
    aten.split_with_sizes.default: _Walker.split,
    aten.chunk.default: _Walker.split,
    aten.unbind.int: _Walker.split,
    aten.cat.default: _Walker.cat,
    aten.stack.default: _Walker.cat,
    aten.index.Tensor: _Walker.index,
    aten.layer_norm.default: _Walker.norm,
    aten.native_layer_norm.default: _Walker.norm,
    aten.rms_norm.default: _Walker.norm,
    aten.dropout.default: _Walker.dropout,
    aten.where.self: _Walker.where,
    **{op: _Walker.reduction for op in _SUM_LIKE},
    **{op: _Walker.needs_whole_dim for op in _DIM_OPS},
    **{op: _Walker.like_factory for op in _FACTORIES_LIKE},
}
for _op in _VIEW_LIKE:
    _RULES.setdefault(_op, lambda w, n: w.pointwise(n, [n.args[0]]) if not isinstance(w.get(n.args[0]), ParamView) else w.get(n.args[0]))


def propagate(
    gm: GraphModule, tp: int, *, plan: ParallelPlan | None = None, policy: ShardPolicy | None = None
) -> Propagation:
    """Walk ``gm`` once; see the module docstring for the two modes."""
    return _Walker(gm, tp, plan, policy).run()


def check_divisible(prop: Propagation, gm: GraphModule) -> None:
    """Raise a ValueError naming the node when a sharded dim cannot be split over tp."""
    seen: set[int] = set()
    for node, lay in prop.layouts.items():
        lays = lay if isinstance(lay, tuple) else (lay,)
        for l in lays:
            if not isinstance(l, Layout):
                continue
            for d, var in l.dims:
                r = var.find()
                if r.uid in seen:
                    continue
                seen.add(r.uid)
                why = resolve(r, prop.tp).check(prop.tp)
                if why:
                    origins = ", ".join(sorted(r.origins))
                    raise ValueError(
                        f"cannot split dim {d} of {describe(node)} over tp={prop.tp}: {why}. "
                        f"It comes from parameter(s) {origins}. Choose a tp that divides it "
                        f"(or whose multiple it is), or keep those parameters replicated."
                    )


def param_sharding(prop: Propagation, name: str) -> tuple[str, int, DimSharding] | None:
    """Planning result for one parameter: (kind, dim, sharding), or None if replicated."""
    dec = prop.decisions.get(name)
    if dec is None or dec.dim is None or dec.var is None:
        return None
    return dec.kind, dec.dim, resolve(dec.var, prop.tp)

