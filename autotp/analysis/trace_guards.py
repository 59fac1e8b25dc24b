"""What ``trace`` watches for and fixes around ``torch.export``.

* **Custom autograd Functions.** Export records a Function's forward as aten ops and
  autograd later differentiates those, not the Function's own ``backward``: a
  straight-through estimator or a hand-written router backward would silently get
  other gradients. ``custom_functions`` records every Function applied to a floating-point
  tensor (those that torch generates for ``torch.library`` custom ops stay in the graph
  as the op, with their backward, and are not recorded). ``refuse_custom_functions``
  runs each recorded call on random inputs of the traced shapes, once through the
  Function and once through its forward's ops, and refuses the model, naming the
  Function and its module, when the gradients differ (or when the inputs are too large
  to check); a hand-written backward that is the forward's derivative (Bloom's GELU) passes.
* **Parameters written in place.** A forward that writes a parameter in place (RWKV
  rescales its weights under ``no_grad`` the first time it runs in eval mode, behind a
  Python flag that the trace cannot see) would write it again on every call and every
  pipeline microbatch of the traced graph; ``refuse_parameter_writes`` refuses it.
* **Non-tensor outputs.** A forward that returns a cache object (or any other value that
  is neither a tensor nor a Python scalar) cannot be exported; ``strip_opaque_outputs``
  is a forward hook that replaces such values by ``None`` in the root's output.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.function import Function
from torch.fx import GraphModule, Node

from autotp.ir.op_facts import mutated_base
from autotp.ir.errors import UserInputError, source_line

_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)


_CHECK_NUMEL = 1 << 22  # elements of the inputs a Function's backward is checked on
_RTOL, _ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class FunctionUse:
    """A custom ``autograd.Function`` applied during tracing, and where."""

    cls: type[Function]
    args: tuple[Any, ...]  # as traced (fake tensors)
    module: str  # the innermost executing submodule
    line: str  # the calling source line

    @property
    def function(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


@contextmanager
def custom_functions(stack: list[str]) -> Iterator[list[FunctionUse]]:
    """Record the custom Functions applied to floating-point tensors while the body runs.

    ``stack`` is the executing-submodule stack that ``trace`` keeps.
    """
    uses: list[FunctionUse] = []
    original = Function.__dict__["apply"]

    def apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        # grad mode is not checked: a graph traced under no_grad may later run for training
        if not cls.__module__.startswith("torch.") and any(t.is_floating_point() for t in tensors):
            uses.append(FunctionUse(cls, args, stack[-1] if stack else "<root>", _caller_line()))
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield uses
    finally:
        Function.apply = original  # type: ignore[method-assign]


def _caller_line() -> str:
    ours = str(Path(__file__).resolve().parents[1])  # the autotp package
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and not f.filename.startswith(ours)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "unknown line"


def refuse_custom_functions(model_name: str, uses: list[FunctionUse]) -> None:
    """Raise ``ValueError`` naming the first custom Function whose backward is not its forward's derivative."""
    checked: dict[tuple, str | None] = {}
    for use in uses:
        key = (use.cls, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in use.args))
        if key not in checked:
            checked[key] = _backward_differs(use)
        why = checked[key]
        if why is None:
            continue
        raise UserInputError(
            f"{model_name} applies the custom autograd Function {use.function} in module {use.module} at "
            f"{use.line}: {why}. torch.export records its forward only, so its own backward would be replaced by "
            f"the derivative of the forward's ops and the gradients would differ from the model's. Fix: express it "
            f"with differentiable torch ops (a straight-through estimator is x + (f(x) - x).detach()), or register "
            f"it as a torch.library custom op with register_autograd."
        )


class _Ctx:
    """What a Function's ``forward`` may call on ``ctx`` when run outside autograd."""

    def __init__(self) -> None:
        self.saved_tensors: tuple[torch.Tensor, ...] = ()
        self.needs_input_grad: tuple[bool, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _backward_differs(use: FunctionUse) -> str | None:
    """Why the Function's own backward cannot be replaced by its forward's derivative (None: it can)."""
    fakes = [a for a in use.args if isinstance(a, torch.Tensor)]
    if sum(a.numel() for a in fakes) > _CHECK_NUMEL:
        return "its inputs are too large to check its backward against its forward's derivative"
    gen = torch.Generator().manual_seed(0)

    def real(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if not a.is_floating_point():
            return torch.zeros(a.shape, dtype=a.dtype)
        return torch.randn(a.shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    args = [real(a) for a in use.args]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    try:
        with torch.enable_grad():
            own = _grads(lambda: use.cls.apply(*args), leaves)
            if getattr(use.cls, "setup_context", Function.setup_context) is not Function.setup_context:
                derived = _grads(lambda: use.cls.forward(*args), leaves)
            else:
                derived = _grads(lambda: use.cls.forward(_Ctx(), *args), leaves)
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return f"its backward could not be checked ({type(e).__name__}: {e})"
    for i, (a, b) in enumerate(zip(own, derived)):
        if not torch.allclose(a, b, rtol=_RTOL, atol=_ATOL):
            return f"its backward differs from its forward's derivative for input {i}"
    return None


def _grads(run: Any, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    outs = [o for o in torch.utils._pytree.tree_leaves(run()) if isinstance(o, torch.Tensor) and o.requires_grad]
    seed = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=seed, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, weights, allow_unused=True)
    return [torch.zeros_like(l) if g is None else g for g, l in zip(grads, leaves)]


def strip_opaque_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: ``output`` with every value that is not a tensor or a plain scalar set to None."""
    leaves, spec = torch.utils._pytree.tree_flatten(output)
    if all(isinstance(x, _PLAIN) for x in leaves):
        return output
    return torch.utils._pytree.tree_unflatten([x if isinstance(x, _PLAIN) else None for x in leaves], spec)


def refuse_parameter_writes(model_name: str, gm: GraphModule) -> None:
    """Raise ``UserInputError`` naming the first parameter that the traced forward writes in place."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    roots = {n: str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in params}
    found = _parameter_write(gm, roots)
    if found is None:
        return
    name, node = found
    line = source_line(node) or "an unknown line"
    raise UserInputError(
        f"the forward of {model_name} writes its parameter {name} in place ({node.target} at {line}). autotp runs the "
        f"traced forward on every call and every pipeline microbatch, so the write would repeat there, while the "
        f"model may do it once (behind a Python flag the trace cannot see) and autograd may need the old value. "
        f"Fix: do the write before parallelize (for a write on the first call only, run the model once in the mode "
        f"it will run in), or keep the value in a buffer or a tensor computed in forward."
    )


def _parameter_write(gm: GraphModule, roots: dict[Node, str]) -> tuple[str, Node] | None:
    """(parameter, writing node) for the first in-place write of a parameter in ``gm``, looking
    into the subgraphs of higher-order ops (``wrap_with_set_grad_enabled``), whose operands
    follow the subgraph's ``get_attr``; ``roots``: the nodes that are parameters."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        base = mutated_base(node)
        if base is not None and base in roots:
            return roots[base], node
        for i, a in enumerate(node.args):
            sub = getattr(gm, str(a.target), None) if isinstance(a, Node) and a.op == "get_attr" else None
            if not isinstance(sub, GraphModule):
                continue
            placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
            inner = {p: roots[o] for p, o in zip(placeholders, node.args[i + 1 :]) if isinstance(o, Node) and o in roots}
            found = _parameter_write(sub, inner) if inner else None
            if found is not None:
                return found
    return None
