"""Whether a forward keeps the rows of its batch apart, so that microbatches and data
parallelism compute what the whole batch computes.

``train_step`` splits the global batch over dp ranks and microbatches and averages their
losses and grads. That equals the whole batch's step only if no row's value depends on
another row's. A forward may break this: an expert that picks its best tokens from the
whole batch (``topk`` over tokens), a softmax over tokens, batch norm with batch
statistics. ``batch_mixing_node`` finds such an op by one more walk of the propagation
engine (``propagation.Walker``) in which no parameter is split and the batch dim of every
graph input is the only split: the walk tracks where the batch rows go through views,
matmuls and the rest, and an op in ``_MIXING`` that selects or normalizes along a dim
holding them mixes rows. Ordering ops (``sort``, ``argsort``, ``nonzero``, a ``cumsum``
of slot positions) only move rows and are not counted: their results index, they do not
weigh. Ops that read other rows than their own mix them: ``roll``, ``flip`` and cumulative
ops along the rows, ``cdist`` between rows, operands of a pointwise op holding the rows on
different dims once broadcast (``z[:, None] - z[None]``), and a gather along the rows by
indices made apart from them (a graph's edge list indexing its nodes, a fixed or random
permutation); ``x[arange(rows), i]`` reads each row's own. An accumulating scatter from the
rows into a tensor without them (messages summed into a graph's nodes) is a statistic over
rows. Pieces of the rows taken by slicing (``x[0]``, ``x.chunk(2)``, a shift by slices and
``cat``) are followed by ``row_pieces``: they mix rows unless put back in order. Where the walk
loses track of the rows otherwise (an op with no rule for a split there) it stops looking
downstream of it, so the check may miss a case. A lookup with ``scale_grad_by_freq`` mixes rows in
its backward: each table row's gradient is divided by its id's count over the whole batch, and so
do a bag's ``offsets`` into indices of every row (DLRM's ``EmbeddingBag`` inputs, which a piece's
slice does not rebase); so does a tensor hook (``custom_functions``) whose gradient change mixes
them (``grad / grad.norm()``), found by the same walk of the hook traced alone. A loss divided by a
statistic of the batch that ``loss_denominators`` could not make the whole batch's
(``labels.max()``) mixes rows too, and so does a buffer the forward updates from its own earlier
value (``carried_buffer_write``): each piece would read what the piece before it wrote.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from autotp.analysis.carried_buffers import carried_buffer_write
from autotp.analysis.custom_functions import hook_gradient_graph, tensor_hook
from autotp.analysis.dtensor_rules import dtensor_rule
from autotp.analysis.propagation import Walker
from autotp.analysis.row_pieces import REASSEMBLES, Piece, RowPieces
from autotp.analysis.row_statistics import statistic_meets_rows
from autotp.analysis.shape_rules import FOURIER, fourier_dims
from autotp.analysis.shapes import is_float, norm_dim, schema_arg, shape_of
from autotp.analysis.loss_denominators import per_piece_statistic, unnormalized_division
from autotp.ir.errors import describe
from autotp.ir.layouts import REPLICATE, DimVar, Layout, ShardingConflict, shard
from autotp.ir.op_facts import is_alias, is_pointwise, op_name

BATCH_ORIGIN = "<batch rows>"
# op name -> position of its dim argument and the default when it is absent
_SELECTING = {"topk": (2, -1), "kthvalue": (2, -1), "max": (1, None), "min": (1, None), "softmax": (1, None),
              "_softmax": (1, None), "log_softmax": (1, None), "_log_softmax": (1, None), "logsumexp": (1, None),
              "median": (1, None), "nanmedian": (1, None), "mode": (1, -1), "quantile": (2, None), "nanquantile": (2, None),
              "msort": (None, 0)}  # fmt: skip
_OVER_EVERYTHING = frozenset({"max", "min", "median", "nanmedian", "quantile", "nanquantile"})  # with no dim: over every element
_MATMULS = frozenset({"mm", "bmm", "matmul", "linear"})
_ADDED_MATMULS = frozenset({"addmm", "baddbmm", "addbmm"})
_INDEXED_BY_LIST = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)
_INDEXED_ALONG_DIM = (torch.ops.aten.index_select.default, torch.ops.aten.gather.default, torch.ops.aten.index_copy.default,
                      torch.ops.aten.index_copy_.default, torch.ops.aten.scatter.src, torch.ops.aten.scatter_.src)  # fmt: skip
_CONVOLUTIONS = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
_SHAPE_OF_SECOND = frozenset({"expand_as", "view_as", "reshape_as"})  # the second argument gives only a shape
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"})
_PAIRWISE = frozenset({"cosine_similarity", "pairwise_distance"})  # broadcasting, not tagged pointwise
_CLASS_LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"})
_BATCH_NORMS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"})
_TRAINING_ARG = 5
_FREQUENCY_SCALED = frozenset({"embedding", "embedding_bag", "_embedding_bag"})


class _BatchWalker(Walker):
    """The engine with each input's rows (``input_row_dims``; None: dim 0 where it has the
    batch's size) split over a batch var and every parameter whole."""

    def __init__(self, gm: GraphModule, batch: int, row_dims: list[int | None] | None,
                 made_rows: Mapping[str, tuple[int, ...]] = MappingProxyType({})) -> None:  # fmt: skip
        super().__init__(gm, 2, None, lambda name, kind, shape: False)  # any degree > 1 lets DTensor place a split
        self.batch = batch
        self.rows = DimVar(batch, frozenset({BATCH_ORIGIN}))
        self.made_rows = made_rows
        self.mixing: Node | None = None
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if row_dims is None:
            row_dims = [0 if (shape_of(n) or (None,))[0] == batch else None for n in inputs]
        self.input_rows = {n: d for n, d in zip(inputs, row_dims) if d is not None and d != UNKNOWN_ROWS}
        self.pieces = RowPieces(self._rows_at)

    def visit(self, node: Node) -> Any:
        if node.op == "placeholder":
            dim = self.input_rows.get(node)
            return REPLICATE if dim is None else shard({dim: self.rows})
        if node.op == "output" and self.mixing is None:
            self.mixing = self.pieces.reaching_output(node)
        if node.op != "call_function":
            return super().visit(node)
        made = self.made_rows.get(node.name) if not node.all_input_nodes else None
        if made is not None and len(made) == 1:
            return shard({made[0]: self.rows})
        piece = self.pieces.place(node)
        try:
            lay = self._rows_of(node, piece) if piece is not None else self._layout(node)
        except ShardingConflict:
            if self.mixing is None and self._pairs_unaligned(node):
                self.mixing = node
            raise
        rows = {d for l in (lay if isinstance(lay, tuple) else (lay,)) if isinstance(l, Layout) for d, v in l.dims if BATCH_ORIGIN in v.find().origins}
        if self.pieces.follow(node, rows) and self.mixing is None:
            self.mixing = node
        return lay

    def check_splits(self, node: Node, lay: Any) -> None:
        """Rows on two dims are rows paired with rows (a contrastive loss's similarities), which the walk follows."""

    def _layout(self, node: Node) -> Any:
        if node.target is operator.getitem:
            return super().visit(node)
        if self.mixing is None and self._mixes(node):
            self.mixing = node
        if op_name(node.target) == "scaled_dot_product_attention":
            return self._attention(node)
        if self._selects_rows(node):
            return shard({0: DimVar(self.batch, frozenset({BATCH_ORIGIN}))})
        derived = dtensor_rule(self, node)  # DTensor's strategies know batch-split inputs best
        return derived if derived is not None else super().visit(node)

    def _rows_of(self, node: Node, piece: Piece) -> Layout:
        """A piece put back holds all of its source's rows; one taken holds its own (tracked
        as rows where there are two or more on a kept dim)."""
        source = self.out.layouts.get(piece.source)
        var = source.var_at(piece.dim) if isinstance(source, Layout) else None
        if var is None:
            return REPLICATE
        if node.target in REASSEMBLES:
            return shard({piece.dim: var})
        return shard({piece.dim: DimVar(piece.rows, frozenset({BATCH_ORIGIN}))}) if piece.keeps_dim and (piece.rows or 0) > 1 else REPLICATE

    def _attention(self, node: Node) -> Layout:
        """Attention keeps its leading dims (batch, heads) apart: the output holds rows on a leading
        dim where any of query, key and value does (a learned query broadcast over the batch
        attending to each row's keys: an attention pooler), on its query positions where the
        query's positions are rows (a sequence-first batch transposed, a query per row attending to
        keys every row shares), and on its features where the value's features are."""
        q, k, v = node.args[:3]
        lead = len(shape_of(q) or ()) - 2
        mask = schema_arg(node, "attn_mask")
        offset = lead + 2 - len(shape_of(mask) or ()) if isinstance(mask, Node) else 0  # the mask broadcasts from the right
        mask_rows = {d + offset for d in self._rows_at(mask)} if isinstance(mask, Node) else set()
        rows = {d for d in self._rows_at(q) | self._rows_at(k) | self._rows_at(v) | mask_rows if d < lead}
        rows |= {lead} & (self._rows_at(q) | mask_rows) | {lead + 1} & self._rows_at(v)
        return shard({d: self.rows for d in rows})

    def _attention_mixes(self, node: Node) -> bool:
        """Each query weighs every key position and sums every feature of query and key: rows on
        the keys' or values' positions, on the query's or key's features, or on the mask's key
        positions meet each other there."""
        q, k, v = node.args[:3]
        lead = len(shape_of(q) or ()) - 2
        mask = schema_arg(node, "attn_mask")
        mask_rows = self._rows_at(mask) if isinstance(mask, Node) else set()
        mask_keys = len(shape_of(mask) or ()) - 1 if isinstance(mask, Node) else -1
        return bool({lead, lead + 1} & self._rows_at(k) or {lead + 1} & self._rows_at(q) or {lead} & self._rows_at(v)
                    or mask_keys in mask_rows)  # fmt: skip

    def _selects_rows(self, node: Node) -> bool:
        """``x[mask]`` by a boolean mask over x's leading dims, the first holding rows
        (``logits[labels != -100]``): each selected element stays in its row, so the result's
        dim 0 holds rows (of a size known at run time). Or ``x[arange(rows), i]`` (the last
        token of each row): row ``r`` reads row ``r``."""
        if node.target is torch.ops.aten.masked_select.default:  # elements in row-major order: grouped by row
            return 0 in self._rows_at(node.args[0]) or 0 in self._rows_at(node.args[1])
        if node.target is not torch.ops.aten.index.Tensor or not node.args[1] or not isinstance(node.args[1][0], Node):
            return False
        first, x = node.args[1][0], node.args[0]
        if 0 not in self._rows_at(x):
            return False
        if self._counts_rows(first, (shape_of(x) or (0,))[0]):
            return True
        val = first.meta.get("val")
        return len(node.args[1]) == 1 and isinstance(val, torch.Tensor) and val.dtype == torch.bool and 0 in self._rows_at(first)

    def _counts_rows(self, index: Node, rows: int) -> bool:
        """``index`` is ``arange(rows)`` (possibly unsqueezed or viewed to [rows, 1, ...])."""
        while index.op == "call_function" and is_alias(index) and isinstance(index.args[0], Node):
            index = index.args[0]
        if index.op != "call_function" or op_name(index.target) != "arange":
            return False
        args = [a for a in index.args if not isinstance(a, torch.dtype)]
        start, end, step = (0, args[0], 1) if len(args) == 1 else (*args[:2], args[2] if len(args) > 2 else 1)
        return (start, end, step) == (0, rows, 1)

    def _rows_at(self, arg: Any) -> set[int]:
        lay = self.out.layouts.get(arg) if isinstance(arg, Node) else None
        if not isinstance(lay, Layout):
            return set()
        return {d for d, v in lay.dims if BATCH_ORIGIN in v.find().origins}

    def _mixes(self, node: Node) -> bool:
        name = op_name(node.target)
        if not node.args:
            return False
        if name == "scaled_dot_product_attention":
            return self._attention_mixes(node)
        if name in _ADDED_MATMULS:  # input + m1 @ m2; addbmm sums its products over their dim 0 too
            m1, m2 = node.args[1], node.args[2]
            return self._matmul_mixes(node, m1, m2) or name == "addbmm" and bool(0 in self._rows_at(m1) | self._rows_at(m2))
        if name in _FREQUENCY_SCALED:  # an id's gradient over its count in the batch; a bag's offset counts the bags before it
            return bool(self._rows_at(node.args[1])) and schema_arg(node, "scale_grad_by_freq", False) or bool(self._rows_at(schema_arg(node, "offsets")))
        if tensor_hook(node) is not None:
            return self._hook_mixes(node)
        rows = self._rows_at(node.args[0])
        if not rows or not is_float(node.args[0]):  # integer bookkeeping (the longest row's length) sizes, it does not weigh
            return False
        if name == "cumsum" and _only_counts(node):  # slot positions counted in floats
            return False
        shape = shape_of(node.args[0]) or ()
        if self._addresses_rows(node, rows, len(shape)) or self._runs_along_rows(node, rows, len(shape)) or self._pairs_by_broadcast(node):
            return True
        if name in _BATCH_NORMS:
            training = node.args[_TRAINING_ARG] if len(node.args) > _TRAINING_ARG else node.kwargs.get("training", False)
            return bool(training) and bool(rows - {1})
        if name in _MATMULS or name == "cdist":
            return self._matmul_mixes(node, node.args[0], node.args[1])
        if name in _CLASS_LOSSES:  # a softmax over dim 1, the classes (dim 0 of one sample's logits)
            return (1 if len(shape) > 1 else 0) in rows
        if name in _NORMALIZING:
            return bool(_normalized_dims(node, name, len(shape)) & rows)
        if name == "sort" and any(u.target is operator.getitem and u.args[1] == 0 and u.users for u in node.users):  # its values, not only its order
            return norm_dim(schema_arg(node, "dim", -1), len(shape)) in rows
        if name not in _SELECTING:
            return False
        pos, default = _SELECTING[name]
        dim = node.args[pos] if pos is not None and len(node.args) > pos else node.kwargs.get("dim", default)
        if dim is None:  # over everything (max(), median()), or a name _SELECTING lists without a dim here
            return name in _OVER_EVERYTHING and len(node.args) <= (2 if name.endswith("quantile") else 1)
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        if not all(isinstance(d, int) for d in dims):  # max/min of two tensors: pointwise
            return False
        return any(norm_dim(d, len(shape)) in rows for d in dims)

    def _hook_mixes(self, node: Node) -> bool:
        """A tensor hook whose gradient change mixes the rows its tensor holds (a norm over the whole
        gradient): each piece of a split batch would change its own rows' gradient alone."""
        rows = self._rows_at(node.args[0][0])
        if not rows:
            return False
        changed = hook_gradient_graph(node)
        return changed is None or len(rows) > 1 or bool(batch_mixing_node(changed, self.batch, [min(rows)]))

    def _addresses_rows(self, node: Node, rows: set[int], rank: int) -> bool:
        """A gather (or a write: ``y[perm] = x``, ``index_copy``, ``scatter``) along a dim holding
        the rows by indices made without reference to the rows (a graph's edge list indexing its
        nodes, ``h[src]``; a fixed or random permutation, mixup's ``x[randperm(b)]``): a row's
        result is whichever row the index names. Indices made from
        the rows' own values (an MoE's sorted tokens) only move rows; ``arange(rows)`` reads
        each row's own."""
        if node.target in _INDEXED_BY_LIST:
            indexed = [(d, i) for d, i in enumerate(node.args[1]) if isinstance(i, Node)]
        elif node.target in _INDEXED_ALONG_DIM:
            indexed = [(norm_dim(node.args[1], rank), node.args[2])]
        elif node.target is torch.ops.aten.take.default:  # the flattened tensor: every dim at once
            indexed = [(d, node.args[1]) for d in rows]
        else:
            return False
        shape = shape_of(node.args[0]) or ()
        return any(d in rows and not self._counts_rows(index, shape[d]) and self._apart_from_rows(index) for d, index in indexed)

    def _apart_from_rows(self, node: Node) -> bool:
        """Whether neither ``node`` nor anything it is computed from holds the rows."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if self._rows_at(n):
                return False
            stack.extend(n.args[:1] if n.op == "call_function" and op_name(n.target) in _SHAPE_OF_SECOND else n.all_input_nodes)
        return True

    def _runs_along_rows(self, node: Node, rows: set[int], rank: int) -> bool:
        """``roll``, ``flip``, a cumulative op (``cumsum``, ``cummax``, ...), windows (``unfold``
        of more than one row), a Fourier transform or a convolution's kernel of more than one element along a dim
        holding the rows, or padding that adds rows: each row's result reads its neighbours (or
        the rows of a piece of the batch count other padding)."""
        name = op_name(node.target)
        if name in ("roll", "flip"):
            dims = schema_arg(node, "dims", ())
        elif name in _CUMULATIVE:
            dims = (schema_arg(node, "dim", 0),)
        elif name == "unfold" and schema_arg(node, "size", 1) > 1:
            dims = (schema_arg(node, "dimension", 0),)
        elif name in ("constant_pad_nd", "pad"):
            pads = list(schema_arg(node, "pad", ()))
            dims = tuple(rank - 1 - i // 2 for i, p in enumerate(pads) if p != 0)
        elif name in _CONVOLUTIONS:
            kernel = shape_of(node.args[1]) or ()
            dims = tuple(2 + i for i, k in enumerate(kernel[2:]) if k != 1)
        elif name in FOURIER:
            dims = tuple(fourier_dims(node))
        else:
            return False
        return any(norm_dim(d, rank) in rows for d in (dims if isinstance(dims, (list, tuple)) else (dims,)))

    def _pairs_by_broadcast(self, node: Node) -> bool:
        """Operands holding the rows on different dims once broadcast (``z[:, None] - z[None]``,
        ``cosine_similarity(z[:, None], z[None])``): every row is paired with every other."""
        if not (is_pointwise(node.target) or isinstance(node.target, torch._ops.OpOverload) and op_name(node.target) in _PAIRWISE):
            return False
        rank = len(shape_of(node) or ())
        aligned = set()
        for a in node.all_input_nodes:
            shape = shape_of(a)
            if shape is not None and is_float(a):
                aligned |= {d + rank - len(shape) for d in self._rows_at(a)}
        return len(aligned) > 1

    def _pairs_unaligned(self, node: Node) -> bool:
        """Float operands of a pointwise op whose rows the walk cannot line up (TimeMixer's series flattened
        batch-major, ``reshape(B * N, T, 1)``, added to their time features tiled, ``repeat(N, 1, 1)``): a row
        meets another sample's."""
        if not is_pointwise(node.target):
            return False
        holding = [a for a in node.all_input_nodes if is_float(a) and self._rows_at(a)]
        # rows of a size known only at run time (a boolean mask's selection) are lined up at run time
        return len(holding) > 1 and all(isinstance(a.meta["val"].shape[d], int) for a in holding for d in self._rows_at(a))

    def _matmul_mixes(self, node: Node, a: Any, b: Any) -> bool:
        """A matmul (or ``cdist``) of ``a`` and ``b`` mixes rows where it sums over them (a row dim
        contracted: a Gram matrix over the batch) or pairs rows of one operand with rows of the other
        anywhere but on the batch dims they share (``image @ text.t()``, a contrastive loss's logits)."""
        sa, sb = shape_of(a) or (), shape_of(b) or ()
        ra, rb = self._rows_at(a), self._rows_at(b)
        linear = op_name(node.target) in ("linear", "cdist")  # b is [n, k]
        contracted = (len(sa) - 1 in ra, (len(sb) - 1 if linear or len(sb) == 1 else len(sb) - 2) in rb)
        if all(contracted) and op_name(node.target) != "cdist":
            return False  # each row with itself, summed: a statistic over the rows (``_contracts_rows``)
        if any(contracted):
            return True
        if len(sa) < 2 or len(sb) < 2 or not (ra and rb):  # a vector's other operand keeps its rows where they are
            return False
        lead = max(len(sa), len(sb)) - 2  # batch dims, aligned from the right
        shared_a = {d + lead - (len(sa) - 2) for d in ra if d < len(sa) - 2}
        shared_b = {d + lead - (len(sb) - 2) for d in rb if d < len(sb) - 2}
        return len(shared_a) != len(ra) or len(shared_b) != len(rb) or shared_a != shared_b


_NORMALIZING = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm", "instance_norm"})


def _normalized_dims(node: Node, name: str, rank: int) -> set[int]:
    """The dims a norm takes its statistics over: the trailing ``normalized_shape`` of a layer
    or RMS norm; every dim past the batch of a group norm; every dim past the channels of an instance norm."""
    if name.endswith("group_norm"):
        return set(range(1, rank))
    if name == "instance_norm":
        return set(range(2, rank))
    return set(range(rank - len(schema_arg(node, "normalized_shape", ())), rank))


def batch_size(call: dict[str, Any], batch_dims: Mapping[str, int] = MappingProxyType({})) -> int:
    """The rows a split step cuts: the size of the dim ``batch_dims`` (``ParallelPlan.input_batch_dims``)
    names for an input, else the dim 0 that most tensors of ``call`` with a dim share (nested
    ones included; of equals, the first). A tensor of another length (gpt-fast's ``input_pos``)
    is every row's."""
    leaves = tree_flatten_with_path(call)[0]
    named = [v.shape[batch_dims[keystr(p)]] for p, v in leaves if batch_dims.get(keystr(p), UNKNOWN_ROWS) != UNKNOWN_ROWS]
    if named:
        return named[0]
    sizes = [v.shape[0] for _, v in leaves if isinstance(v, torch.Tensor) and v.dim() > 0]
    return max(sizes, key=sizes.count) if sizes else 0


UNKNOWN_ROWS = -1
"""An input's entry in ``ParallelPlan.input_batch_dims`` when the trace could not tell which
of its dims holds the batch's rows: a split step is refused."""


def input_row_dims(call: dict[str, Any], batch_dims: Mapping[str, int] = MappingProxyType({})) -> list[int | None]:
    """Per leaf of ``call``, in pytree order (that of the traced graph's inputs): the dim that
    holds the batch's rows. ``batch_dims`` (``ParallelPlan.input_batch_dims``) names inputs whose
    rows lie elsewhere than dim 0 (Qwen2-VL's ``position_ids`` [3, B, S]: dim 1); any other tensor
    holds them on dim 0 where it has the batch's size (``batch_size``), or is every row's (None)."""
    size = batch_size(call, batch_dims)
    dims: list[int | None] = []
    for path, value in tree_flatten_with_path(call)[0]:
        given = batch_dims.get(keystr(path))
        if given is not None:
            dims.append(given)
        else:
            dims.append(0 if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size else None)
    return dims


def batch_rows_at(gm: GraphModule, batch: int, row_dims: list[int | None],
                  made_rows: Mapping[str, tuple[int, ...]] = MappingProxyType({})) -> Callable[[Node], set[int]]:  # fmt: skip
    """Where each node of ``gm`` holds the rows of its batch of ``batch`` rows (its dims), the
    graph's inputs holding them at ``row_dims`` (``input_row_dims``) and the tensors made from
    none (``torch.ones(b, n)``) at ``made_rows[name]``."""
    walker = _BatchWalker(gm, batch, row_dims, made_rows)
    walker.run()
    return walker._rows_at


def batch_mixing_node(gm: GraphModule, batch: int, row_dims: list[int | None] | None = None) -> str:
    """The op of ``gm`` that makes a row's value depend on other rows of its batch of
    ``batch`` rows (on the inputs' ``row_dims``; None: dim 0 of those of ``batch`` rows),
    described; "" when none is found."""
    return batch_mixing_verdict(gm, batch, row_dims)[0] if batch >= 2 else ""


def batch_verdicts(gm: GraphModule, batch: int, row_dims: list[int | None] | None = None) -> tuple[str, str, tuple[int | None, ...]]:
    """``batch_mixing_node``; where none, the loss term computed per piece (``per_piece_statistic``);
    and per leaf of the outputs, the dim holding the rows (``output_row_dims``)."""
    if batch < 2:
        return "", "", ()
    mixing, rows_at = batch_mixing_verdict(gm, batch, row_dims)
    return mixing, "" if mixing else per_piece_statistic(gm, rows_at), output_row_dims(gm, batch, rows_at)


def rows_past_dim0(gm: GraphModule, call: dict[str, Any]) -> tuple[dict[str, int], tuple[str, str, tuple[int | None, ...]]] | None:
    """Where the forward mixes the rows of dim 0, a sequence-first batch (``nn.Transformer``'s
    default [S, B, D]): the rows on dim 1 of each input of two or more dims whose dim 1 has the
    size most of them share there (an input of that size on dim 0 alone, a batch-first mask,
    keeps them on dim 0), with ``batch_verdicts`` under them, if the walk finds those rows never
    mix and follows them into every output with a dim (a walk that lost them, at an op without a
    rule for rows, proves nothing; nor does a loss computed inside the forward); else None."""
    leaves = tree_flatten_with_path(call)[0]
    sizes = [v.shape[1] for _, v in leaves if isinstance(v, torch.Tensor) and v.dim() > 1]
    size = max(sizes, key=sizes.count) if sizes else 0
    if size < 2:
        return None
    dims = {keystr(p): 1 for p, v in leaves if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == size}
    mixing, rows_at = batch_mixing_verdict(gm, size, input_row_dims(call, dims))
    outputs = [x for x in tree_flatten(next(iter(gm.graph.find_nodes(op="output"))).args[0])[0] if isinstance(x, Node) and shape_of(x)]
    if mixing or not outputs or not all(rows_at(x) for x in outputs):
        return None
    return dims, (mixing, per_piece_statistic(gm, rows_at), output_row_dims(gm, size, rows_at))


def output_row_dims(gm: GraphModule, batch: int, rows_at: Callable[[Node], set[int]]) -> tuple[int | None, ...]:
    """Per leaf of ``gm``'s outputs (pytree order), the first dim holding the batch's rows; where the
    walk lost them (an op it has no rule for), dim 0 if that has the batch's size; else None."""
    output = next(iter(gm.graph.find_nodes(op="output")))

    def dim(leaf: Any) -> int | None:
        if not isinstance(leaf, Node):
            return None
        shape = shape_of(leaf) or ()
        return min(rows_at(leaf), default=0 if shape and shape[0] == batch else None)

    return tuple(dim(leaf) for leaf in tree_flatten(output.args[0])[0])


def batch_mixing_verdict(gm: GraphModule, batch: int, row_dims: list[int | None] | None) -> tuple[str, Callable[[Node], set[int]]]:
    """``batch_mixing_node`` of ``gm`` with its inputs' rows at ``row_dims``, and where each node holds them."""
    walker = _BatchWalker(gm, batch, row_dims)
    walker.run()
    return _mixing_node(gm, walker), walker._rows_at


def _mixing_node(gm: GraphModule, walker: _BatchWalker) -> str:
    if division := unnormalized_division(gm, walker._rows_at):
        return f"{division}, which divides by a statistic of the whole batch"
    if walker.mixing is not None:
        return describe(walker.mixing)
    if (meeting := statistic_meets_rows(gm, walker._rows_at)) is not None:
        return f"{describe(meeting[0])}, where a statistic over the batch's rows ({describe(meeting[1])}) meets each row's values"
    if (carried := carried_buffer_write(gm)) is not None:
        return f"{describe(carried[0])}, which updates buffer {carried[1]} from its value before the forward (each piece of a split batch would read what the piece before it wrote)"
    return ""


def _only_counts(node: Node) -> bool:
    """Whether every value computed from ``node``'s float result is made an integer or a boolean
    before anything reads it as a float (GShard's slot positions ``(onehot.cumsum(0) - 1) *
    onehot`` taken ``.long()``): positions, which move rows but do not weigh them."""
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if user.op != "call_function":
                return False  # the float reaches the graph's output
            if user not in seen and (is_float(user) or isinstance(user.meta.get("val"), (tuple, list))):
                seen.add(user)
                stack.append(user)
    return True
