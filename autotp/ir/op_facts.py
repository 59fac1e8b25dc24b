"""Facts about the ops in a graph, in one place: what kind of computation a node is, which
ops alias their input (read from the op schemas), and the kinds of collective.

**Kinds of computation** (``op_kind``): a matmul, a grouped (MoE expert) matmul,
attention, an embedding lookup, or anything else. Names are matched, not overloads, so
that every overload of ``aten.mm`` and custom ops registered by libraries that may not be
loaded (``transformers::grouped_mm_fallback``) are recognized: a target is a *grouped
matmul* if its name contains ``grouped_mm`` (``aten._grouped_mm`` too).

**Pointwise** (``is_pointwise``): tagged ``torch.Tag.pointwise``, or untagged with a
``torch._decomp`` decomposition made of such ops alone (``hardswish``, ``_prelu_kernel``).

**Aliasing**, from the schema's alias annotations (``Tensor(a) self -> Tensor(a)``):

* ``is_view``: the output is a view of the first input and no data moves: every op whose
  schema returns an alias of an input without writing it, except ``contiguous`` and the
  dtype/device conversions (``to``), which exist to copy and alias only when there is
  nothing to do; plus ``operator.getitem`` (an element of a tuple), ``_unsafe_view`` (a
  view its schema hides) and autotp's identities (``ops.IDENTITIES``). The reshape-likes
  among them (``copies_if_strided``: ``reshape``, ``reshape_as``, ``flatten``, and
  ``contiguous``) copy an input whose strides they cannot view: one made by a view that
  ``strides_output`` (transpose, permute, expand, slices...).
* ``is_inplace`` / ``mutated_base`` / ``view_root``: in-place writes and the tensor they
  write, traced back through views.
* ``is_reshape``: the ops that change a shape keeping the element order (``view``,
  ``reshape``, ``_unsafe_view``), which sequence parallelism and tp overlap move around.

**Collectives.** ``Collective`` is a communication pattern (what the cost model times and
``autotp explain`` counts); ``CollectiveTag`` is what an inserted collective node does (the
value of ``meta_keys.COLLECTIVE``), and ``TAG_COMMUNICATION`` the communication each tag
costs, forward and backward.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from enum import Enum, StrEnum
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.fx import Node

from autotp.ir import ops

aten = torch.ops.aten

MATMUL_NAMES = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "all_gather_matmul", "matmul_reduce_scatter",
                          "linear_cross_entropy", "fp8_linear"})  # fmt: skip
ATTENTION_NAMES = frozenset({"scaled_dot_product_attention", "tp_attention_dropout"})
EMBEDDING_NAMES = frozenset({"embedding", "vocab_parallel_embedding"})
# input channels are dim 1 of the input; the bias is argument 2
CONVOLUTIONS = frozenset({
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
})  # fmt: skip
_TRANSPOSED_CONVOLUTIONS = frozenset({aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input})


def is_transposed_convolution(node: Node) -> bool:
    """A convolution whose weight is stored [in, out / groups, *kernel] (the others: [out, in / groups, *kernel])."""
    if node.target in _TRANSPOSED_CONVOLUTIONS:
        return True
    return node.target is aten.convolution.default and bool(node.args[6] if len(node.args) > 6 else node.kwargs.get("transposed", False))


class OpKind(Enum):
    MATMUL = "matmul"
    GROUPED_MATMUL = "grouped_matmul"
    ATTENTION = "attention"
    EMBEDDING = "embedding"
    OTHER = "other"

    @property
    def is_matmul(self) -> bool:
        """Dense or grouped."""
        return self in (OpKind.MATMUL, OpKind.GROUPED_MATMUL)


_ELEMENTWISE_HELPERS = frozenset({aten.scalar_tensor.default, aten.full.default, aten._to_copy.default, aten.clone.default})


def is_pointwise(target: Any) -> bool:
    """Whether an op computes each output element from the same element of its (broadcast)
    inputs: tagged ``torch.Tag.pointwise``, or not tagged but decomposed by ``torch._decomp``
    into such ops alone (``hardswish``, ``_prelu_kernel``), which PyTorch leaves untagged."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target in _POINTWISE_UNTAGGED or _pointwise_by_decomposition(target)


# each complex element made from the same elements of its two real inputs (FEDformer's ``torch.complex(w_re, w_im)``
# weights); PyTorch tags neither and decomposes neither
_POINTWISE_UNTAGGED = frozenset({torch.ops.aten.complex.default, torch.ops.aten.polar.default})


@functools.cache
def _pointwise_by_decomposition(target: torch._ops.OpOverload) -> bool:
    from torch._decomp import decomposition_table
    from torch.fx.experimental.proxy_tensor import make_fx

    decompose = decomposition_table.get(target)
    if decompose is None or torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
        return False
    args: list[Any] = []
    for arg in target._schema.arguments:
        if arg.kwarg_only or arg.has_default_value():
            break
        kind = str(arg.type)
        if kind == "Tensor":
            args.append(torch.ones(4))
        elif kind in ("Scalar", "float"):
            args.append(1.0)
        else:
            return False
    try:
        body = make_fx(decompose)(*args)
    except Exception:  # noqa: BLE001 - a decomposition that cannot run on these arguments: not known pointwise
        return False
    return all(torch.Tag.pointwise in n.target.tags or n.target in _ELEMENTWISE_HELPERS
               for n in body.graph.nodes if n.op == "call_function")  # fmt: skip


def op_name(target: Any) -> str:
    """Short name of a call target: ``linear`` for ``aten.linear.default``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def is_grouped_matmul(target: Any) -> bool:
    return "grouped_mm" in str(target)


def op_kind(target: Any) -> OpKind:
    """The kind of a call target (a node's ``target``)."""
    name = op_name(target)
    if name in MATMUL_NAMES:
        return OpKind.MATMUL
    if is_grouped_matmul(target):
        return OpKind.GROUPED_MATMUL
    if name in ATTENTION_NAMES:
        return OpKind.ATTENTION
    if name in EMBEDDING_NAMES:
        return OpKind.EMBEDDING
    return OpKind.OTHER


def is_matmul(node: Node) -> bool:
    """A matmul of either kind (dense or grouped) in a ``call_function`` node."""
    return node.op == "call_function" and op_kind(node.target).is_matmul


# ---- aliasing -------------------------------------------------------------------------

_CONVERSIONS = frozenset({"to", "_to_copy", "type_as"})
_COPIES_IF_STRIDED = frozenset({"reshape", "reshape_as", "flatten", "contiguous"})
_STRIDES_OUTPUT = frozenset({
    "expand", "expand_as", "broadcast_to", "transpose", "t", "permute", "numpy_T", "mT", "slice", "select",
    "narrow", "as_strided",
})  # fmt: skip
_RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def _returned_alias(target: Any) -> Any:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    return schema.returns[0].alias_info


def draws_random(node: Node) -> bool:
    """Whether ``node`` draws from a random generator: an op tagged ``nondeterministic_seeded``
    (``rand``, ``bernoulli``, dropout, attention with dropout, an RNN's dropout between
    layers...) unless its arguments turn the draw off: ``train=False``, or a dropout
    probability (``p``, ``dropout_p``, ``dropout``) of 0."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    schema = {a.name: (i, a.default_value) for i, a in enumerate(target._schema.arguments)}

    def arg(name: str) -> Any:
        i, default = schema[name]
        return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)

    if "train" in schema and arg("train") is False:
        return False
    return all(arg(p) != 0 for p in ("p", "dropout_p", "dropout") if p in schema)


def is_inplace(target: Any) -> bool:
    """An op that writes its first input and returns it (``add_``, ``index_put_``, ``copy_``)."""
    info = _returned_alias(target)
    return info is not None and info.is_write


def is_conversion(target: Any) -> bool:
    """A dtype/device conversion: it aliases its input when neither changes, else copies."""
    return op_name(target) in _CONVERSIONS


def copies_if_strided(target: Any) -> bool:
    """A reshape-like that copies an input it cannot view (one ``strides_output`` made)."""
    return op_name(target) in _COPIES_IF_STRIDED


def strides_output(target: Any) -> bool:
    """A view whose output is not contiguous in general (a transpose, an expand, a slice)."""
    return op_name(target) in _STRIDES_OUTPUT


def is_view(target: Any) -> bool:
    """Whether the op's output is a view of its first input (module docstring)."""
    if target is operator.getitem or target is aten._unsafe_view.default or target in ops.IDENTITIES:
        return True
    info = _returned_alias(target)
    if info is None or info.is_write:
        return False
    name = op_name(target)
    return name != "contiguous" and name not in _CONVERSIONS


def is_reshape(target: Any) -> bool:
    """``view``, ``reshape`` or ``_unsafe_view``: the same elements, in order, in another shape."""
    return target in _RESHAPES


def functional_variant(target: Any) -> torch._ops.OpOverload | None:
    """The out-of-place op of an in-place one (``masked_fill_.Scalar`` -> ``masked_fill.Scalar``):
    the same values, written into its first argument. PyTorch tags some in-place variants
    ``pointwise`` and leaves others untagged (``masked_fill_``, ``gelu_``)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None) if target.namespace == "aten" else None
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    return overload if isinstance(overload, torch._ops.OpOverload) and not overload._schema.is_mutable else None


def mutated_base(node: Node) -> Node | None:
    """The tensor an in-place op writes, traced back through views to the node that made it."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable or not node.args or not isinstance(node.args[0], Node):
        return None
    return view_root(node.args[0])


def writes_by_base(nodes: Iterable[Node]) -> dict[Node, list[Node]]:
    """The in-place writes among ``nodes``, under the node that made the tensor each writes (``mutated_base``)."""
    writes: dict[Node, list[Node]] = {}
    for n in nodes:
        base = mutated_base(n) if n.op == "call_function" else None
        if base is not None:
            writes.setdefault(base, []).append(n)
    return writes


def view_root(node: Node) -> Node:
    """The node that made the tensor ``node`` is, through any chain of views and in-place ops
    (which return the tensor they write); ``node`` itself if it is neither."""
    while is_alias(node):
        node = node.args[0]
    return node


def is_alias(node: Node) -> bool:
    """Whether ``node``'s result may be (a view of) its first argument: a view or an in-place op,
    unless the trace shows it made a copy (``reshape`` of a permuted tensor, ``contiguous``)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    return _returned_alias(node.target) is not None and not _copied(node.args[0], node)


def _copied(source: Node, result: Node) -> bool:
    """Whether the traced values of ``source`` and ``result`` are tensors in different storages."""
    a, b = source.meta.get("val"), result.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    try:
        return StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, nested)
        return False


# ---- collectives ----------------------------------------------------------------------


class Collective(StrEnum):
    """A communication pattern (members are strings: ``Collective.ALL_REDUCE == "all_reduce"``)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


class Direction(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


class CollectiveTag(StrEnum):
    """What an inserted collective node does: the value of ``meta_keys.COLLECTIVE``."""

    ALL_REDUCE = "all_reduce"  # g (reduce_from_tp): all-reduce forward
    ALL_REDUCE_BACKWARD = "all_reduce_backward"  # f (copy_to_tp): all-reduce of the gradient
    ALL_GATHER = "all_gather"  # gather_from_tp: all-gather forward
    REDUCE_SCATTER = "reduce_scatter"  # sequence parallelism: g's replacement
    SEQUENCE_ALL_GATHER = "sequence_all_gather"  # sequence parallelism: f's replacement
    SCATTER = "scatter"  # a whole-sequence operand sliced to this rank's tokens
    ALL_GATHER_MATMUL = "all_gather_matmul"  # tp overlap: the all-gather runs behind the GEMM
    MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"  # tp overlap: the reduce-scatter runs behind the GEMM
    FP8_ALL_GATHER = "fp8_all_gather"  # an fp8_linear all-gathers its FP8 input (reduce-scatters its grad)


@dataclass(frozen=True)
class Communication:
    """One collective a tagged node runs: its pattern, its direction, and whether a GEMM hides it."""

    collective: Collective
    direction: Direction
    overlapped: bool = False


_FWD, _BWD = Direction.FORWARD, Direction.BACKWARD
TAG_COMMUNICATION: dict[CollectiveTag, tuple[Communication, ...]] = {
    CollectiveTag.ALL_REDUCE: (Communication(Collective.ALL_REDUCE, _FWD),),
    CollectiveTag.ALL_REDUCE_BACKWARD: (Communication(Collective.ALL_REDUCE, _BWD),),
    CollectiveTag.ALL_GATHER: (Communication(Collective.ALL_GATHER, _FWD),),
    CollectiveTag.REDUCE_SCATTER: (Communication(Collective.REDUCE_SCATTER, _FWD), Communication(Collective.ALL_GATHER, _BWD)),
    CollectiveTag.SEQUENCE_ALL_GATHER: (Communication(Collective.ALL_GATHER, _FWD), Communication(Collective.REDUCE_SCATTER, _BWD)),
    CollectiveTag.SCATTER: (Communication(Collective.ALL_GATHER, _BWD),),
    CollectiveTag.ALL_GATHER_MATMUL: (
        Communication(Collective.ALL_GATHER, _FWD, True), Communication(Collective.REDUCE_SCATTER, _BWD, True),
    ),
    CollectiveTag.MATMUL_REDUCE_SCATTER: (
        Communication(Collective.REDUCE_SCATTER, _FWD, True), Communication(Collective.ALL_GATHER, _BWD, True),
    ),
    # FP8 bytes forward, the model's dtype backward: graph_costs sizes each direction itself
    CollectiveTag.FP8_ALL_GATHER: (Communication(Collective.ALL_GATHER, _FWD), Communication(Collective.REDUCE_SCATTER, _BWD)),
}  # fmt: skip
