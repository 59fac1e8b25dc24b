"""The layout rule of an aten op that ``op_rules`` has no rule for, derived from the
sharding strategy PyTorch registers for DTensor.

DTensor's ``ShardingPropagator`` knows, for nearly every aten op, which output placement
follows from given input placements and whether inputs must move first. Each input's
layout becomes a placement on a one-dim mesh of tp devices (a sharded dim is
``Shard(d)``, a partial input is all-reduced first and a replicated one is
``Replicate()``); the op's own arguments go unchanged. The derived layout is used only
when DTensor moves nothing and every sharded output dim has the size of the sharded
input dims it comes from, so the op maps each index along that dim to itself: the
split then holds for autotp's segmented and block splits too, not only DTensor's even
chunks. A partial output, an op whose arguments name sizes (which the rank graph would
need rewritten) and anything DTensor cannot place leave the op opaque. Negative dims are
normalized and the strategy's ``RuntimeSchemaInfo`` passed, as DTensor's dispatcher does
(without it the propagator's cache ignores the dims; ``scan_strategy`` of torch 2.13 would
keep ``cumsum(x, -1)`` split along -1).
``docs/propagation.md`` gives the coverage that led to this split of work.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.analysis.shapes import replicated_like, shape_of, size_int
from autotp.ir.errors import describe
from autotp.ir.layouts import REPLICATE, DimVar, Layout, ShardingConflict, shard, unify

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

_DIM_ARGS = frozenset({"dim", "dims"})
_INSERTS_DIM = frozenset({torch.ops.aten.unsqueeze.default})  # ``dim`` counts the output's dims


@functools.cache
def _propagator() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


@functools.cache
def _mesh(tp: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)


def has_strategy(target: Any) -> bool:
    """Whether DTensor registers a sharding strategy or rule for ``target``."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    prop = _propagator()
    tables = (prop.op_strategy_funcs, prop.op_to_rules, getattr(prop, "op_single_dim_strategy_funcs", {}))
    return any(target in t for t in tables)


def _names_sizes(target: torch._ops.OpOverload) -> bool:
    """Whether an argument is a list of sizes (``view(x, [2, 16, -1])``) rather than dims."""
    for arg in target._schema.arguments:
        text = str(arg.type)
        if arg.name not in _DIM_ARGS and ("List[int]" in text or "SymInt" in text and "List" in text):
            return True
    return False


def dtensor_rule(w: Walker, node: Node) -> Any:
    """The layout DTensor's strategy derives for ``node``, or None (treat it as opaque)."""
    target = node.target
    if w.tp < 2 or not has_strategy(target) or _names_sizes(target):
        return None
    inputs = [a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]
    lays = {a: w.concrete(a, node) for a in inputs}
    if any(l.partial for l in lays.values()):
        w.reduce_first(node, inputs)
        lays = {a: REPLICATE if l.partial else l for a, l in lays.items()}
    if all(l.replicated for l in lays.values()):
        return replicated_like(node)
    if any(len(l.dims) > 1 for l in lays.values()):
        return None
    try:
        with _meta_failures_unlogged():
            outputs = _propagate(target, node, lays, w.tp)
    except Exception:  # noqa: BLE001 - a strategy that cannot place these inputs: opaque
        return None
    if outputs is None:
        return None
    sharded = [l.dims[0][1] for l in lays.values() if l.dims]
    result = []
    for shape, placement in outputs:
        if placement is None:
            result.append(REPLICATE)
            continue
        if placement == "partial":
            return None
        vars_ = [v for v in sharded if v.find().size == shape[placement]]
        if len(vars_) != len(sharded):
            raise ShardingConflict(f"{describe(node)}: DTensor's strategy changes the size of a sharded dim", frozenset().union(*(v.find().origins for v in sharded)), tuple(sharded))
        var: DimVar = vars_[0]
        for other in vars_[1:]:
            var = unify(var, other, describe(node))
        result.append(shard({placement: var}))
    val = node.meta.get("val")
    return tuple(result) if isinstance(val, (tuple, list)) else result[0]


def _drop_record(record: logging.LogRecord) -> bool:
    return False


@contextmanager
def _meta_failures_unlogged() -> Iterator[None]:
    """FakeTensor logs each meta kernel that fails, with its traceback, as an error; here a
    failure only leaves the op opaque (shapes holding ``UNBACKED_SIZE`` where the trace had a
    size known only at run time do not broadcast)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addFilter(_drop_record)
    try:
        yield
    finally:
        logger.removeFilter(_drop_record)


def _propagate(target: torch._ops.OpOverload, node: Node, lays: dict[Node, Layout], tp: int) -> list[tuple[tuple[int, ...], Any]] | None:
    """Output (shape, placement) pairs: a sharded dim, None (replicated) or ``"partial"``;
    None when DTensor would redistribute an input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema

    mesh = _mesh(tp)

    def spec(a: Any) -> Any:
        if not isinstance(a, Node):
            return a
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"{a.name} is not a tensor")
        lay = lays[a]
        placement = Shard(lay.dims[0][0]) if lay.dims else Replicate()
        meta = TensorMeta(torch.Size(shape_of(a) or ()), val.stride() if not _symbolic(val) else _contiguous(shape_of(a) or ()), val.dtype)
        return DTensorSpec(mesh, (placement,), meta)

    args = torch.utils._pytree.tree_map(spec, _dims_normalized(target, node.args))
    kwargs = torch.utils._pytree.tree_map(spec, node.kwargs)
    prop = _propagator()
    # the strategy's static arguments (dims) are part of its cache key only with schema_info
    info = prop.op_to_schema_info.get(target) or getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(target)
    out = prop.propagate_op_sharding(OpSchema(target, args, kwargs, schema_info=info))
    if out.needs_redistribute:
        return None
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else (out.output_spec,)
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    result = []
    for s, v in zip(specs, vals):
        if s is None or not isinstance(v, torch.Tensor):
            result.append(((), None))
            continue
        (p,) = s.placements
        shape = tuple(size_int(x) for x in v.shape)
        result.append((shape, p.dim if p.is_shard() else "partial" if p.is_partial() else None))
    return result


def _dims_normalized(target: torch._ops.OpOverload, args: tuple) -> tuple:
    """``args`` with negative ``dim``/``dims`` made non-negative (some strategies, e.g.
    ``scan_strategy`` of torch 2.13, compare dims without normalizing them)."""
    first = args[0] if args and isinstance(args[0], Node) else None
    ndim = len(shape_of(first) or ()) + (target in _INSERTS_DIM) if first is not None else 0
    out = list(args)
    for i, arg in enumerate(target._schema.arguments[: len(args)]):
        if arg.name in _DIM_ARGS and ndim:
            if isinstance(out[i], int):
                out[i] = out[i] % ndim
            elif isinstance(out[i], (list, tuple)) and all(isinstance(d, int) for d in out[i]):
                out[i] = type(out[i])(d % ndim for d in out[i])
    return tuple(out)


def _symbolic(val: torch.Tensor) -> bool:
    return any(not isinstance(s, int) for s in val.stride())


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
