"""Cut full tensors into this rank's shard and put gathered shards back together."""

from __future__ import annotations

import torch
from torch import Tensor

from autotp.ir.plan import ParamLayout


def shard_tensor(full: Tensor, layout: ParamLayout, rank: int, tp: int) -> Tensor:
    """This rank's slice of ``full`` (zero rows where a padded dim runs past the end)."""
    pieces = []
    for start, have, length in layout.sharding.pieces(rank, tp):
        if have:
            pieces.append(full.narrow(layout.dim, start, have))
        if length > have:
            pad_shape = list(full.shape)
            pad_shape[layout.dim] = length - have
            pieces.append(full.new_zeros(pad_shape))
    return torch.cat(pieces, dim=layout.dim) if len(pieces) > 1 else pieces[0].clone()


def unshard_tensor(shards: list[Tensor], layout: ParamLayout, tp: int) -> Tensor:
    """The full tensor from every rank's shard (``shards[r]`` from tp rank r)."""
    size = layout.sharding.size
    shape = list(shards[0].shape)
    shape[layout.dim] = size
    full = shards[0].new_empty(shape)
    for rank, local in enumerate(shards):
        offset = 0
        for start, have, length in layout.sharding.pieces(rank, tp):
            if have:
                full.narrow(layout.dim, start, have).copy_(local.narrow(layout.dim, offset, have))
            offset += length
    return full
