"""Initialize the shards of a model built on ``meta`` with the model's own initializer.

What is guaranteed. Each module that owns an unfilled tensor runs the model's own
initializer (HF ``model._init_weights(module)``, else ``module.reset_parameters()``)
with its tensors swapped for this rank's shards:

- fan-in and fan-out (``torch.nn.init``) are those of the global shape, and an
  embedding's ``padding_idx`` is moved to its local row (or dropped off this rank);
- so for initializers that fill elements independently (normal, uniform, kaiming,
  xavier, zeros, ones, constants: every HF language model's ``_init_weights``) each
  element has the same distribution as in the model initialized on one process. The
  values are not those of a tp=1 init with the same seed: the random stream is split
  per module and slice (seeded by seed, module name and global slice), which makes
  copies on different ranks (replicated tensors, KV-head replicas, tied weights on two
  stages) bitwise equal;
- initializers that couple elements (``orthogonal_``, anything reading the whole
  tensor) see only the shard: use a checkpoint for such models;
- buffers are rebuilt by the same initializer (HF's ``_init_weights`` recomputes rotary
  ``inv_freq`` and BERT's ``position_ids``). A tensor that the initializer leaves
  untouched raises ``ValueError`` instead of staying uninitialized;
- the caller's random state (CPU and the rank's CUDA device) is restored afterwards: the
  per-module seeding runs inside ``torch.random.fork_rng``.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from autotp.ir.errors import UserInputError
from autotp.runtime.state.parameters import Parameters, get_nested
from autotp.runtime.state.shard_map import ShardSpec


@contextlib.contextmanager
def _global_fans(global_shapes: dict[int, tuple[int, ...]]) -> Iterator[None]:
    original = nn.init._calculate_fan_in_and_fan_out

    def fans(tensor: Tensor) -> tuple[int, int]:
        shape = global_shapes.get(id(tensor))
        return original(tensor if shape is None else torch.empty(shape, device="meta"))

    nn.init._calculate_fan_in_and_fan_out = fans
    try:
        yield
    finally:
        nn.init._calculate_fan_in_and_fan_out = original


@contextlib.contextmanager
def _local_padding_idx(module: nn.Module, weight: ShardSpec | None) -> Iterator[None]:
    index = getattr(module, "padding_idx", None)
    if index is None or weight is None or not weight.sharded or weight.dim != 0:
        yield
        return
    local = next((p.local_start + index - p.global_start for p in weight.pieces
                  if p.global_start <= index < p.global_start + p.length), None)  # fmt: skip
    module.padding_idx = local
    try:
        yield
    finally:
        module.padding_idx = index


def _sentinel(t: Tensor) -> Any:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return float("nan")
    return False if t.dtype == torch.bool else torch.iinfo(t.dtype).min


def _untouched(t: Tensor, spec: ShardSpec) -> bool:
    value = _sentinel(t)
    for piece in spec.pieces:
        view = spec.local_view(t, piece)
        if view.numel() == 0 or t.dtype == torch.bool:
            continue
        hit = view.isnan() if value != value else view == value
        if bool(hit.all()):
            return True
    return False


def zero_padding(local: Tensor, spec: ShardSpec) -> None:
    covered = sum(p.length for p in spec.pieces)
    if spec.sharded and covered < spec.local_len:
        local.narrow(spec.dim, covered, spec.local_len - covered).zero_()


@torch.no_grad()
def initialize(root: nn.Module, params: Parameters, model: nn.Module, seed: int, names: set[str], progress: bool) -> None:
    """Fill ``names`` (unfilled tensors of ``root``, the ParallelModel) with ``model``'s init;
    the global random state is left as it was."""
    devices = sorted({t.device.index or 0 for t in (get_nested(root, n) for n in names) if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        _initialize(root, params, model, seed, names, progress)


def _initialize(root: nn.Module, params: Parameters, model: nn.Module, seed: int, names: set[str], progress: bool) -> None:
    init_fn = getattr(model, "_init_weights", None)
    owners: dict[str, list[tuple[str, str]]] = {}
    for mod_name, mod in model.named_modules():
        for attr in [*mod._parameters, *mod._buffers]:
            full = f"{mod_name}.{attr}" if mod_name else attr
            canonical = params.canonical(full)
            if canonical in names:
                owners.setdefault(mod_name, []).append((attr, canonical))
    for t in names:
        target = get_nested(root, t)
        if target.dtype != torch.bool:
            target.fill_(_sentinel(target))
    for mod_name, entries in tqdm(owners.items(), desc="initialize shards", disable=not progress):
        mod = model.get_submodule(mod_name)
        saved: list[tuple[dict, str, Any]] = []
        shapes: dict[int, tuple[int, ...]] = {}
        key = [seed, mod_name]
        for attr, canonical in entries:
            store = mod._parameters if attr in mod._parameters else mod._buffers
            saved.append((store, attr, store[attr]))
            target = get_nested(root, canonical)
            store[attr] = target
            spec = params.specs[canonical]
            shapes[id(target)] = spec.global_shape
            key.append((attr, spec.pieces))
        torch.manual_seed(zlib.crc32(repr(key).encode()))
        weight = next((params.specs[c] for a, c in entries if a == "weight"), None)
        try:
            with _global_fans(shapes), _local_padding_idx(mod, weight):
                if init_fn is not None:
                    init_fn(mod)
                elif hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
        finally:
            for store, attr, value in saved:
                store[attr] = value
    for t in sorted(names):
        target, spec = get_nested(root, t), params.specs[t]
        if _untouched(target, spec):
            raise UserInputError(f"{t} was built on meta and the model's initializer does not fill it "
                             f"({type(model).__name__}{'._init_weights' if init_fn else ' has no _init_weights'}); "
                             "pass checkpoint=, or build the model on the CPU")
        zero_padding(target, spec)
