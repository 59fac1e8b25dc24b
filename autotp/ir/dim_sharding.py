"""How one dimension of a parameter is split over the ranks of one axis: segments, each cut
into equal blocks spread over the ranks (``autotp.ir.layouts`` explains the block rule), or
padded where the axis's degree does not divide them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotp.ir.axes import Axis


@dataclass(frozen=True)
class DimSharding:
    """How one dimension of a parameter is split over the ranks of ``axis`` (``autotp.ir.layouts``' block rule;
    the methods' ``tp`` is that axis's degree)."""

    size: int
    segments: tuple[int, ...]
    groups: tuple[int, ...]
    padded: bool = False
    axis: Axis = Axis.TP
    block: int = 0  # padded: elements per rank (0: ceil(size / tp)); a slice that drops the padding of an even split keeps its blocks

    def _pers(self, tp: int) -> list[int]:
        """A padded dim's elements per rank in each segment (each padded at its own end)."""
        return [self.block] if self.block else [math.ceil(seg / tp) for seg in self.segments]

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
            return sum(self._pers(tp))
        return sum(seg // g * max(g // tp, 1) for seg, g in zip(self.segments, self.groups))

    def pieces(self, rank: int, tp: int) -> list[tuple[int, int, int]]:
        """(global start, elements held, local length) of each range ``rank`` holds, in local
        order; a padded range holds fewer elements than its local length (the rest is padding)."""
        if not self.padded:
            return [(start, stop - start, stop - start) for start, stop in self.ranges(rank, tp)]
        out, offset = [], 0
        for seg, per in zip(self.segments, self._pers(tp)):
            start = min(offset + rank * per, offset + seg)
            out.append((start, min(per, offset + seg - start), per))
            offset += seg
        return out

    def ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """Global ``[start, stop)`` ranges that ``rank`` holds, in local order (padding included:
        see ``pieces``)."""
        if self.padded:
            return [(start, start + per) for start, _, per in self.pieces(rank, tp)]
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
        out = {"size": self.size, "segments": list(self.segments), "groups": list(self.groups), "padded": self.padded,
               "axis": self.axis.value}  # fmt: skip
        return out | ({"block": self.block} if self.block else {})

    @staticmethod
    def from_json(d: dict) -> DimSharding:
        return DimSharding(d["size"], tuple(d["segments"]), tuple(d["groups"]), d.get("padded", False), Axis(d.get("axis", Axis.TP)),
                           d.get("block", 0))  # fmt: skip
