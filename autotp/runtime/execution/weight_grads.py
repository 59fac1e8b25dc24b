"""The weight gradients a zero-bubble schedule's ``W`` computes after its ``B``.

Each pipeline chunk has a copy of its graph whose linears on parameter weights are
``autotp::deferred_linear`` (``passes/split_weight_grads``): their backward computes the
input and bias gradients and, while a ``WeightGradStore`` is ``collecting``, hands it
(weight, input, output gradient). ``store.apply()`` later runs the recorded weight-gradient
matmuls ``dW = dY^T · X`` (leading dimensions flattened) and accumulates them into
``.grad``. After ``B`` the autograd graph is freed as usual: until ``W`` the store holds
only each linear's input and output gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from autotp.ir import ops


class WeightGradStore:
    """The deferred weight gradients of one backward (one chunk, one microbatch)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Record the deferred weight gradients of the backward run inside."""
        ops.WEIGHT_GRAD_SINKS.append(self.record)
        try:
            yield
        finally:
            ops.WEIGHT_GRAD_SINKS.pop()

    def record(self, weight: Tensor, x: Tensor, grad_out: Tensor) -> None:
        self._pending.append((weight, x, grad_out))

    @torch.no_grad()
    def apply(self) -> None:
        """Accumulate every recorded weight gradient into its ``.grad`` and forget them.

        Without grad: ``x`` comes back from autograd's saved tensors with its history, and a
        product recorded on it would give ``.grad`` an autograd graph keeping every
        ``grad_out`` alive until the gradients are zeroed."""
        pending, self._pending = self._pending, []
        for weight, x, grad_out in pending:
            grad = grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad.add_(grad)
