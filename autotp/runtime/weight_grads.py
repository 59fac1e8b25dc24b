"""Backward split into input gradients now and weight gradients later (zero-bubble schedules).

``defer_weight_grads(gm)`` returns a copy of a chunk graph in which every
``aten.linear`` whose weight is a parameter calls ``deferred_linear``. Its forward is
``linear``; its backward returns the gradients of the input and bias only, and, while a
``WeightGradStore`` is ``collecting``, records (weight, input, output gradient) in it.
``store.apply()`` later runs the recorded weight-gradient matmuls
``dW = dY^T · X`` (leading dimensions flattened) and accumulates them into ``.grad``.
That is the schedule's ``W``; the ``B`` is the ordinary backward, which then computes
everything except the linear weights' gradients (norm weights, embeddings and other
parameters keep theirs in ``B``; they are cheap next to the matmuls). After ``B`` the
autograd graph is freed as usual: until ``W`` the store holds only each linear's input
and output gradient.

The graphs must run eagerly: ``torch.compile`` and CUDA graphs capture a chunk's
backward as one piece, which cannot be split this way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

_collecting: list[WeightGradStore] = []  # the store the running backward records into


class WeightGradStore:
    """The deferred weight gradients of one backward (one chunk, one microbatch)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Record the deferred weight gradients of the backward run inside."""
        _collecting.append(self)
        try:
            yield
        finally:
            _collecting.pop()

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


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        x, weight = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            if not _collecting:
                raise RuntimeError("a deferred linear's backward ran outside WeightGradStore.collecting()")
            _collecting[-1].record(weight, x, grad_out)
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def deferred_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``linear(x, weight, bias)`` whose weight gradient waits for ``WeightGradStore.apply``."""
    return _DeferredLinear.apply(x, weight, bias)



_INNER = "_chunk"


def defer_weight_grads(gm: GraphModule) -> GraphModule:
    """A graph running ``gm``'s code with every linear on a parameter weight made a
    ``deferred_linear``. It reads parameters and buffers through ``gm`` at every call, so
    it follows when the runtime points ``gm`` at other tensors."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    params = dict(gm.named_parameters(remove_duplicate=False))
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            node.target = f"{_INNER}.{node.target}"
        elif node.op == "call_function" and node.target is torch.ops.aten.linear.default:
            weight = node.args[1]
            if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and str(weight.target).removeprefix(f"{_INNER}.") in params:
                node.target = deferred_linear
    holder = torch.nn.Module()
    setattr(holder, _INNER, gm)
    split = GraphModule(holder, graph)
    setattr(split, _INNER, gm)
    return split
