"""The layout rule of every aten op the walk knows, in one table.

A rule is ``rule(walker, node) -> layout`` (a tuple of layouts for multi-output ops).
``rule_for`` looks a target up in ``RULES`` by overload; an op missing there is
elementwise if it carries ``torch.Tag.pointwise``, a grouped (expert) matmul if
``autotp.ir.op_facts`` says so, and otherwise derived from DTensor's strategy or opaque
(``Walker.visit``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis import attention_rules as attention
from autotp.analysis import contraction_rules as contractions
from autotp.analysis import index_rules as indexing
from autotp.analysis import reshape_rules as reshapes
from autotp.analysis import shape_rules as shapes
from autotp.analysis import convolution_rules
from autotp.analysis import sharding_policy as params
from autotp.analysis import statistic_rules as statistics
from autotp.analysis import value_rules as values
from autotp.ir.op_facts import CONVOLUTIONS, functional_variant, is_grouped_matmul, is_pointwise, op_name
from autotp.analysis.propagation_result import ParamView
from autotp.ir import ops
from autotp.ir.errors import describe
from autotp.ir.layouts import Layout, ShardingConflict

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

aten = torch.ops.aten

Rule = Callable[["Walker", Node], Any]


def _linear(w: Walker, n: Node) -> Any:
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return params.matmul(w, n, n.args[0], n.args[1], b_t=True, bias=bias)


def _addmm(w: Walker, n: Node) -> Any:
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
        return w.opaque(n)
    return params.matmul(w, n, n.args[1], n.args[2], b_t=False, bias=n.args[0])


def _mm(w: Walker, n: Node) -> Any:
    if n.target is aten.matmul.default and contractions.is_vector_matmul(n):
        return contractions.vector_matmul(w, n)
    return params.matmul(w, n, n.args[0], n.args[1], b_t=False, bias=None)


def _view_like(w: Walker, n: Node) -> Any:
    """Dtype casts, copies, detach: the layout of the input (an undecided parameter stays so)."""
    src = w.get(n.args[0])
    return src if isinstance(src, ParamView) else values.pointwise(w, n, [n.args[0]])


def _elementwise_function(w: Walker, n: Node) -> Any:
    """A custom Function proven elementwise (``custom_functions``): of one parameter alone it
    stays that parameter's undecided view, like a cast (weight fake-quantization); else pointwise."""
    inputs = list(n.args[0])
    src = w.get(inputs[0])
    return src if len(inputs) == 1 and isinstance(src, ParamView) else values.pointwise(w, n, inputs)


_VIEW_LIKE = (
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
)
_FACTORIES_LIKE = (aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
_FACTORIES_NEW = (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)

RULES: dict[Any, Rule] = {
    # matmuls and the parameters they shard
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _mm,
    aten.bmm.default: _mm,
    aten.baddbmm.default: values.baddbmm,
    aten.matmul.default: _mm,
    aten.embedding.default: params.embedding,
    aten.embedding_bag.default: params.embedding_bag,
    aten.embedding_bag.padding_idx: params.embedding_bag,
    aten._embedding_bag.default: params.embedding_bag,
    aten.cross_entropy_loss.default: params.cross_entropy,
    aten.einsum.default: contractions.einsum,
    aten.tensordot.default: contractions.tensordot,
    aten.bilinear.default: contractions.bilinear,
    **{conv: convolution_rules.convolution for conv in CONVOLUTIONS},
    ops.ELEMENTWISE_FUNCTION: _elementwise_function,
    # shape ops
    aten.view.default: reshapes.reshape,
    aten.reshape.default: reshapes.reshape,
    aten._unsafe_view.default: reshapes.reshape,
    aten.flatten.using_ints: reshapes.reshape,
    aten.unflatten.int: reshapes.reshape,
    aten.view_as.default: reshapes.reshape_as,
    aten.reshape_as.default: reshapes.reshape_as,
    aten.view_as_complex.default: reshapes.view_as_complex,
    aten.view_as_real.default: reshapes.view_as_real,
    aten.repeat_interleave.self_int: reshapes.repeat_interleave,
    aten.repeat.default: reshapes.repeat,
    aten.expand.default: shapes.expand,
    aten.broadcast_to.default: shapes.expand,
    aten.expand_as.default: shapes.expand_as,
    aten.tril.default: shapes.dims_whole,
    aten.triu.default: shapes.dims_whole,
    aten.flip.default: shapes.dims_whole,
    aten.roll.default: shapes.dims_whole,
    aten.unfold.default: shapes.unfold,
    aten.as_strided.default: shapes.as_strided,
    aten.unsqueeze.default: shapes.unsqueeze,
    aten.one_hot.default: shapes.appends_whole_dim,
    aten.squeeze.dim: shapes.squeeze,
    aten.squeeze.dims: shapes.squeeze,
    aten.squeeze.default: shapes.squeeze,
    aten.transpose.int: shapes.transpose,
    aten.t.default: shapes.transpose,
    aten.permute.default: shapes.permute,
    aten.numpy_T.default: shapes.reverse_dims,
    aten.mT.default: shapes.reverse_dims,
    aten.slice.Tensor: shapes.slice_,
    aten.sym_size.int: shapes.sym_size,
    aten.select.int: shapes.select,
    aten.split.Tensor: shapes.split,
    aten.split_with_sizes.default: shapes.split,
    aten.chunk.default: shapes.split,
    aten.glu.default: shapes.glu,
    aten.unbind.int: shapes.split,
    aten.cat.default: shapes.cat,
    aten.stack.default: shapes.cat,
    aten.concat.default: shapes.cat,
    aten.concatenate.default: shapes.cat,
    aten.constant_pad_nd.default: shapes.pad,
    aten.pad.default: shapes.pad,
    # indexing
    aten.index.Tensor: indexing.index,
    aten.index_select.default: indexing.index_select,
    aten.gather.default: indexing.gather,
    aten.index_put.default: indexing.index_put,
    aten.index_put_.default: indexing.index_put,
    aten.index_add.default: indexing.index_add,
    aten.index_add_.default: indexing.index_add,
    aten.scatter.src: indexing.scatter,
    aten.scatter.value: indexing.scatter,
    aten.scatter_.src: indexing.scatter,
    aten.scatter_.value: indexing.scatter,
    aten.scatter_add.default: indexing.scatter,
    aten.scatter_add_.default: indexing.scatter,
    aten.scatter_reduce.two: indexing.scatter_reduce,
    aten.scatter_reduce_.two: indexing.scatter_reduce,
    aten.index_reduce.default: indexing.index_add,
    aten.index_reduce_.default: indexing.index_add,
    # values
    aten.scaled_dot_product_attention.default: attention.sdpa,
    attention.FLEX_ATTENTION: attention.flex_attention,
    aten.layer_norm.default: statistics.norm,
    aten.native_layer_norm.default: statistics.norm,
    aten.rms_norm.default: statistics.norm,
    aten.group_norm.default: statistics.group_norm,
    aten.batch_norm.default: statistics.batch_norm,
    aten.instance_norm.default: statistics.instance_norm,
    aten.dropout.default: values.dropout,
    aten.where.self: values.pointwise,
    # elementwise, though not tagged so (composite ops, a 0-d fill value)
    aten.masked_fill.Tensor: values.pointwise,
    aten.log_sigmoid.default: values.pointwise,
    aten.polar.default: values.pointwise,
    aten.floor_divide.default: values.pointwise,
    aten.__and__.Tensor: values.pointwise,
    aten.__or__.Tensor: values.pointwise,
    aten.where.ScalarOther: values.pointwise,
    aten.where.ScalarSelf: values.pointwise,
    aten.where.Scalar: values.pointwise,
    **{op: statistics.reduction for op in statistics.REDUCTIONS},
    **{op: values.needs_whole_dim for op in values.DIM_OPS},
    **{op: statistics.extremum for op in statistics.EXTREMA},
    **{op: statistics.per_channel for op in statistics.PER_CHANNEL},
    **{op: statistics.per_tensor for op in statistics.PER_TENSOR},
    **{op: values.like_factory for op in _FACTORIES_LIKE},
    **{op: values.new_factory for op in _FACTORIES_NEW},
    aten.copy_.default: values.copy_into,
    aten.copy.default: values.copy_into,
}
for _op in _VIEW_LIKE:
    RULES.setdefault(_op, _view_like)


def rule_for(target: Any) -> Rule | None:
    """The rule of a ``call_function`` target (None: treat the op as opaque)."""
    rule = RULES.get(target)
    if rule is not None:
        return rule
    if op_name(target) in shapes.PLANEWISE:
        return shapes.planewise
    if op_name(target) in shapes.FOURIER:
        return shapes.fourier
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return values.random_draw
    if is_pointwise(target):
        return values.pointwise
    if is_grouped_matmul(target):
        return params.grouped_matmul
    functional = functional_variant(target)
    rule = rule_for(functional) if functional is not None else None
    return _written_in_place(rule) if rule is not None else None


def _written_in_place(rule: Rule) -> Rule:
    """The rule of an in-place op from its out-of-place one's: the values it writes must have the
    layout of the tensor they are written into (a split value written into a whole tensor would
    update only each rank's part of it)."""

    def apply(w: Walker, node: Node) -> Any:
        out = rule(w, node)
        into = w.get(node.args[0])
        split = {(d, v.find()) for d, v in out.dims} if isinstance(out, Layout) else set()
        held = {(d, v.find()) for d, v in into.dims} if isinstance(into, Layout) else set()
        if split != held:
            raise ShardingConflict(f"{describe(node)}: writes a value split otherwise into its input", out.origins(), tuple(v for _, v in out.dims))
        return out

    return apply
