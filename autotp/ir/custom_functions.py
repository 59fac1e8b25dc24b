"""Custom ``torch.autograd.Function`` calls kept whole in a traced graph.

A call is recorded by ``register_call`` (at trace time: the Function, and the values of its
arguments that are not tensors) under an integer key of this process's table, and the graph
gets one ``ops.FUNCTION(tensors, key, name)`` node (or ``ops.ELEMENTWISE_FUNCTION`` for a
call proven elementwise, which propagation treats like any pointwise op). Its kernels:

* ``Autograd``: the Function's own ``apply`` on the rebuilt arguments, so autograd records
  the Function's backward, not the derivative of its forward's ops;
* ``CompositeExplicitAutograd`` and fake: the forward only, under ``no_grad`` (shapes on
  meta and FakeTensor, and any caller below autograd).

The table lives in the process that traced the model, as the graph does: every rank traces
its own graph.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import Function
from torch.library import Library
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from autotp.ir import ops
from autotp.ir.errors import UserInputError

@dataclass
class FunctionCall:
    """One traced call: the Function, its arguments with the tensors left out, and (once the
    forward has run) the structure of its output."""

    cls: type[Function]
    spec: TreeSpec  # of (args, kwargs)
    constants: list[Any]  # the leaves of (args, kwargs); None where a tensor goes
    tensor_at: tuple[int, ...]  # positions of the tensor leaves
    out_spec: TreeSpec | None = None
    out_constants: list[Any] = field(default_factory=list)  # output leaves that are not tensors

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def arguments(self, tensors: list[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.constants)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs

    def output(self, tensors: list[Tensor]) -> Any:
        """The Function's output rebuilt from the op's tensors."""
        assert self.out_spec is not None, f"{self.name} has not run"
        it = iter(tensors)
        leaves = [next(it) if c is None else c for c in self.out_constants]
        return tree_unflatten(leaves, self.out_spec)


_CALLS: list[FunctionCall] = []
_INSIDE = threading.local()


def register_call(cls: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, list[Tensor]]:
    """Record a call of ``cls``: its key and its tensor arguments (the op's inputs)."""
    leaves, spec = tree_flatten((args, kwargs))
    at = tuple(i for i, x in enumerate(leaves) if isinstance(x, Tensor))
    _CALLS.append(FunctionCall(cls, spec, [None if isinstance(x, Tensor) else x for x in leaves], at))
    return len(_CALLS) - 1, [leaves[i] for i in at]


def call(key: int) -> FunctionCall:
    return _CALLS[key]


def inside_kernel() -> bool:
    """Whether a kernel of the ops below is running (Functions its forward applies are part of it)."""
    return getattr(_INSIDE, "depth", 0) > 0


@contextmanager
def _kernel() -> Iterator[None]:
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1


def _run(key: int, inputs: list[Tensor]) -> list[Tensor]:
    fc = _CALLS[key]
    args, kwargs = fc.arguments(inputs)
    with _kernel():
        out = fc.cls.apply(*args, **kwargs)
    leaves, out_spec = tree_flatten(out)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    if fc.out_spec is None:
        fc.out_spec, fc.out_constants = out_spec, [None if isinstance(x, Tensor) else x for x in leaves]
    if not tensors:
        raise UserInputError(f"the custom autograd Function {fc.name} returns no tensor; return its result as a tensor")
    return tensors


def _apply_kernel(inputs: list[Tensor], key: int, name: str) -> list[Tensor]:
    return _run(key, inputs)


def _forward_kernel(inputs: list[Tensor], key: int, name: str) -> list[Tensor]:
    with torch.no_grad():
        return _run(key, inputs)


def _elementwise_apply_kernel(inputs: list[Tensor], key: int, name: str) -> Tensor:
    return _run(key, inputs)[0]


def _elementwise_forward_kernel(inputs: list[Tensor], key: int, name: str) -> Tensor:
    return _forward_kernel(inputs, key, name)[0]


_LIB = Library(ops.NAMESPACE, "FRAGMENT")
for _op, _apply, _forward in (
    (ops.FUNCTION, _apply_kernel, _forward_kernel),
    (ops.ELEMENTWISE_FUNCTION, _elementwise_apply_kernel, _elementwise_forward_kernel),
):
    _name = _op._schema.name.split("::")[1]
    _LIB.impl(_name, _apply, "Autograd")
    _LIB.impl(_name, _forward, "CompositeExplicitAutograd")
    torch.library.register_fake(_op, _forward, lib=_LIB)
