"""Which custom ``torch.autograd.Function`` calls the trace may take apart.

Each call recorded while tracing (``custom_functions.FunctionUse``) is run on random float64
inputs of its traced shapes, through the Function (its own backward) and through its forward's
ops, and the gradients are compared:

* equal: the backward is the forward's derivative, and the trace keeps the forward's ops;
* equal only once the forward's ``no_grad`` / ``set_grad_enabled(False)`` are left with grad
  on (``grad_left_on``): the Function runs its body without autograd and runs it again in its
  backward to differentiate it, an activation checkpoint written by hand (guided-diffusion's,
  latent diffusion's ``CheckpointFunction``). Its forward is traced with grad left on, which in
  value and gradient is the plain call (``FunctionVerdicts.recomputed``);
* otherwise (or when the check cannot run) the Function is kept whole, one node that runs it
  (``FunctionVerdicts.kept``).

A Function handed a module (the module, its bound method, a closure or partial over it) reads
that module's parameters itself: the check swaps in the user's module's own values (float64), and
the arguments that are that module's parameters (``*self.parameters()``, for the backward's
gradients) are the same tensors. Kept whole, such a Function would run on the traced copy's
parameters, so it is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.function import Function
from torch.nn.utils.stateless import _reparametrize_module

from autotp.ir.errors import UserInputError

if TYPE_CHECKING:
    from autotp.analysis.custom_functions import FunctionUse

_CHECK_NUMEL = 1 << 22  # elements of the inputs a Function's backward is checked on
_RTOL, _ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class FunctionVerdicts:
    """How the trace treats the custom Functions it checked."""

    kept: Mapping[type[Function], str] = field(default_factory=dict)  # one node running the Function itself, and why
    recomputed: frozenset[type[Function]] = frozenset()  # traced with grad left on inside the forward


def function_verdicts(uses: list[FunctionUse], real_module: Callable[[nn.Module], nn.Module | None]) -> FunctionVerdicts:
    """The verdict of every Function recorded in ``uses``: kept whole, with why (the first of its
    calls whose backward is neither its forward's derivative nor a recomputation of it, or cannot
    be checked; or calls of both kinds), or recomputed (every call a recomputation).
    ``real_module`` gives the user's module of a traced copy's module. A kept Function must not
    be handed a module (``held_module``)."""
    checked: dict[tuple, str | bool] = {}
    kept: dict[type[Function], str] = {}
    recomputed: set[type[Function]] = set()
    derivative: set[type[Function]] = set()
    keys = [(use.cls, _key_args(use)) for use in uses]  # before any check runs: a Function may change its arguments (a flag in a dict)
    for use, key in zip(uses, keys):
        if key not in checked:
            checked[key] = _verdict(use, real_module)
        verdict = checked[key]
        if isinstance(verdict, str) and use.cls not in kept:
            kept[use.cls] = f"{use.function} in module {use.module} at {use.line}: {verdict}"
        elif verdict is True:
            recomputed.add(use.cls)
        elif verdict is False:
            derivative.add(use.cls)
    for cls in recomputed & derivative - kept.keys():  # one way of tracing it all its calls cannot share
        use = next(u for u in uses if u.cls is cls)
        kept[cls] = f"{use.function}: some calls recompute their forward in backward, others differentiate it as written"
    for use, key in zip(uses, keys):
        holder = next((h for a in use.args if (h := held_module(a)) is not None), None)
        if use.cls in kept and holder is not None:
            raise UserInputError(
                f"the custom autograd Function {use.function} in module {use.module} at {use.line} is applied to "
                f"{holder[1]}, which reads that module's parameters itself; autotp keeps this Function whole (its "
                f"backward is its own: {checked[key]}) and would run it on the traced copy's "
                "parameters, not the ones it trains. Pass the tensors the Function reads as its arguments and read "
                "them there, or, for activation checkpointing, call torch.utils.checkpoint.checkpoint(fn, *inputs, "
                "use_reentrant=False), which autotp carries."
            )
    return FunctionVerdicts(kept, frozenset(recomputed - kept.keys()))


@contextmanager
def grad_left_on() -> Iterator[None]:
    """While the body runs, ``torch.no_grad()`` and ``torch.set_grad_enabled(False)`` leave grad
    mode as it is (both go through ``torch._C._set_grad_enabled``)."""
    original = torch._C._set_grad_enabled
    torch._C._set_grad_enabled = lambda mode: original(mode) if mode else None
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original


def held_module(arg: Any) -> tuple[nn.Module, str] | None:
    """The module a Function's non-tensor argument holds (so reads the parameters of), with how:
    the module itself, a bound method of it, or a partial or closure over one; None for anything else."""
    if isinstance(arg, nn.Module):
        return arg, f"a {type(arg).__name__} module"
    owner = getattr(arg, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner, f"the bound method {type(owner).__name__}.{getattr(arg, '__name__', '?')}"
    if isinstance(arg, functools.partial):
        return next((h for a in (arg.func, *arg.args, *arg.keywords.values()) if (h := held_module(a)) is not None), None)
    cells = [c.cell_contents for c in getattr(arg, "__closure__", None) or () if _filled(c)]
    module = next((c for c in cells if isinstance(c, nn.Module)), None)
    if module is not None:
        return module, f"the function {getattr(arg, '__qualname__', arg)!r}, a closure over a module"
    return None


def module_state_names(inputs: tuple[Any, ...]) -> tuple[str | None, ...]:
    """Per argument of a Function call: the name of the parameter or buffer of a module another
    argument holds that this argument is, at the call (``*self.parameters()``); else None."""
    names: dict[int, str] = {}
    for arg in inputs:
        if (held := held_module(arg)) is not None:
            names.update((id(t), n) for n, t in chain(held[0].named_parameters(), held[0].named_buffers()))
    return tuple(names.get(id(a)) if isinstance(a, torch.Tensor) else None for a in inputs)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _key_args(use: FunctionUse) -> tuple:
    """A call's arguments as the check sees them: tensors by shape and dtype, the rest by repr."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in use.args)


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


def _verdict(use: FunctionUse, real_module: Callable[[nn.Module], nn.Module | None]) -> str | bool:
    """False: the Function's backward is its forward's derivative; True: the derivative of its
    forward with grad left on inside; else why neither (or why it cannot be checked). Checked in
    float64, or where the code casts to its own dtypes (``x.float()`` into a module's fp32
    parameters), at the traced dtypes."""
    fakes = [a for a in use.args if isinstance(a, torch.Tensor)]
    if sum(a.numel() for a in fakes) > _CHECK_NUMEL:
        return "its inputs are too large to check its backward against its forward's derivative"
    try:
        return _compare(use, real_module, torch.float64)
    except Exception:  # noqa: BLE001 - tried again at the traced dtypes
        try:
            return _compare(use, real_module, None)
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return f"its backward could not be checked ({type(e).__name__}: {e})"


def _compare(use: FunctionUse, real_module: Callable[[nn.Module], nn.Module | None], dtype: torch.dtype | None) -> str | bool:
    """``_verdict`` with floating values in ``dtype`` (None: each at its own)."""
    gen = torch.Generator().manual_seed(0)
    states = _real_states(use, real_module, gen, dtype)
    if isinstance(states, str):
        return states
    by_name = {n: t for _, state in states for n, t in state.items()}

    def drawn(a: torch.Tensor) -> torch.Tensor:
        if not a.is_floating_point():
            return torch.zeros(a.shape, dtype=a.dtype)
        return torch.randn(a.shape, generator=gen, dtype=dtype or a.dtype)

    def real(a: Any, made_here: bool, name: str | None) -> Any:
        if name is not None:
            return by_name[name]
        if not isinstance(a, torch.Tensor):  # tensors inside a container (a dict of keyword arguments) are not differentiated
            return torch.utils._pytree.tree_map_only(torch.Tensor, drawn, a)
        return drawn(a).requires_grad_(a.is_floating_point() and not made_here)

    n = len(use.args)
    args = [real(*x) for x in zip(use.args, use.made_here or [False] * n, use.state_names or [None] * n)]
    leaves = list({id(t): t for t in chain(args, by_name.values()) if isinstance(t, torch.Tensor) and t.requires_grad}.values())
    takes_ctx = getattr(use.cls, "setup_context", Function.setup_context) is Function.setup_context

    def forward() -> Any:
        return use.cls.forward(*([_Ctx()] if takes_ctx else []), *args)

    with ExitStack() as swapped, torch.enable_grad():
        for module, state in states:
            swapped.enter_context(_reparametrize_module(module, state))
        own = _grads(lambda: use.cls.apply(*args), leaves)
        why = _differs(own, _grads(forward, leaves))
        if why is None:
            return False
        with grad_left_on():
            recomputed = _differs(own, _grads(forward, leaves))
    return True if recomputed is None else why


def _real_states(use: FunctionUse, real_module: Callable[[nn.Module], nn.Module | None], gen: torch.Generator,
                 dtype: torch.dtype | None) -> list[tuple[nn.Module, dict[str, torch.Tensor]]] | str:  # fmt: skip
    """Per module a call's arguments hold: the user's module's parameters and buffers (floating
    ones in ``dtype`` where given, parameters requiring grad; drawn where the user's are on
    ``meta``), to swap into the traced copy's; else why not."""
    states = []
    for held in filter(None, map(held_module, use.args)):
        source = real_module(held[0])
        if source is None:
            return f"it is handed {held[1]}, which is not a module of the model"
        state = {}
        for name, t in chain(source.named_parameters(), source.named_buffers()):
            if not t.is_floating_point():
                value = torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.detach().clone()
            elif t.is_meta:  # a structure kept for retracing: positive values keep variances and roots defined
                value = torch.rand(t.shape, generator=gen, dtype=dtype or t.dtype) + 0.5
            else:
                value = t.detach().to(dtype or t.dtype, copy=True)
            state[name] = value.requires_grad_(isinstance(t, nn.Parameter) and t.is_floating_point() and t.requires_grad)
        states.append((held[0], state))
    return states


def _differs(own: list[torch.Tensor], derived: list[torch.Tensor]) -> str | None:
    """Why the gradients ``derived`` differ from ``own`` (None: they do not)."""
    for i, (a, b) in enumerate(zip(own, derived)):
        if not torch.allclose(a, b, rtol=_RTOL, atol=_ATOL):
            return f"its backward differs from its forward's derivative for input {i}"
    return None


def _grads(run: Callable[[], Any], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``run``'s outputs (weighted by fixed draws) at ``leaves``, ``run`` drawing
    the same random numbers on every call (LSH attention's rotations). A backward that accumulates
    gradients into ``.grad`` itself (a reversible network's, by ``torch.autograd.backward`` on the
    blocks it recomputes) counts them as its own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        outs = [o for o in torch.utils._pytree.tree_leaves(run()) if isinstance(o, torch.Tensor) and o.requires_grad]
    seed = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=seed, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, weights, allow_unused=True)
    total = [torch.zeros_like(l) if g is None else g for g, l in zip(grads, leaves)]
    for i, leaf in enumerate(leaves):
        if leaf.grad is not None:
            total[i], leaf.grad = total[i] + leaf.grad, None
    return total
