"""What a layout walk produces: node layouts, parameter decisions, roles, the partial
inputs to all-reduce, and the shape fix-ups that sharding needs.

``check_divisible`` and ``param_sharding`` read a finished ``Propagation``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torch.fx import GraphModule, Node

from autotp.ir.errors import UserInputError, describe
from autotp.ir.axes import Axis
from autotp.ir.layouts import REPLICATE, DimVar, Layout, ShardingConflict, resolve
from autotp.ir.dim_sharding import DimSharding


class NodeRole(str, Enum):
    """What the rewrite passes must do with a node beyond sharding its inputs."""

    VOCAB_EMBEDDING = "vocab_embedding"
    VOCAB_CROSS_ENTROPY = "vocab_cross_entropy"
    ROW_WITH_BIAS = "row_with_bias"
    # a sum or mean over a sharded dim: partial, divided by the whole count (and by the
    # replicas of a dim held in replicated blocks) in ``passes/sharded_statistics``
    SHARDED_REDUCTION = "sharded_reduction"
    # layer_norm / rms_norm / linalg_vector_norm over a sharded dim: decomposed around a
    # tp-reduced statistic in ``passes/sharded_statistics``
    SHARDED_NORM = "sharded_norm"
    # amax / amin of a value with no gradient over a sharded dim: the rank's extremum,
    # max-reduced over the group in ``passes/sharded_statistics``
    SHARDED_EXTREMUM = "sharded_extremum"


@dataclass(frozen=True)
class Tiled:
    """A view dim that merges ``count`` whole outer elements with parameter dim ``dim``
    (``layouts.tile``: split, it is ``count`` segments each split as ``dim``)."""

    dim: int
    count: int


@dataclass(frozen=True)
class Sliced:
    """A view dim that is elements ``[start, end)`` of parameter dim ``dim``, cut by the slice
    ``node`` (MatFormer's ``weight[:k]``): split, the parameter dim is segments of which this
    range is one, and ``node`` reads the rank's part of it."""

    dim: int
    start: int
    end: int
    node: Node


@dataclass(frozen=True)
class ParamView:
    """An undecided parameter seen through views: ``dim_map[i]`` is the parameter dim
    behind view dim ``i`` (None for inserted dims), or ``(dim, inner)`` when a reshape cut
    that parameter dim into factors and view dim ``i`` is the outermost one, ``inner``
    elements each (a grouped weight ``weight.view(groups, -1, d_in)``), or ``Tiled`` when a
    reshape merged outer parameter dims into that dim (a stacked ``[3, H*D, D]`` QKV
    weight flattened), or ``Sliced`` when a slice kept a range of it."""

    name: str
    dim_map: tuple[int | tuple[int, int] | Tiled | Sliced | None, ...]


@dataclass
class ParamDecision:
    """Planning-mode decision for one parameter (``dim`` None: replicated)."""

    kind: str
    dim: int | None = None
    var: DimVar | None = None
    node: Node | None = None  # where it was decided


ShardPolicy = Callable[[str, str, tuple[int, ...]], bool]
"""``policy(param_name, kind, shape) -> allowed``; kind is ``column`` or ``vocab``."""

StatisticPolicy = Callable[[Node], bool]
"""``statistics(node) -> allowed``: may a reduction or norm over a sharded dim at ``node``
use a tp-reduced statistic (``statistic_rules``)?"""


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
    # slice node -> (sliced var, selected segment, its global start): its bounds become local
    # offsets, found by position (two segments of one size may have been unified into one var).
    slice_fixups: dict[Node, tuple[DimVar, DimVar, int]] = field(default_factory=dict)
    # slice node -> the var it keeps the first elements of, as a padded dim of that var's even
    # blocks (``shape_rules._drops_padding``): the var must resolve to tp contiguous blocks.
    padding_slices: dict[Node, DimVar] = field(default_factory=dict)
    # node -> [(input, dim, var)]: the node sums over a padded dim of that input (a contraction,
    # a sum), so the ranks holding padding zero it there first (``passes/mask_padding``)
    padding_masks: dict[Node, list[tuple[Node, int, DimVar]]] = field(default_factory=dict)
    # node -> [(replicated input, dim, var)]: the node reads that input's local slice along
    # dim as var shards it (a per-head vector or a buffer meeting sharded heads).
    local_slices: dict[Node, list[tuple[Node, int, DimVar]]] = field(default_factory=dict)
    # repeat_interleave node -> (output var, input var): the local repeat count is
    # local(output) / local(input).
    repeat_fixups: dict[Node, tuple[DimVar, DimVar]] = field(default_factory=dict)
    # index / index_select node -> the sharded dim its constant index slices (a slice in the rank graph)
    index_slices: dict[Node, int] = field(default_factory=dict)
    # index / index_put node -> [(indexed dim, var)]: its ``arange`` index enumerates that split dim in place
    identity_indices: dict[Node, list[tuple[int, DimVar]]] = field(default_factory=dict)
    # names of the nodes that reduce over a sharded dim with a tp-reduced statistic
    statistics: set[str] = field(default_factory=set)
    # parameter -> (kind, dim): the first matmul weight of the walk computed from it alone (a
    # reparametrization) was read whole; split from the start, it would be that matmul's (``Walker.hints``)
    hints: dict[str, tuple[str, int]] = field(default_factory=dict)
    # node -> its split layout: a value its readers get whole, all-gathered (``Walker.gathers``)
    gathered: dict[Node, Layout] = field(default_factory=dict)

    def layout(self, node: Node) -> Layout:
        lay = self.layouts.get(node, REPLICATE)
        assert isinstance(lay, Layout), f"{node.name} has layout {lay}"
        return lay



@dataclass(frozen=True)
class Indivisible:
    """A sharded dim that tp cannot split: where it is first seen, why, and the
    parameters whose sharding made it."""

    node: Node
    dim: int
    why: str
    origins: frozenset[str]
    # the parameters whose own split this dim is, where nothing cuts it into parts: they can
    # split it in blocks of ceil(size / tp), the last padded (``padded_dims``)
    paddable: frozenset[str] = frozenset()


def _own_split(prop: Propagation, r: DimVar, sharding: DimSharding | None) -> frozenset[str]:
    """The parameters whose decided split is ``r`` itself, if ``r`` is single elements (in segments
    or not: a fused gate/up pair cut by ``chunk``)."""
    if sharding is None or sharding.groups != sharding.segments or r.axis is not Axis.TP:
        return frozenset()
    return frozenset(n for n, dec in prop.decisions.items() if dec.var is not None and dec.var.find() is r)


def indivisible(prop: Propagation) -> list[Indivisible]:
    """Every sharded dim (once per variable) that cannot be split over ``prop.tp``."""
    seen: set[int] = set()
    found = []
    for node, lay in prop.layouts.items():
        for l in lay if isinstance(lay, tuple) else (lay,):
            if not isinstance(l, Layout):
                continue
            for d, var in l.dims:
                r = var.find()
                if r.uid in seen:
                    continue
                seen.add(r.uid)
                try:
                    sharding = resolve(r, prop.tp)
                    why = sharding.check(prop.tp)
                except ShardingConflict as c:  # segments that cannot be laid out together
                    sharding, why = None, str(c)
                if why:
                    found.append(Indivisible(node, d, why, frozenset(r.origins), _own_split(prop, r, sharding)))
    if found:
        return found
    for node, fixups in prop.expand_fixups.items():
        for d, merged, outer in fixups:
            why = misaligned_repeats(resolve(merged, prop.tp), resolve(outer, prop.tp), prop.tp)
            if why:
                found.append(Indivisible(node, d, why, frozenset(outer.find().origins)))
    for node, whole in prop.padding_slices.items():
        sharding = resolve(whole, prop.tp)
        if len(sharding.segments) != 1 or sharding.padded or sharding.groups[0] % prop.tp:
            found.append(Indivisible(node, node.args[1], "the slice keeps the even blocks of a dim that other ops split otherwise", frozenset(whole.find().origins)))
    return found


def misaligned_repeats(merged: DimSharding, outer: DimSharding, tp: int) -> str | None:
    """Why the broadcast of ``repeat_kv`` (an expand whose repeats a reshape merges with the
    ``outer`` dim into ``merged``) cannot run on the ranks' parts, or None. Each rank repeats
    its own outer entries ``local(merged) / local(outer)`` times, which gives the merged
    entries the rank holds only where each of them, in order, repeats the outer entry there
    (key heads held whole on every rank beside query heads split two ways do not)."""
    if merged.padded or outer.padded:
        return None
    n_rep = merged.size // outer.size
    for rank in range(tp):
        mine = [i for start, stop in merged.ranges(rank, tp) for i in range(start, stop)]
        theirs = [i for start, stop in outer.ranges(rank, tp) for i in range(start, stop)]
        if not theirs or len(mine) % len(theirs):
            return f"rank {rank} holds {len(mine)} of the {merged.size} repeated entries but {len(theirs)} of the {outer.size} it repeats"
        local_rep = len(mine) // len(theirs)
        if any(theirs[p // local_rep] != i // n_rep for p, i in enumerate(mine)):
            return f"rank {rank}'s {len(mine)} of the {merged.size} repeated entries do not repeat its {len(theirs)} of the {outer.size} entries"
    return None


def check_divisible(prop: Propagation, gm: GraphModule) -> None:
    """Raise a ValueError naming the node when a sharded dim cannot be split over tp."""
    for bad in indivisible(prop):
        origins = ", ".join(sorted(bad.origins))
        raise UserInputError(
            f"cannot split dim {bad.dim} of {describe(bad.node)} over tp={prop.tp}: {bad.why}. "
            f"It comes from parameter(s) {origins}. Choose a tp that divides it "
            f"(or whose multiple it is), or keep those parameters replicated."
        )


def param_sharding(prop: Propagation, name: str) -> tuple[str, int, DimSharding] | None:
    """Planning result for one parameter: (kind, dim, sharding), or None if replicated."""
    dec = prop.decisions.get(name)
    if dec is None or dec.dim is None or dec.var is None:
        return None
    return dec.kind, dec.dim, resolve(dec.var, prop.tp)

