"""Save and resume through ``torch.distributed.checkpoint`` (DCP), with resharding.

Every local tensor (parameter, and each optimizer state tensor of the parameter's
shape) goes to DCP as a ``ShardedLocal``: one chunk per piece at its global offset
under the parameter's original name. DCP keeps one copy of chunks that several ranks
hold (dp replicas, tp-replicated tensors, KV-head replicas) and on load reads, for each
local piece, the stored chunks it overlaps, so a checkpoint written at one (tp, pp, dp)
loads at any other. A ``DistributedOptimizer``'s state goes under the same keys, each
dp rank's flat ranges as the global chunks they cover
(``DistributedOptimizer.checkpoint_state``), so its checkpoints reshard too, across dp
included, and load into a plain optimizer of the same class (and back).

Writes are atomic: every rank writes into ``<dir>.tmp``; only after DCP has written its
metadata (all ranks done) does rank 0 swap it into ``<dir>``. A save that dies leaves
the previous ``<dir>`` as it was.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParallelPlan
from autotp.runtime.state.materialize import on_every_rank
from autotp.runtime.state.parameters import Parameters, get_nested
from autotp.runtime.state.shard_map import ShardedLocal

log = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    """What a checkpoint holds besides tensors (stored as one pickled object)."""

    step: int | None
    degrees: dict[str, int]
    optimizer: str | None = None
    param_groups: list[dict[str, Any]] = field(default_factory=list)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _with_suffix(target: Path, suffix: str) -> Path:
    return target.with_name(target.name + suffix)


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A fresh ``<target>.tmp`` for every rank to write into, swapped into ``target`` on success."""
    target = Path(target).absolute()
    tmp, old = _with_suffix(target, ".tmp"), _with_suffix(target, ".old")

    def prepare() -> None:
        if _rank0():
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                raise UserInputError(f"cannot write a checkpoint to {target}: {e}; choose a writable folder") from e

    on_every_rank(prepare, f"saving {target}")
    _barrier()
    try:
        yield tmp
    except BaseException:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if _rank0():
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def resolve_dir(directory: str | Path) -> Path:
    """``directory``, or the previous checkpoint that a save killed mid-swap left in ``<dir>.old``."""
    target = Path(directory)
    old = _with_suffix(target, ".old")
    if not target.exists() and old.exists():
        log.warning("%s is missing; using %s, left by a save that stopped while swapping", target, old)
        return old
    return target


def _dcp(call: Callable[[], object], what: str, note: str = "") -> None:
    """Run a DCP call; its failure (on any rank) becomes a ValueError with the cause."""
    try:
        call()
    except CheckpointException as e:
        rank, failure = next(iter(e.failures.items()))
        cause = failure[0] if isinstance(failure, tuple) else failure
        raise UserInputError(f"{what} failed on rank {rank}: {cause!r}{note}") from e


def _model_state(module: nn.Module, params: Parameters, persistent: set[str]) -> dict[str, torch.Tensor]:
    names = params.local_names + [b for b in params.buffer_names if b in persistent] + params.histories
    return {n: ShardedLocal.wrap(get_nested(module, n), params.specs[n]) for n in names}


def _optimizer_state(module: nn.Module, params: Parameters, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(get_nested(module, n)): n for n in params.local_names}
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise UserInputError("the optimizer holds a tensor that is not a parameter of this ParallelModel; "
                                 "build it from pm.parameters()")
            name = names[id(p)]
            entry = {}
            for k, v in optimizer.state.get(p, {}).items():
                sharded = isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
                entry[k] = ShardedLocal.wrap(v, params.specs[name]) if sharded else v
            out[name] = entry
    return out


@runtime_checkable
class ShardedOptimizer(Protocol):
    """What ``autotp.DistributedOptimizer`` offers checkpoints (its docstring has the layout)."""

    optimizer: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]

    def checkpoint_state(self, specs: dict[str, Any], mine: set[str], init: bool = False) -> dict[str, dict[str, Any]]: ...

    def loaded_checkpoint(self, state: dict[str, dict[str, Any]], param_groups: list[dict[str, Any]]) -> None: ...


Optimizer = torch.optim.Optimizer | ShardedOptimizer


def _optimizer_name(optimizer: Optimizer) -> str:
    """The torch optimizer class that steps (a DistributedOptimizer's inner one)."""
    inner = optimizer.optimizer if isinstance(optimizer, ShardedOptimizer) else optimizer
    return type(inner).__name__


def _info(plan: ParallelPlan, step: int | None, optimizer: Optimizer | None) -> CheckpointInfo:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
    return CheckpointInfo(step, {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp},
                          _optimizer_name(optimizer) if optimizer else None, groups)  # fmt: skip


def save(module: nn.Module, params: Parameters, plan: ParallelPlan, source: nn.Module, directory: str | Path,
         optimizer: Optimizer | None, step: int | None) -> None:  # fmt: skip
    """Write the checkpoint (and the model's config.json, so that it can be rebuilt from it)."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    persistent = set(source.state_dict(keep_vars=True))
    state: dict[str, Any] = {"model": _model_state(module, params, persistent), "autotp": _info(plan, step, optimizer)}
    if isinstance(optimizer, ShardedOptimizer):
        state["optim"] = optimizer.checkpoint_state(params.specs, {n for n in params.local_names if params.writes_state(n)})
    elif optimizer is not None:
        state["optim"] = _optimizer_state(module, params, optimizer)
    with atomic_dir(Path(directory)) as tmp:
        _dcp(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp)),
             f"saving {directory}", "; the previous checkpoint there stays as it was")
        config = getattr(source, "config", None)
        if config is not None and _rank0():
            config.save_pretrained(tmp)
    log.info("saved %s in %.1f s", directory, time.perf_counter() - start)


def _read_info(root: Path) -> tuple[CheckpointInfo, Any]:
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(root).read_metadata()
    except (OSError, EOFError, RuntimeError) as e:
        raise UserInputError(f"{root} is not a complete autotp checkpoint ({e}); pass a folder written by "
                         "pm.save_checkpoint") from e
    state: dict[str, Any] = {"autotp": None}
    dcp.load(state, storage_reader=dcp.FileSystemReader(root))
    return state["autotp"], metadata


def _check_tensors(root: Path, state: dict[str, Any], metadata: Any, prefix: str) -> None:
    stored = metadata.state_dict_metadata
    missing = [k for k in state if f"{prefix}.{k}" not in stored]
    if missing:
        have = sorted(k[len(prefix) + 1 :] for k in stored if k.startswith(prefix + "."))
        raise UserInputError(f"checkpoint {root} lacks {len(missing)} tensor(s) this model needs, e.g. {missing[:4]} "
                         f"(it holds e.g. {have[:4]}); was it saved from another model?")
    for k, t in state.items():
        if isinstance(t, ShardedLocal):
            size = tuple(getattr(stored[f"{prefix}.{k}"], "size", ()))
            if size != t.autotp_spec.global_shape:
                raise UserInputError(f"{k}: checkpoint {root} holds shape {list(size)}, the model expects "
                                 f"{list(t.autotp_spec.global_shape)}")


def _drop_absent_histories(model_state: dict[str, Any], histories: list[str], stored: dict[str, Any]) -> None:
    """FP8 amax histories that the checkpoint lacks (saved without delayed scaling, or with other
    FP8 ops) are not loaded: they stay empty and the first step seeds them."""
    for name in histories:
        size = tuple(getattr(stored.get(f"model.{name}"), "size", ()))
        if size != tuple(model_state[name].shape):
            log.info("%s: not in the checkpoint (or another shape), seeded by the first step", name)
            del model_state[name]


def load(module: nn.Module, params: Parameters, persistent: set[str], directory: str | Path,
         optimizer: Optimizer | None) -> int | None:  # fmt: skip
    """Load a checkpoint written by ``save`` at any (tp, pp, dp); returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    root = resolve_dir(directory)
    model_state = _model_state(module, params, persistent)

    def check() -> tuple[CheckpointInfo, Any]:
        if not root.is_dir():
            raise UserInputError(f"checkpoint {root} does not exist")
        info, metadata = _read_info(root)
        if optimizer is not None and info.optimizer != _optimizer_name(optimizer):
            raise UserInputError(f"checkpoint {root} holds {info.optimizer or 'no'} optimizer state, but the optimizer "
                             f"is {_optimizer_name(optimizer)}; build the same optimizer, or load without optimizer=")
        if optimizer is not None and len(info.param_groups) != len(optimizer.param_groups):
            raise UserInputError(f"checkpoint {root} holds {len(info.param_groups)} param groups, the optimizer has "
                                 f"{len(optimizer.param_groups)}; build it with the same groups")
        _drop_absent_histories(model_state, params.histories, metadata.state_dict_metadata)
        _check_tensors(root, model_state, metadata, "model")
        return info, metadata.state_dict_metadata

    info, stored = on_every_rank(check, f"loading {root}")
    state: dict[str, Any] = {"model": model_state}
    if isinstance(optimizer, ShardedOptimizer):
        ranges = optimizer.checkpoint_state(params.specs, set(params.local_names), init=True)
        state["optim"] = {n: {k: v for k, v in entry.items() if f"optim.{n}.{k}" in stored} for n, entry in ranges.items()}
        _dcp(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(root)), f"loading {root}")
        optimizer.loaded_checkpoint(state["optim"], info.param_groups)
        return info.step
    if optimizer is not None:
        _init_optim_state(optimizer)
        # parameters without state in the checkpoint (saved before their first step) start fresh
        state["optim"] = {n: {k: v for k, v in entry.items() if f"optim.{n}.{k}" in stored}
                          for n, entry in _optimizer_state(module, params, optimizer).items()}  # fmt: skip
        for n, p in module.named_parameters():
            if not state["optim"].get(n):
                optimizer.state.pop(p, None)
    _dcp(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(root)), f"loading {root}")
    if optimizer is not None:
        names = {id(get_nested(module, n)): n for n in params.local_names}
        for group, saved in zip(optimizer.param_groups, info.param_groups):
            group.update(saved)
            for p in group["params"]:
                for k, v in state["optim"][names[id(p)]].items():
                    if not isinstance(v, torch.Tensor):
                        optimizer.state[p][k] = v
    return info.step
