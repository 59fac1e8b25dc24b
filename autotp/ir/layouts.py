"""Tensor layouts across the ranks of the parallel axes (tensor parallelism unless said otherwise).

A tensor is *replicated* (every rank holds all of it), *partial* (every rank holds a
summand; the true value is the sum over ranks) or *sharded* on one or more dims.

A sharded dim is described by a ``DimVar``: a variable shared by every tensor dim that
carries the same split (the out-features of ``q_proj``, the heads dim after the view,
the in-features of ``o_proj``...). Constraints found along the graph are unified into
it: a ``view`` that splits it into ``[heads, head_dim]`` fixes its block count, a
``split`` cuts it into segments (GPT-2's fused QKV, the MoE ``gate_up_proj``). Once the
whole graph is seen, ``resolve`` turns the variable into a ``DimSharding``, which says
which global indices every rank holds.

Block rule, for a dim of ``size`` elements cut into ``groups`` equal blocks and ``tp``
ranks: if ``groups % tp == 0`` rank r holds blocks ``[r*groups/tp, (r+1)*groups/tp)``;
if ``tp % groups == 0`` rank r holds block ``r*groups // tp`` and ``tp/groups`` ranks
share it (Megatron's KV-head replication when tp > num_key_value_heads). Anything else
cannot be split. ``tp`` here is the degree of the dim's axis: every ``DimVar`` and
``DimSharding`` names the ``autotp.ir.axes.Axis`` it is split over (``Axis.TP`` by
default), so one tensor can be split on tp along one dim and on ep along another, and
two dims split over different axes never unify.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from autotp.ir.axes import Axis
from autotp.ir.dim_sharding import DimSharding


class ShardingConflict(Exception):
    """A sharded dim met an op that cannot keep it sharded.

    ``origins`` names the parameters whose sharding led there; the planner stops
    sharding them and propagates again. ``retries`` names the reshapes whose choice of
    output factor made the dims involved (``DimVar.made_by``): the planner first walks
    again with those choices avoided. ``statistic`` names the node whose tp-reduced
    statistic the walk was not allowed to take.
    """

    def __init__(
        self, message: str, origins: frozenset[str], dims: tuple[DimVar, ...] = (), *, statistic: str | None = None
    ) -> None:
        super().__init__(message)
        self.origins = origins
        self.statistic = statistic
        self.node: Any = None  # the graph node where the walk met it
        self.retries = frozenset(v.find().made_by for v in dims if v.find().made_by is not None)


_ids = itertools.count()


class DimVar:
    """A sharded tensor dimension whose exact split is still being constrained."""

    def __init__(self, size: int, origins: frozenset[str], *, padded: bool = False, block: int = 0, axis: Axis = Axis.TP) -> None:
        self.uid = next(_ids)
        self.size = size
        self.origins = origins
        self.padded = padded
        self.block = block  # a padded dim's elements per rank (0: ceil(size / tp)), ``DimSharding.block``
        # padded where tp does not divide it (``autotp.analysis.padded_dims``): cut into segments,
        # each is padded at its own end (a vocabulary's padding stays one run at the end)
        self.padded_parts = False
        self.axis = axis
        self.groups: int | None = None
        # (reshape node name, output factor) when a reshape chose which factor carries the
        # split (``ShardingConflict.retries``).
        self.made_by: tuple[str, int] | None = None
        self.segments: tuple[DimVar, ...] | None = None
        self.fixed: DimSharding | None = None
        self._parent: DimVar | None = None
        # A dim merged from [var, inner data dims] (heads and head_dim into features) is
        # split in the blocks of var, whatever else asks for finer blocks (``resolve``).
        self.follows: DimVar | None = None

    def find(self) -> DimVar:
        root = self
        while root._parent is not None:
            root = root._parent
        return root

    def __repr__(self) -> str:
        r = self.find()
        return f"DimVar#{r.uid}(size={r.size}, groups={r.groups}, segs={None if r.segments is None else len(r.segments)})"


def unify(a: DimVar, b: DimVar, where: str) -> DimVar:
    """Make ``a`` and ``b`` the same split; raise ``ShardingConflict`` if they disagree."""
    ra, rb = a.find(), b.find()
    if ra is rb:
        return ra
    origins = ra.origins | rb.origins
    if ra.size != rb.size or ra.padded != rb.padded or ra.block != rb.block or ra.padded_parts != rb.padded_parts:
        raise ShardingConflict(f"{where}: sharded dims of size {ra.size} and {rb.size} meet", origins)
    if ra.axis != rb.axis:
        raise ShardingConflict(f"{where}: a dim split over {ra.axis} meets one split over {rb.axis}", origins)
    if ra.fixed is not None and rb.fixed is not None and ra.fixed != rb.fixed:
        raise ShardingConflict(f"{where}: two fixed shardings disagree", origins)
    followed = [f for f in (ra.follows, rb.follows) if f is not None]
    ra.follows = None
    rb._parent = ra
    ra.origins = origins
    ra.fixed = ra.fixed or rb.fixed
    ra.made_by = ra.made_by or rb.made_by
    if rb.groups is not None:
        set_groups(ra, rb.groups, where)
    if rb.segments is not None:
        if ra.segments is None:
            ra.segments = rb.segments
        else:
            set_segments(ra, [s.find().size for s in rb.segments], where)
            for x, y in zip(ra.segments, rb.segments):
                unify(x, y, where)
    for outer in followed:
        follow(ra, outer, where)
    return ra


def follow(var: DimVar, outer: DimVar, where: str) -> None:
    """``var`` is ``outer`` times inner elements (heads x head_dim): it is split in outer's
    blocks, each with its inner elements; what was asked of var's split is asked of outer's."""
    r, o = var.find(), outer.find()
    if r is o:
        return
    if r.size % o.size:
        raise ShardingConflict(f"{where}: a dim of {r.size} cannot follow one of {o.size}", r.origins | o.origins)
    if r.size == o.size and _follows(o, r):  # each follows the other: one split (else ``follow`` would loop)
        unify(r, o, where)
        return
    if r.follows is not None and r.follows.find() is not r:
        _follow_both(r.follows.find(), o, where)
        return
    inner = r.size // o.size
    if o.size == 1:  # one element (one KV head): every rank holds the whole, parts included
        make_whole(r)
    elif r.segments is not None:
        sizes = [seg.find().size for seg in r.segments]
        if any(size % inner for size in sizes):
            raise ShardingConflict(f"{where}: segments {sizes} cut inside blocks of {inner}", r.origins)
        for seg, part in zip(r.segments, set_segments(o, [size // inner for size in sizes], where)):
            follow(seg, part, where)
    else:
        groups = r.groups if r.fixed is None else (r.fixed.groups[0] if len(r.fixed.segments) == 1 else None)
        if groups is not None:
            _outer_groups(o, groups, r.size, where)
    r.follows = o


def _follows(var: DimVar, outer: DimVar) -> bool:
    """Whether ``var`` follows ``outer``, directly or through dims it follows."""
    seen, v = set(), var.find()
    while v.follows is not None and v.uid not in seen:
        seen.add(v.uid)
        v = v.follows.find()
        if v is outer:
            return True
    return False


def _follow_both(a: DimVar, b: DimVar, where: str) -> None:
    """One dim follows both ``a`` and ``b`` (its heads, and the groups of heads a grouped
    norm views it in: Mamba2's 128 heads in 8 groups): equal sizes are one split; otherwise
    the finer one follows the coarser, so the split falls on whole elements of both."""
    if a.size == b.size:
        unify(a, b, where)
    elif a.size % b.size == 0:
        follow(a, b, where)
    elif b.size % a.size == 0:
        follow(b, a, where)
    else:
        raise ShardingConflict(f"{where}: sharded dims of size {a.size} and {b.size} meet", a.origins | b.origins)


def make_whole(var: DimVar) -> None:
    """One block that every rank holds (a replicated whole satisfies any block constraint)."""
    r = var.find()
    r.groups = 1
    for seg in r.segments or ():
        make_whole(seg)


def _outer_groups(outer: DimVar, groups: int, size: int, where: str) -> None:
    """``groups`` blocks asked of a dim of ``size`` that follows ``outer``, asked of ``outer``
    (blocks finer than outer's elements hold already: each rank holds whole elements)."""
    o = outer.find()
    if groups >= o.size:
        if (size // o.size) % (size // groups):
            raise ShardingConflict(f"{where}: blocks of {size // groups} cut through elements of {size // o.size}", o.origins)
        return
    if o.size % groups:
        raise ShardingConflict(f"{where}: {groups} blocks would cut through a dim of {o.size}", o.origins)
    set_groups(outer, groups, where)


def set_groups(var: DimVar, groups: int, where: str) -> None:
    """Require ``var`` to be cut into blocks of ``size/groups`` (keep the finer of two); a
    var already cut into segments passes the blocks on to them."""
    r = var.find()
    if r.follows is not None and r.follows.find() is not r:
        _outer_groups(r.follows, groups, r.size, where)
    if r.segments is not None:
        block = r.size // groups
        for seg in r.segments:
            if seg.find() is r:
                raise ShardingConflict(f"{where}: a dim is a segment of itself", r.origins)
            size = seg.find().size
            if r.size % groups or size % block:
                raise ShardingConflict(f"{where}: blocks of {block} do not fit segments of {size}", r.origins)
            set_groups(seg, size // block, where)
    if r.groups is None or r.groups == groups:
        r.groups = groups
        return
    fine, coarse = max(r.groups, groups), min(r.groups, groups)
    if fine % coarse:
        raise ShardingConflict(f"{where}: block counts {r.groups} and {groups} are incompatible", r.origins)
    r.groups = fine


def tile(var: DimVar, count: int, where: str) -> DimVar:
    """The dim that merges ``count`` unsharded outer elements with sharded ``var``
    (Bloom's ``[batch, heads] -> batch*heads``): ``count`` segments, each split as ``var``."""
    tiled = DimVar(count * var.find().size, var.find().origins)
    for seg in set_segments(tiled, [var.find().size] * count, where):
        unify(seg, var, where)
    return tiled


def set_segments(var: DimVar, sizes: list[int], where: str) -> tuple[DimVar, ...]:
    """Cut ``var`` into consecutive segments that are sharded one by one."""
    r = var.find()
    if sum(sizes) != r.size:
        raise ShardingConflict(f"{where}: segments {sizes} do not cover size {r.size}", r.origins)
    if len(sizes) == 1:  # one segment is the dim itself (a tile of one outer element); a var of its own segment would cycle
        return (r,)
    if r.segments is None and r.follows is not None and r.follows.find() is not r:
        inner = r.size // r.follows.find().size
        if any(size % inner for size in sizes):
            raise ShardingConflict(f"{where}: segments {sizes} cut inside blocks of {inner}", r.origins)
        parts = set_segments(r.follows, [size // inner for size in sizes], where)
        r.segments = tuple(DimVar(size, r.origins) for size in sizes)
        for seg, part in zip(r.segments, parts):
            seg.made_by = r.made_by
            follow(seg, part, where)
        return r.segments
    if r.segments is None:
        padded = r.padded_parts  # each segment padded at its own end (``DimSharding.pieces``)
        r.segments = tuple(DimVar(s, r.origins, axis=r.axis, padded=padded) for s in sizes)
        for seg in r.segments:
            seg.padded_parts = padded
            seg.made_by = r.made_by  # a conflict on a part may be the reshape's choice too
        for seg, groups in zip(r.segments, _segment_groups(r.size, r.groups, sizes, where, r.origins)):
            seg.groups = groups
        if r.fixed is not None:
            fixed = r.fixed
            if list(fixed.segments) == sizes:
                per = list(fixed.groups)
            elif len(fixed.segments) == 1:
                per = _segment_groups(fixed.size, fixed.groups[0], sizes, where, r.origins)
            else:
                raise ShardingConflict(f"{where}: segments {sizes} cut across the plan's {list(fixed.segments)}", r.origins)
            for seg, size, groups in zip(r.segments, sizes, per):
                seg.fixed = DimSharding(size, (size,), (groups or size or 1,), padded=padded, axis=r.axis)
        return r.segments
    have = [s.find().size for s in r.segments]
    if have == sizes:
        return r.segments
    cuts, old = _cuts(sizes), _cuts(have)
    if cuts <= old:  # coarser: each new segment holds consecutive old ones
        grouped, parts, acc = [], [], 0
        for seg, size in zip(r.segments, have):
            parts.append(seg)
            acc += size
            if acc in cuts or acc == r.size:
                joined = DimVar(sum(p.find().size for p in parts), r.origins)
                joined.segments, joined.made_by = tuple(parts), r.made_by
                grouped.append(joined)
                parts = []
        r.segments = tuple(grouped)
        return r.segments
    if old <= cuts:  # finer: each old segment is cut again
        out, start = [], 0
        for seg, size in zip(r.segments, have):
            inside = [c - start for c in sorted(cuts | {start + size}) if start < c <= start + size]
            out.extend(set_segments(seg, [b - a for a, b in zip([0] + inside[:-1], inside)], where) if len(inside) > 1 else [seg])
            start += size
        return tuple(out)
    raise ShardingConflict(f"{where}: segments {sizes} cut across earlier {have}", r.origins)


def _cuts(sizes: list[int]) -> set[int]:
    """The inner boundaries of consecutive segments of ``sizes``."""
    out, acc = set(), 0
    for size in sizes[:-1]:
        acc += size
        out.add(acc)
    return out


def _segment_groups(size: int, groups: int | None, sizes: list[int], where: str, origins: frozenset[str]) -> list[int | None]:
    """The block count of each segment of a dim cut in ``groups`` blocks: one block (a
    replicated whole) stays one block per segment; finer blocks must not straddle a cut."""
    if groups is None:
        return [None] * len(sizes)
    if groups == 1:
        return [1] * len(sizes)
    block = size // groups
    if any(s % block for s in sizes):
        raise ShardingConflict(f"{where}: cannot cut a dim split into {groups} blocks at {sizes}", origins)
    return [s // block for s in sizes]


def resolve(var: DimVar, tp: int, _seen: frozenset[int] = frozenset()) -> DimSharding:
    """The final split of ``var`` for ``tp`` ranks (blocks default to single elements)."""
    r = var.find()
    if r.fixed is not None:
        return r.fixed
    if r.follows is not None and r.follows.find() is not r and r.uid not in _seen:
        outer = resolve(r.follows, tp, _seen | {r.uid})
        inner = r.size // outer.size
        return DimSharding(r.size, tuple(s * inner for s in outer.segments), outer.groups, outer.padded)
    if r.padded_parts and r.segments is not None:  # segments each padded at their own end (``set_segments``)
        sizes = tuple(seg.find().size for seg in r.segments)
        return DimSharding(r.size, sizes, sizes, padded=True, axis=r.axis)
    if r.padded:
        return DimSharding(r.size, (r.size,), (r.size,), padded=True, axis=r.axis, block=r.block)
    if r.segments is None:
        return DimSharding(r.size, (r.size,), (r.groups or r.size or 1,), axis=r.axis)  # an empty dim: one empty block
    sizes: list[int] = []
    groups: list[int] = []
    for seg in r.segments:  # a segment cut again (a slice of a slice) flattens into its parts
        s = resolve(seg, tp, _seen | {r.uid})
        if s.padded and (s.size % tp or s.local_size(tp) * tp != s.size):
            raise ShardingConflict("a padded dim cannot be a segment", r.origins)
        if s.padded:  # tp divides it: padded and even splits hold the same rows
            s = DimSharding(s.size, (s.size,), (s.size,), axis=s.axis)
        sizes.extend(s.segments)
        groups.extend(s.groups)
    return DimSharding(r.size, tuple(sizes), tuple(groups), axis=r.axis)


def select_range(var: DimVar, start: int, end: int, where: str) -> DimVar:
    """The variable of elements ``[start, end)`` of ``var``, cutting segments as needed
    (Phi-3 slices q, k and v out of its fused projection)."""
    r = var.find()
    if start == 0 and end == r.size:
        return r
    if not 0 <= start < end <= r.size:
        raise ShardingConflict(f"{where}: the range [{start}, {end}) of a dim of {r.size} is empty or outside it", r.origins)
    if r.padded and not r.padded_parts:
        raise ShardingConflict(f"{where}: slices a padded (vocabulary) dim", r.origins)
    if r.segments is None:
        set_segments(r, [n for n in (start, end - start, r.size - end) if n > 0], where)
    assert r.segments is not None
    offset = 0
    for seg in r.segments:
        size = seg.find().size
        if seg.find() is r:
            raise ShardingConflict(f"{where}: a dim is a segment of itself", r.origins)
        if offset <= start and end <= offset + size:
            return select_range(seg, start - offset, end - offset, where)
        offset += size
    raise ShardingConflict(f"{where}: the slice [{start}, {end}) crosses a segment boundary", r.origins)


def local_offset(var: DimVar, start: int, tp: int) -> int:
    """Where the segment of ``var`` (at any depth) that starts at global position ``start``
    starts in ``var``'s local shard. Found by position, not by the segment's variable: two
    segments of one size that an elementwise op lined up (``cat(-x2, x1) * x``) are one
    variable, at two positions."""
    r = var.find()
    if start == 0:
        return 0
    if r.segments is None:
        assert local_size(r, tp) == r.size, f"position {start} is inside a split dim of {r.size}, not at a segment"
        return start
    seen = local = 0
    for seg in r.segments:
        size = seg.find().size
        if start < seen + size:
            return local + local_offset(seg, start - seen, tp)
        seen += size
        local += local_size(seg, tp)
    raise AssertionError(f"position {start} is past the dim of {r.size}")


def local_size(var: DimVar, tp: int) -> int:
    return resolve(var, tp).local_size(tp)


def fixed_var(sharding: DimSharding, origin: str) -> DimVar:
    """A variable already resolved to ``sharding`` (for parameters read from a plan)."""
    var = DimVar(sharding.size, frozenset({origin}), padded=sharding.padded, block=sharding.block, axis=sharding.axis)
    var.padded_parts = sharding.padded and not sharding.block
    var.fixed = sharding
    if len(sharding.segments) > 1:
        set_segments(var, list(sharding.segments), origin)
    else:
        var.groups = sharding.groups[0]
    return var


@dataclass(frozen=True)
class Layout:
    """Sharded dims (``dim -> DimVar``) or partial-sum state of one tensor."""

    dims: tuple[tuple[int, DimVar], ...] = ()
    partial: bool = False

    @property
    def replicated(self) -> bool:
        return not self.dims and not self.partial

    def var_at(self, dim: int) -> DimVar | None:
        for d, v in self.dims:
            if d == dim:
                return v
        return None

    def axes(self) -> frozenset[Axis]:
        """The axes its sharded dims are split over."""
        return frozenset(v.find().axis for _, v in self.dims)

    def origins(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for _, v in self.dims:
            out |= v.find().origins
        return out

    def describe(self, tp: int | None = None) -> str:
        if self.partial:
            return "Partial"
        if not self.dims:
            return "Replicate"
        parts = []
        for d, v in self.dims:
            on_tp = v.find().axis == Axis.TP  # dims on another axis show it, not their local size
            size = f"{local_size(v, tp)}/" if tp and on_tp else ""
            parts.append(f"{d}:{size}{v.find().size}{'' if on_tp else '@' + v.find().axis}")
        return f"Shard({', '.join(parts)})"


REPLICATE = Layout()
PARTIAL = Layout(partial=True)


def shard(dims: dict[int, DimVar]) -> Layout:
    return Layout(tuple(sorted(dims.items()))) if dims else REPLICATE
