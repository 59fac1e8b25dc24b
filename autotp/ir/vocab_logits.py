"""This rank's part of a vocab-parallel loss's logits: the dtype it computes in, its columns
with the padded ones masked, and which targets fall in them (``ops.vocab_parallel_nll``,
``fused_loss``, the runtime's kernel)."""

from __future__ import annotations

import torch
from torch import Tensor


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a vocab-parallel loss computes in: float32, or the logits' own if wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def local_logits(logits: Tensor, vocab_start: int, vocab_size: int) -> Tensor:
    """This rank's logits in ``loss_dtype``, with the padded vocabulary columns at -inf (they never win)."""
    x = logits.to(loss_dtype(logits.dtype))
    n_local = x.shape[-1]
    if vocab_start + n_local > vocab_size:
        pad = torch.arange(n_local, device=x.device) + vocab_start >= vocab_size
        x = x.masked_fill(pad, float("-inf"))
    return x


def target_in_range(target: Tensor, vocab_start: int, n_local: int) -> tuple[Tensor, Tensor]:
    """Whether each target is one of this rank's columns, and its local column (0 if not)."""
    in_range = (target >= vocab_start) & (target < vocab_start + n_local)
    return in_range, (target - vocab_start).masked_fill(~in_range, 0)
