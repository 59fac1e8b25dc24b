"""Which use of a convolution's weight makes it column-, row- or group-parallel (``convolution``).

A patch embedding's weight is column-parallel over its output channels; a depthwise
convolution's follows the split of its channels; a grouped one splits on whole groups
(``_grouped_channels``); a dense one over split input channels is row-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.fx import Node

from autotp.analysis.propagation_result import NodeRole, ParamView
from autotp.analysis.shapes import schema_arg, shape_of
from autotp.analysis.sharding_policy import output_bias
from autotp.ir.errors import describe
from autotp.analysis.padded_dims import record_mask
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, Layout, ShardingConflict, follow, shard, tile, unify
from autotp.ir.op_facts import is_transposed_convolution

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker


def convolution(w: Walker, node: Node) -> Any:
    """``conv1d/2d/3d``, ``conv_transpose1d/2d/3d``, ``convolution``: channels are dim 1 of the
    input; the weight's output and input channels are its dims 0 and 1 (1 and 0 transposed);
    the spatial dims must be whole.

    Replicated input channels and ``groups=1`` make the weight column-parallel over its
    output channels (a patch embedding, a decoder's upsampler); input channels split with
    ``groups`` equal to the channels (a depthwise short convolution) keep the split, and the
    weight, the bias and the local ``groups`` follow it (``rewrite_shapes``); split into other
    groups, the split falls on whole groups (``_grouped_channels``), and whole input channels into
    groups of several channels are read through the rank's groups (``Propagation.local_slices``;
    a depthwise weight, one input channel per group, is too small to be worth it); split input
    channels into a dense convolution make it row-parallel.
    """
    x, weight = node.args[0], node.args[1]
    bias = schema_arg(node, "bias")
    groups = schema_arg(node, "groups", 1)
    if not isinstance(weight, Node):
        return w.opaque(node)
    w_out, w_in = (1, 0) if is_transposed_convolution(node) else (0, 1)
    lx = w.summed(x, node)
    xs, ws = shape_of(x) or (), shape_of(weight) or ()
    for d, v in lx.dims:
        if d >= 2:
            raise ShardingConflict(f"{describe(node)}: convolves over a sharded dim", lx.origins(), (v,))
    channels = lx.var_at(1)
    lw = w.get(weight)
    if channels is None and 1 < groups < xs[1] and groups % w.tp == 0 and w_out == 0 and (
        (isinstance(lw, ParamView) and lw.dim_map[0] == 0 and w.allowed(lw.name, "column"))
        or (isinstance(lw, Layout) and lw.var_at(0) is not None and len(lw.dims) == 1)
    ):
        split = 0  # each rank convolves its groups, reading their input channels of the whole input
        channels = DimVar(xs[1], lx.origins())
        w.out.local_slices.setdefault(node, []).append((x, 1, channels))
        out = _grouped_channels(w, node, lw, channels, groups, ws[0])
    elif channels is None:
        split = w_out
        if isinstance(lw, ParamView) and lw.dim_map[w_out] == w_out and w.allowed(lw.name, "column"):
            rows = DimVar(ws[w_out], frozenset({lw.name}))
            if groups > 1 and w_out == 0 and ws[0] % (groups * w.tp) == 0:  # each rank convolves a block of every group's rows
                rows = tile(DimVar(ws[0] // groups, frozenset({lw.name})), groups, describe(node))
            if groups == 1 or rows.segments is not None:
                w.param_view_shard(lw, w_out, rows, "column", node)
        out = w.concrete(weight, node).var_at(w_out)
        if out is not None and groups != 1 and not _group_cuts(ws[w_out], groups) <= _segment_cuts(out):
            raise ShardingConflict(f"{describe(node)}: a grouped convolution with output channels split across groups", w.get(weight).origins(), (out,))
    elif groups == xs[1] and ws[0] == xs[1] and (w_out == 0 or ws[1] == 1):
        split = 0
        if isinstance(lw, ParamView):
            w.param_view_shard(lw, 0, channels, "depthwise", node)
        lw = w.concrete(weight, node)
        if lw.var_at(0) is None:
            raise ShardingConflict(f"{describe(node)}: a depthwise weight kept whole meets split channels", channels.find().origins, (channels,))
        out = unify(lw.var_at(0), channels, describe(node))
    elif groups > 1 and w_out == 0 and ws[0] % groups == 0 and groups % w.tp and xs[1] % (groups * w.tp) == 0 and isinstance(lw, ParamView | Layout):
        return _within_groups(w, node, lw, channels, groups, bias)
    elif groups > 1 and w_out == 0 and ws[0] % groups == 0 and isinstance(lw, ParamView | Layout):
        split = 0
        out = _grouped_channels(w, node, lw, channels, groups, ws[0])
    elif groups == 1 and len(lx.dims) == 1 and (
        (isinstance(lw, ParamView) and lw.dim_map[w_in] == w_in and w.allowed(lw.name, "row"))
        or (isinstance(lw, Layout) and lw.var_at(w_in) is not None and len(lw.dims) == 1)
    ):
        return _row_parallel_convolution(w, node, lw, w_in, channels, bias)
    else:
        raise ShardingConflict(f"{describe(node)}: convolves split input channels across groups", lx.origins(), (channels,))
    if any(d != split for d, _ in w.concrete(weight, node).dims):
        raise ShardingConflict(f"{describe(node)}: the weight is split along a kernel dim", w.get(weight).origins())
    if isinstance(bias, Node):
        output_bias(w, node, bias, out)
    dims = {d: v for d, v in lx.dims if d == 0}
    if out is not None:
        dims[1] = out
    return shard(dims)


def _grouped_channels(w: Walker, node: Node, lw: ParamView | Layout, channels: DimVar, groups: int, out_channels: int) -> DimVar:
    """A grouped convolution over split input channels (ResNeXt's 3x3, a depthwise one with a channel
    multiplier): the split falls on whole groups, each rank convolving its groups' input channels into
    their output channels; input channels, output channels and the weight's rows follow one variable of
    the groups (``follow``), so tp must divide the groups."""
    where = describe(node)
    if groups % w.tp:
        raise ShardingConflict(f"{where}: {groups} groups do not stay whole on tp={w.tp} ranks", channels.find().origins, (channels,))
    per_group = DimVar(groups, channels.find().origins)
    follow(channels, per_group, where)
    if isinstance(lw, ParamView):
        rows = DimVar(out_channels, frozenset({lw.name}))
        follow(rows, per_group, where)
        w.param_view_shard(lw, 0, rows, "grouped", node)
    rows = w.concrete(node.args[1], node).var_at(0)
    if rows is None:
        raise ShardingConflict(f"{where}: a grouped convolution's weight kept whole meets split channels", channels.find().origins, (channels,))
    follow(rows, per_group, where)
    return rows


def _within_groups(w: Walker, node: Node, lw: ParamView | Layout, channels: DimVar, groups: int, bias: Any) -> Any:
    """A grouped convolution over split input channels whose groups tp does not divide (experts
    folded into the groups of a 1x1 convolution, fewer than the ranks): each group's channels
    are split alike, every rank holding a block of each, and the weight's input channels per
    group follow that block: row-parallel within the groups, a partial sum of every output."""
    size = channels.find().size
    per_group = DimVar(size // groups, channels.find().origins)
    unify(channels, tile(per_group, groups, describe(node)), describe(node))
    return _row_parallel_convolution(w, node, lw, 1, per_group, bias, channels)


def _group_cuts(size: int, groups: int) -> set[int]:
    return {k * size // groups for k in range(1, groups)}


def _segment_cuts(var: DimVar) -> set[int]:
    """The inner boundaries of ``var``'s segments, at every depth of segments cut again."""
    r, out, start = var.find(), set(), 0
    for seg in r.segments or ():
        out |= {start + c for c in _segment_cuts(seg)}
        start += seg.find().size
        out.add(start)
    out.discard(r.size)
    return out


def _row_parallel_convolution(w: Walker, node: Node, lw: ParamView | Layout, w_in: int, channels: DimVar, bias: Any,
                              input_channels: DimVar | None = None) -> Any:  # fmt: skip
    """A convolution over split input channels whose weight's input channels (per group)
    follow ``channels`` (the input's, ``input_channels``, where they differ), each rank's
    output a partial sum (Conformer's pointwise convolution after a channel-split depthwise
    one); a bias is added after the all-reduce."""
    if isinstance(lw, ParamView):
        w.param_view_shard(lw, w_in, channels, "row", node)
    else:
        unify(lw.var_at(w_in), channels, describe(node))  # type: ignore[arg-type]
    record_mask(w.out, node, node.args[0], 1, input_channels or channels)
    if not isinstance(bias, Node):
        return PARTIAL
    w.concrete(bias, node)
    if w.get(bias) != REPLICATE:
        raise ShardingConflict(f"{describe(node)}: bias of a row-parallel convolution is sharded", channels.find().origins)
    w.out.roles[node] = NodeRole.ROW_WITH_BIAS
    return REPLICATE
