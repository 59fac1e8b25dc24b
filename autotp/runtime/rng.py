"""Dropout under tensor parallelism, following Megatron's RNG rule.

A replicated activation must be dropped identically on every tp rank (otherwise the
replicas drift apart); a sharded activation must use different random numbers on each
rank (otherwise every shard repeats the same mask). Two generator streams per device
implement that: ``replicated`` is seeded the same on all tp ranks, ``sharded`` is
seeded with the tp rank mixed in.
"""

from __future__ import annotations

import torch
from torch import Tensor

REPLICATED = "replicated"
SHARDED = "sharded"
_SHARDED_SEED_OFFSET = 2718

_seeds: dict[str, int] = {}
_generators: dict[tuple[str, torch.device], torch.Generator] = {}


def seed_tp_rng(seed: int, tp_rank: int) -> None:
    """(Re)seed both streams; call with the same ``seed`` on every tp rank."""
    _seeds[REPLICATED] = seed
    _seeds[SHARDED] = seed + _SHARDED_SEED_OFFSET + tp_rank
    _generators.clear()


def generator(stream: str, device: torch.device) -> torch.Generator:
    key = (stream, device)
    gen = _generators.get(key)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(_seeds.get(stream, 0))
        _generators[key] = gen
    return gen


def tp_dropout(x: Tensor, p: float, train: bool, stream: str) -> Tensor:
    """``aten.dropout`` drawing its mask from the given stream."""
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = torch.rand(x.shape, generator=generator(stream, x.device), device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
