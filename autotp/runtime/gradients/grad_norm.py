"""The global gradient norm with every parameter counted once, clipping, and the replica check.

A rank's gradients overlap with other ranks' in three ways: a parameter replicated over
the tp ranks (a norm weight; a KV projection that tp/kv ranks share) has a copy on each
of them, a parameter that several pipeline stages hold (a tied embedding and lm_head)
has a copy on each stage, and after the dp all-reduce every dp rank holds the same
gradients. ``NormCounting`` says which elements of this rank's tensors count: of each
tp replica group the first rank's, of each shared parameter the first stage's, of the
dp replicas dp rank 0's (the distributed optimizer's dp slices are disjoint, so there
every dp rank counts its own). The norm is then ``sqrt`` of the sum over all ranks of
the counted squares (one scalar all-reduce over the world), and clipping multiplies
every gradient by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does on the unmodified model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from autotp.ir.plan import ParallelPlan, ParamLayout

log = logging.getLogger(__name__)

Ranges = list[tuple[int, int]]  # [start, stop) along the layout's dim of the local tensor


def segment_replicas(layout: ParamLayout, tp: int) -> list[tuple[int, int]]:
    """(local length, replicas) of each segment of a sharded dim, in local order."""
    s = layout.sharding
    if s.padded:
        return [(s.local_size(tp), 1)]
    return [(seg // g * max(g // tp, 1), max(tp // g, 1)) for seg, g in zip(s.segments, s.groups)]


class NormCounting:
    """Which elements of this rank's parameters count toward a norm over all ranks."""

    def __init__(self, plan: ParallelPlan, tp_rank: int, pp_rank: int, dp_rank: int | None,
                 layouts: dict[str, ParamLayout | None], owners: dict[str, list[int]],
                 expert_counts: Callable[[str], bool | None] | None = None) -> None:  # fmt: skip
        """``owners``: parameter -> sorted pipeline ranks holding it; ``dp_rank`` None: every dp rank counts.
        ``expert_counts``: for an expert-parallel parameter, whether this rank counts all of it
        (``autotp.runtime.state.expert_parallel``); None for the others."""
        self._expert_counts = expert_counts
        self._plan = plan
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._dp_counts = dp_rank is None or dp_rank == 0
        self._layouts = layouts
        self._owners = owners
        self._masks: dict[tuple[str, tuple[int, ...]], Tensor] = {}

    def ranges(self, name: str, length: int) -> Ranges:
        """Counted ranges along the layout dim (``length``: the local tensor's size there)."""
        expert = self._expert_counts(name) if self._expert_counts is not None else None
        if expert is not None:
            return [(0, length)] if expert else []
        if not self._dp_counts or self._owners.get(name, [self._pp_rank])[0] != self._pp_rank:
            return []
        layout = self._layouts.get(name)
        if layout is None:
            return [(0, length)] if self._tp_rank == 0 else []
        out: Ranges = []
        start = 0
        for size, replicas in segment_replicas(layout, self._plan.tp):
            if self._tp_rank % replicas == 0:
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], start + size)
                else:
                    out.append((start, start + size))
            start += size
        return out

    def counted(self, name: str, t: Tensor) -> list[Tensor]:
        """The counted parts of ``t`` (this rank's tensor of parameter ``name``, or its grad)."""
        layout = self._layouts.get(name)
        dim = layout.dim if layout is not None else 0
        length = t.shape[dim] if t.dim() else 1
        ranges = self.ranges(name, length)
        if ranges == [(0, length)]:
            return [t]
        return [t.narrow(dim, a, b - a) for a, b in ranges]

    def mask(self, name: str, shape: tuple[int, ...], device: torch.device) -> bool | Tensor:
        """Which elements of a tensor of ``shape`` count: True (all), False (none) or a flat bool mask."""
        layout = self._layouts.get(name)
        dim = layout.dim if layout is not None else 0
        length = shape[dim] if shape else 1
        ranges = self.ranges(name, length)
        if ranges in ([(0, length)], []):
            return bool(ranges)
        key = (name, shape)
        if key not in self._masks:
            m = torch.zeros(shape or (1,), dtype=torch.bool, device=device)
            for a, b in ranges:
                m.narrow(dim, a, b - a).fill_(True)
            self._masks[key] = m.reshape(-1)
        return self._masks[key]


def sum_of_squares(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """Sum of the squared elements, in fp32 (per-tensor norms first, as torch's clipping does)."""
    ts = [t for t in tensors if t.numel()]
    if not ts:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(ts, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def global_norm(local_squares: Tensor, error_if_nonfinite: bool) -> Tensor:
    """sqrt of the sum of every rank's counted squares."""
    total = local_squares.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"the total norm of the gradients is {norm.item()}, so they cannot be clipped; "
            "a loss or gradient overflowed (check the loss and the learning rate), or pass error_if_nonfinite=False"
        )
    return norm


def clip_(grads: list[Tensor], norm: Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def replicas_diverged(named: list[tuple[str, Tensor]], group: dist.ProcessGroup | None, group_ranks: list[list[int]]) -> list[str]:
    """Names of the tensors that differ between the ranks of ``group`` that should hold the same values.

    ``named``: this rank's replicated tensors, in the same order on every rank;
    ``group_ranks[i]``: the group-local ranks that hold the same ``named[i]`` as this rank.
    Compares an fp64 sum and sum of squares of each tensor: identical tensors give identical checksums.
    """
    if not named:
        return []
    sums = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for _, t in named])
    world = dist.get_world_size(group)
    parts = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(parts, sums, group=group)
    out = []
    for i, (name, _) in enumerate(named):
        values = [parts[r][i] for r in group_ranks[i]]
        if any(not torch.equal(values[0], v) for v in values[1:]):
            spread = max((v - values[0]).abs().max().item() for v in values) / max(values[0].abs().max().item(), 1e-30)
            out.append(f"{name} (relative checksum spread {spread:.2e})")
    return out
