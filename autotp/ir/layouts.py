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
import math
from dataclasses import dataclass

from autotp.ir.axes import Axis


class ShardingConflict(Exception):
    """A sharded dim met an op that cannot keep it sharded.

    ``origins`` names the parameters whose sharding led there; the planner stops
    sharding them and propagates again.
    """

    def __init__(self, message: str, origins: frozenset[str]) -> None:
        super().__init__(message)
        self.origins = origins


_ids = itertools.count()


class DimVar:
    """A sharded tensor dimension whose exact split is still being constrained."""

    def __init__(self, size: int, origins: frozenset[str], *, padded: bool = False, axis: Axis = Axis.TP) -> None:
        self.uid = next(_ids)
        self.size = size
        self.origins = origins
        self.padded = padded
        self.axis = axis
        self.groups: int | None = None
        self.segments: tuple[DimVar, ...] | None = None
        self.fixed: DimSharding | None = None
        self._parent: DimVar | None = None
        # A dim merged from [outer var, inner broadcast dim] (``repeat_kv``'s reshape);
        # the inner dim's local size is local(self) / local(outer).
        self.outer: DimVar | None = None

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
    if ra.size != rb.size or ra.padded != rb.padded:
        raise ShardingConflict(f"{where}: sharded dims of size {ra.size} and {rb.size} meet", origins)
    if ra.axis != rb.axis:
        raise ShardingConflict(f"{where}: a dim split over {ra.axis} meets one split over {rb.axis}", origins)
    if ra.fixed is not None and rb.fixed is not None and ra.fixed != rb.fixed:
        raise ShardingConflict(f"{where}: two fixed shardings disagree", origins)
    rb._parent = ra
    ra.origins = origins
    ra.fixed = ra.fixed or rb.fixed
    ra.outer = ra.outer or rb.outer
    if rb.groups is not None:
        set_groups(ra, rb.groups, where)
    if rb.segments is not None:
        if ra.segments is None:
            ra.segments = rb.segments
        else:
            set_segments(ra, [s.find().size for s in rb.segments], where)
            for x, y in zip(ra.segments, rb.segments):
                unify(x, y, where)
    return ra


def set_groups(var: DimVar, groups: int, where: str) -> None:
    """Require ``var`` to be cut into blocks of ``size/groups`` (keep the finer of two)."""
    r = var.find()
    if r.groups is None or r.groups == groups:
        r.groups = groups
        return
    fine, coarse = max(r.groups, groups), min(r.groups, groups)
    if fine % coarse:
        raise ShardingConflict(f"{where}: block counts {r.groups} and {groups} are incompatible", r.origins)
    r.groups = fine


def set_segments(var: DimVar, sizes: list[int], where: str) -> tuple[DimVar, ...]:
    """Cut ``var`` into consecutive segments that are sharded one by one."""
    r = var.find()
    if sum(sizes) != r.size:
        raise ShardingConflict(f"{where}: segments {sizes} do not cover size {r.size}", r.origins)
    if r.segments is None:
        if r.groups is not None and r.groups != 1:
            raise ShardingConflict(f"{where}: cannot cut a dim already split into {r.groups} blocks", r.origins)
        r.segments = tuple(DimVar(s, r.origins, axis=r.axis) for s in sizes)
        if r.fixed is not None:
            for seg, (size, groups) in zip(r.segments, zip(r.fixed.segments, r.fixed.groups)):
                seg.fixed = DimSharding(size, (size,), (groups,), axis=r.axis)
        return r.segments
    have = [s.find().size for s in r.segments]
    if have != sizes:
        raise ShardingConflict(f"{where}: segments {sizes} differ from earlier {have}", r.origins)
    return r.segments


@dataclass(frozen=True)
class DimSharding:
    """How one dimension of a parameter is split over the ranks of ``axis`` (see module doc;
    the methods' ``tp`` is that axis's degree)."""

    size: int
    segments: tuple[int, ...]
    groups: tuple[int, ...]
    padded: bool = False
    axis: Axis = Axis.TP

    def check(self, tp: int) -> str | None:
        """Why this dim cannot be split over ``tp`` ranks, or None."""
        if self.padded:
            return None
        for seg, g in zip(self.segments, self.groups):
            if seg % g:
                return f"{seg} elements do not form {g} equal blocks"
            if g % tp and tp % g:
                return f"{g} blocks of size {seg // g} cannot be spread over tp={tp} ranks"
        return None

    def replicas(self, tp: int) -> int:
        """How many ranks hold the same slice (1 when every rank's slice is distinct)."""
        return 1 if self.padded else max(max(tp // g, 1) for g in self.groups)

    def local_size(self, tp: int) -> int:
        if self.padded:
            return math.ceil(self.size / tp)
        return sum(seg // g * max(g // tp, 1) for seg, g in zip(self.segments, self.groups))

    def ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """Global ``[start, stop)`` ranges that ``rank`` holds, in local order.

        For a padded dim ``stop`` may pass ``size``: the rest of the slice is padding.
        """
        if self.padded:
            per = math.ceil(self.size / tp)
            return [(rank * per, (rank + 1) * per)]
        out: list[tuple[int, int]] = []
        offset = 0
        for seg, g in zip(self.segments, self.groups):
            block = seg // g
            if g % tp == 0:
                start = rank * (g // tp) * block
                out.append((offset + start, offset + start + g // tp * block))
            else:
                b = rank * g // tp
                out.append((offset + b * block, offset + (b + 1) * block))
            offset += seg
        return out

    def to_json(self) -> dict:
        return {"size": self.size, "segments": list(self.segments), "groups": list(self.groups), "padded": self.padded,
                "axis": self.axis.value}  # fmt: skip

    @staticmethod
    def from_json(d: dict) -> DimSharding:
        return DimSharding(d["size"], tuple(d["segments"]), tuple(d["groups"]), d.get("padded", False), Axis(d.get("axis", Axis.TP)))


def resolve(var: DimVar, tp: int) -> DimSharding:
    """The final split of ``var`` for ``tp`` ranks (blocks default to single elements)."""
    r = var.find()
    if r.fixed is not None:
        return r.fixed
    if r.padded:
        return DimSharding(r.size, (r.size,), (r.size,), padded=True, axis=r.axis)
    if r.segments is None:
        return DimSharding(r.size, (r.size,), (r.groups or r.size,), axis=r.axis)
    sizes: list[int] = []
    groups: list[int] = []
    for seg in r.segments:  # a segment cut again (a slice of a slice) flattens into its parts
        s = resolve(seg, tp)
        if s.padded:
            raise ShardingConflict("a padded dim cannot be a segment", r.origins)
        sizes.extend(s.segments)
        groups.extend(s.groups)
    return DimSharding(r.size, tuple(sizes), tuple(groups), axis=r.axis)


def select_range(var: DimVar, start: int, end: int, where: str) -> DimVar:
    """The variable of elements ``[start, end)`` of ``var``, cutting segments as needed
    (Phi-3 slices q, k and v out of its fused projection)."""
    r = var.find()
    if start == 0 and end == r.size:
        return r
    if r.padded:
        raise ShardingConflict(f"{where}: slices a padded (vocabulary) dim", r.origins)
    if r.segments is None:
        set_segments(r, [n for n in (start, end - start, r.size - end) if n > 0], where)
    assert r.segments is not None
    offset = 0
    for seg in r.segments:
        size = seg.find().size
        if offset <= start and end <= offset + size:
            return select_range(seg, start - offset, end - offset, where)
        offset += size
    raise ShardingConflict(f"{where}: the slice [{start}, {end}) crosses a segment boundary", r.origins)


def local_offset(var: DimVar, part: DimVar, tp: int) -> int:
    """Where ``part`` (a segment of ``var``, at any depth) starts in ``var``'s local shard."""
    target = part.find()

    def walk(v: DimVar) -> tuple[int, bool]:
        r = v.find()
        if r is target:
            return 0, True
        if r.segments is None:
            return local_size(r, tp), False
        total = 0
        for seg in r.segments:
            inside, found = walk(seg)
            if found:
                return total + inside, True
            total += inside
        return total, False

    offset, found = walk(var)
    assert found, "part is not a segment of var"
    return offset


def local_size(var: DimVar, tp: int) -> int:
    return resolve(var, tp).local_size(tp)


def fixed_var(sharding: DimSharding, origin: str) -> DimVar:
    """A variable already resolved to ``sharding`` (for parameters read from a plan)."""
    var = DimVar(sharding.size, frozenset({origin}), padded=sharding.padded, axis=sharding.axis)
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
