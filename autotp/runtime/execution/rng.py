"""Dropout under tensor parallelism, following Megatron's RNG rule.

A replicated activation must be dropped identically on every tp rank (otherwise the
replicas drift apart); a sharded activation must use different random numbers on each
rank (otherwise every shard repeats the same mask). Two generator streams per device
implement that: ``REPLICATED`` is seeded the same on all tp ranks, ``SHARDED`` is
seeded with the tp rank mixed in. This module registers the kernel of
``autotp::tp_rand``, which ``autotp::tp_dropout`` draws its mask from, and the snapshot and
restore of both streams that a recomputed region replays its dropout masks with
(``autotp.ir.recompute.RNG_STATE_HOOKS``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import Library

from autotp.ir import ops, recompute
from autotp.ir.ops import REPLICATED, SHARDED

_SHARDED_SEED_OFFSET = 2718

_seeds: dict[str, int] = {}
_generators: dict[tuple[str, torch.device], torch.Generator] = {}
_KERNELS = Library(ops.NAMESPACE, "IMPL")


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


def _tp_rand(like: Tensor, stream: str) -> Tensor:
    """Uniform [0, 1) float32 numbers shaped like ``like``, from ``stream``'s generator on its device."""
    return torch.rand(like.shape, generator=generator(stream, like.device), device=like.device, dtype=torch.float32)


for _device in ("CPU", "CUDA"):
    _KERNELS.impl("tp_rand", _tp_rand, _device)


def _stream_states() -> dict[tuple[str, torch.device], Tensor]:
    return {key: gen.get_state() for key, gen in _generators.items()}


def _restore_streams(states: dict[tuple[str, torch.device], Tensor]) -> None:
    """Back to ``states``; a generator made after the snapshot is dropped, so it is made
    again from its seed, as it was."""
    for key in list(_generators):
        if key in states:
            _generators[key].set_state(states[key])
        else:
            del _generators[key]


recompute.RNG_STATE_HOOKS.append((_stream_states, _restore_streams))
