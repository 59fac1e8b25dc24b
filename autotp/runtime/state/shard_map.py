"""Where each local tensor sits in its global tensor: the map that loading, saving and
initializing shards all read.

A ``ShardSpec`` says, for one tensor of this rank, its global name and shape and the
list of ``Piece``s: contiguous runs along the sharded dim that map a global range to a
local range. Rows of a padded (vocabulary) shard past the global size belong to no
piece; they are padding and stay zero. A replicated tensor has one piece covering it.

``ShardedLocal`` wraps a local tensor with its spec so that
``torch.distributed.checkpoint`` sees one chunk per piece at its global offset (the
protocol DTensor implements), which makes any (tp, pp, dp) layout save and load
through DCP with resharding and without a device mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParamLayout


@dataclass(frozen=True)
class Piece:
    """Global ``[global_start, global_start + length)`` of the sharded dim is local
    ``[local_start, local_start + length)``."""

    global_start: int
    local_start: int
    length: int


@dataclass(frozen=True)
class ShardSpec:
    name: str
    global_shape: tuple[int, ...]
    dim: int  # the sharded dim (0 for a replicated tensor, whose one piece covers it)
    local_len: int  # local size of ``dim`` (padding included)
    pieces: tuple[Piece, ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if shape:
            shape[self.dim] = self.local_len
        return tuple(shape)

    @property
    def sharded(self) -> bool:
        return bool(self.global_shape) and self.local_len != self.global_shape[self.dim]

    def box(self, piece: Piece) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Global (offsets, sizes) of ``piece``."""
        offsets = [0] * len(self.global_shape)
        sizes = list(self.global_shape)
        if sizes:
            offsets[self.dim] = piece.global_start
            sizes[self.dim] = piece.length
        return tuple(offsets), tuple(sizes)

    def local_view(self, local: Tensor, piece: Piece) -> Tensor:
        return local.narrow(self.dim, piece.local_start, piece.length) if local.dim() else local

    def slice_bytes(self, itemsize: int) -> int:
        """Bytes of the global tensor that this rank holds (each piece once)."""
        total = 0
        for piece in self.pieces:
            n = 1
            for s in self.box(piece)[1]:
                n *= s
            total += n * itemsize
        return total


def shard_spec(name: str, global_shape: tuple[int, ...], layout: ParamLayout | None, tp_rank: int, tp: int) -> ShardSpec:
    """The spec of ``name`` on tp rank ``tp_rank`` under ``layout`` (None: replicated)."""
    if layout is None or not global_shape:
        length = global_shape[0] if global_shape else 1
        return ShardSpec(name, global_shape, 0, length, (Piece(0, 0, length),))
    size = layout.sharding.size
    if global_shape[layout.dim] != size:
        raise UserInputError(f"{name}: the plan shards dim {layout.dim} of size {size}, but the tensor has shape "
                         f"{list(global_shape)}; re-plan for this model")
    pieces = []
    offset = 0
    for start, have, length in layout.sharding.pieces(tp_rank, tp):
        if have:
            pieces.append(Piece(start, offset, have))
        offset += length
    return ShardSpec(name, global_shape, layout.dim, offset, tuple(pieces))


class ShardedLocal(Tensor):
    """A local tensor that tells DCP which global chunks it holds (see module doc).

    Operations on it return plain tensors; only DCP reads the extra methods. As for a
    DTensor, ``size()`` is the global size (DCP checks it); ``shape`` stays the local one.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    autotp_spec: ShardSpec

    @staticmethod
    def wrap(local: Tensor, spec: ShardSpec) -> ShardedLocal:
        out = Tensor._make_subclass(ShardedLocal, local.detach(), False)
        out.autotp_spec = spec
        return out

    def size(self, dim: int | None = None) -> torch.Size | int:  # type: ignore[override]
        shape = torch.Size(self.autotp_spec.global_shape)
        return shape if dim is None else shape[dim]

    def _plain(self) -> Tensor:
        return Tensor._make_subclass(Tensor, self, False)

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        spec = self.autotp_spec
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in map(spec.box, spec.pieces)]

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        spec = self.autotp_spec
        props = TensorProperties.create_from_tensor(self._plain())
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(spec.global_shape)),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __get_tensor_shard__(self, index: object) -> Tensor:
        spec = self.autotp_spec
        offset = getattr(index, "offset", None)
        for piece in spec.pieces:
            if offset is None or tuple(offset) == spec.box(piece)[0]:
                return spec.local_view(self._plain(), piece)
        raise UserInputError(f"{spec.name} holds no chunk at offset {offset} on this rank")


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _contiguous_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, Box]]:
    """The flat range ``[start, stop)`` of a row-major ``shape`` as boxes that are each
    contiguous in it: (flat offset from ``start``, local box); at most 2 per dimension."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    boxes = []
    pos = start
    while pos < stop:
        k = next(d for d in range(len(shape)) if pos % strides[d] == 0 and pos + strides[d] <= stop)
        index = [pos // strides[d] % shape[d] for d in range(len(shape))]
        count = min((stop - pos) // strides[k], shape[k] - index[k])
        sizes = (1,) * k + (count,) + tuple(shape[k + 1 :])
        boxes.append((pos - start, (tuple(index), sizes)))
        pos += count * strides[k]
    return boxes


def flat_range_chunks(spec: ShardSpec, flat: Tensor, start: int, stop: int) -> list[tuple[Box, Tensor]]:
    """Where the elements ``[start, stop)`` of the flattened local tensor (held in ``flat``)
    sit in the global tensor: (global box, view of ``flat``) per chunk; padding is left out."""
    shape = spec.local_shape
    if not shape:
        return [(((), ()), flat.view(()))]
    out = []
    d = spec.dim
    for offset, (lo, sizes) in _contiguous_boxes(shape, start, stop):
        n = 1
        for s in sizes:
            n *= s
        box = flat[offset : offset + n].view(sizes)
        for piece in spec.pieces:
            a, b = max(lo[d], piece.local_start), min(lo[d] + sizes[d], piece.local_start + piece.length)
            if a < b:
                goff, gsize = list(lo), list(sizes)
                goff[d], gsize[d] = piece.global_start + a - piece.local_start, b - a
                out.append(((tuple(goff), tuple(gsize)), box.narrow(d, a - lo[d], b - a)))
    return out


class FlatRangeLocal(Tensor):
    """A flat range of a local tensor (a DistributedOptimizer slice) that tells DCP which
    global chunks it holds, as ``ShardedLocal`` does for whole local tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _autotp_global_shape: tuple[int, ...]
    _autotp_chunks: list[tuple[Box, Tensor]]

    @staticmethod
    def wrap(flat: Tensor, spec: ShardSpec, start: int, stop: int) -> FlatRangeLocal:
        out = Tensor._make_subclass(FlatRangeLocal, flat.detach(), False)
        out._autotp_global_shape = spec.global_shape
        out._autotp_chunks = flat_range_chunks(spec, flat.detach(), start, stop)
        return out

    def size(self, dim: int | None = None) -> torch.Size | int:  # type: ignore[override]
        shape = torch.Size(self._autotp_global_shape)
        return shape if dim is None else shape[dim]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _ in self._autotp_chunks]

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(Tensor._make_subclass(Tensor, self, False))
        return [
            WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(self._autotp_global_shape)))
            for chunk in self.__create_chunk_list__()
        ]  # fmt: skip

    def __get_tensor_shard__(self, index: object) -> Tensor:
        offset = getattr(index, "offset", None)
        for (o, _), view in self._autotp_chunks:
            if offset is None or tuple(offset) == o:
                return view
        raise UserInputError(f"no chunk at offset {offset} of a tensor of shape {list(self._autotp_global_shape)} on this rank")
