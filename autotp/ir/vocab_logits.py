"""This rank's part of a vocab-parallel loss's logits: the dtype it computes in, its columns
with the padded ones masked, and which targets fall in them (``ops.vocab_parallel_nll``,
``fused_loss``, the runtime's kernel); and the check that ids lie in the vocabulary."""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from autotp.ir.errors import UserInputError


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


def check_ids(ids: Tensor, vocab_size: int, what: str, skip: Tensor | None = None) -> None:
    """Refuse ids outside ``[0, vocab_size)`` (where ``skip`` is False).

    On the CPU the check raises at once with the offending values. On a GPU, and while
    tracing, it is ``torch._assert_async``: a device-side assert that fails the next
    synchronizing call, so the step never waits for the device to check.
    """
    bad = (ids < 0) | (ids >= vocab_size)
    if skip is not None:
        bad = bad & ~skip
    hint = f"{what} must lie in [0, {vocab_size}), the model's vocabulary; check the tokenizer or the model's vocab_size"
    if ids.device.type != "cpu" or isinstance(ids, FakeTensor) or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"autotp: {hint}")
    elif bad.any():
        wrong = ids[bad]
        raise UserInputError(f"{wrong.numel()} {what} are outside the vocabulary (from {wrong.min().item()} to {wrong.max().item()}); {hint}")
