"""Fill the shards of a model built on ``meta``: from an HF checkpoint, then the model's init."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist
from torch import nn

from autotp.ir.errors import UserInputError
from autotp.runtime.state.checkpoint_hf import LoadJob, check_architecture, check_job, checkpoint_tensors, model_sources, read_jobs
from autotp.runtime.state.init_meta import initialize
from autotp.runtime.state.parameters import Parameters, get_nested

T = TypeVar("T")
log = logging.getLogger(__name__)


def on_every_rank(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank; if it raises ``ValueError`` or ``OSError`` on any rank,
    raise on every rank with that rank's message (instead of leaving the others waiting)."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except (ValueError, OSError) as e:
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        messages: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed and error is None:
            rank, message = failed[0]
            raise UserInputError(f"{what} failed on rank {rank}: {message}")
    if error is not None:
        raise error
    return result  # type: ignore[return-value]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def load_hf_checkpoint(root_module: nn.Module, params: Parameters, model: nn.Module, checkpoint: str | Path,
                       threads: int = 8) -> tuple[set[str], int]:  # fmt: skip
    """Read this rank's slices of ``checkpoint``; returns the names filled and the bytes read."""
    root = Path(checkpoint)

    def plan() -> list[LoadJob]:
        tensors = checkpoint_tensors(root)
        check_architecture(root, model)
        sources = model_sources(model, tensors)
        persistent = set(model.state_dict(keep_vars=True))
        unused = sorted(set(sources) - persistent)
        if unused and _rank0():
            log.warning("checkpoint %s holds %d tensor(s) that the model does not use, e.g. %s", root, len(unused), unused[:4])
        jobs, missing = [], []
        for name in params.local_names + [b for b in params.buffer_names if b in persistent]:
            source = next((sources[a] for a in params.aliases.get(name, [name]) if a in sources), None)
            if source is not None:
                jobs.append(LoadJob(params.specs[name], get_nested(root_module, name), source))
            elif name in params.local_names:
                missing.append(name)
        if missing:
            raise UserInputError(f"checkpoint {root} lacks {len(missing)} tensor(s) that the model expects, e.g. "
                             f"{missing[:4]}; it holds e.g. {sorted(sources)[:4]}. Is it a checkpoint of this "
                             "architecture and configuration?")
        for job in jobs:
            check_job(job)
        return jobs

    jobs = on_every_rank(plan, f"reading checkpoint {root}")
    read = on_every_rank(lambda: read_jobs(jobs, threads, _rank0()), f"reading checkpoint {root}")
    return {job.spec.name for job in jobs}, read


def materialize(root_module: nn.Module, params: Parameters, model: nn.Module, checkpoint: str | Path | None,
                seed: int) -> int:  # fmt: skip
    """Load ``checkpoint`` (if given), then initialize what is still unfilled; returns bytes read."""
    if params.device.type == "meta":  # an inspection-only model: nothing to fill
        if checkpoint is not None:
            raise UserInputError(f"checkpoint={checkpoint} needs a real device, but device is meta; pass device='cpu' or 'cuda'")
        return 0
    loaded, read = load_hf_checkpoint(root_module, params, model, checkpoint) if checkpoint is not None else (set(), 0)
    todo = params.unfilled - loaded
    if todo:
        on_every_rank(lambda: initialize(root_module, params, model, seed, todo, _rank0()), "initializing shards")
    params.unfilled.clear()
    return read
