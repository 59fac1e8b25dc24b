"""Custom ``torch.autograd.Function`` calls during tracing.

Export records a Function's forward as aten ops, and autograd later differentiates those,
not the Function's own ``backward``: a straight-through estimator or a hand-written router
backward would silently get other gradients. So ``trace`` runs in two steps:

1. ``custom_functions`` records every Function applied to a floating-point tensor (those
   in ``torch`` itself, and those that torch generates for ``torch.library`` custom ops,
   stay as they are), by wrapping the ``forward`` of every Function class. ``function_verdicts`` runs each recorded call on random inputs of the
   traced shapes, once through the Function and once through its forward's ops
   (``function_checks``), and keeps the Functions whose gradients differ (or that are too large to check); an input the
   forward made from none of the graph's inputs (LoHa's ``torch.tensor(scale)``) gets no
   gradient either way, so what the backward returns for it is not compared. A hand-written
   backward that is the forward's derivative (Bloom's GELU) is traced through, so the
   layout rules see its ops. A Function whose forward runs its body under ``no_grad`` and whose
   backward runs it again to differentiate it (an activation checkpoint written by hand, as
   guided-diffusion's and latent diffusion's) has the derivative of its forward taken with grad
   left on inside: such a Function is traced through that way (``FunctionVerdicts.recomputed``),
   its nodes marked checkpointed as ``torch.utils.checkpoint``'s are. A Function handed a module
   (a bound method, a closure over one) is checked on the user's module's own values.
2. If any is kept or recomputed, the model is traced again with ``custom_functions(stack, verdicts)``: each
   call of a kept Function becomes one ``ops.FUNCTION`` node whose autograd is the
   Function's own (``autotp.ir.custom_functions``). ``mark_elementwise`` then turns the
   calls that are elementwise in forward and backward (one output, every tensor of the
   forward and backward the output's shape or a scalar, pointwise ops only) into
   ``ops.ELEMENTWISE_FUNCTION``, which runs on shards like any pointwise op; the others
   run on replicated inputs.

A hook registered on a tensor in the forward (``t.register_hook(fn)``) is the same thing: an
identity whose backward is ``fn``. ``register_tensor_hook`` puts it into the graph as an
``ops.FUNCTION`` call of ``HookedIdentity`` where it is registered, and ``route_through_hooks``
moves it to right after ``t`` with every other use of ``t`` reading it, so that ``fn`` gets the
gradient of all of them, as autograd gives it (uses before the registration too). The elementwise
ones (``grad * 0.5``, a clamp, a hook that only stores its gradient) then run on shards and get
this rank's piece of the gradient; one that reads the whole gradient (``grad / grad.norm()``)
runs on replicated inputs and gets all of it. ``mark_elementwise`` and ``batch_rows`` call
``fn`` on fake tensors to tell, and to tell whether it mixes the batch's rows.
"""

from __future__ import annotations

import functools
import inspect
import operator
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.function import Function, _is_setup_context_defined
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.utils.hooks import RemovableHandle

from autotp.analysis.function_checks import FunctionVerdicts, grad_left_on, module_state_names
from autotp.analysis.trace_regions import checkpointed
from autotp.ir import custom_functions as calls
from autotp.ir import ops
from autotp.ir.op_facts import is_pointwise

aten = torch.ops.aten
# Ops that keep an elementwise computation elementwise although torch does not tag them pointwise.
_ELEMENTWISE_UNTAGGED = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.view.default, aten.reshape.default, aten.expand.default,
}  # fmt: skip


@dataclass(frozen=True)
class FunctionUse:
    """A custom ``autograd.Function`` applied during tracing, and where."""

    cls: type[Function]
    args: tuple[Any, ...]  # as traced (fake tensors)
    module: str  # the innermost executing submodule
    line: str  # the calling source line
    made_here: tuple[bool, ...] = ()  # per arg: a tensor the forward made from none of the graph's inputs (no gradient reaches it)
    state_names: tuple[str | None, ...] = ()  # per arg: the parameter or buffer it is of a module another arg holds

    @property
    def function(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


@contextmanager
def custom_functions(stack: list[str], verdicts: FunctionVerdicts = FunctionVerdicts()) -> Iterator[list[FunctionUse]]:
    """Record the custom Functions applied to floating-point tensors while the body runs, put
    each call of a Function ``verdicts`` keeps into the graph as one ``ops.FUNCTION`` node, and
    trace the forward of each it recomputes with grad left on, marked checkpointed.

    Each Function's ``forward`` is wrapped, not ``Function.apply``: autograd calls the
    class's ``forward`` however ``apply`` was reached (``act = MyFunction.apply`` bound at
    import time too). ``stack`` is the executing-submodule stack that ``trace`` keeps.
    """
    uses: list[FunctionUse] = []
    # a subclass that inherits its forward gets a wrapper of its own: its backward may be its own
    classes = _function_classes()
    originals = {cls: inspect.getattr_static(cls, "forward") for cls in classes}
    own = {cls for cls in classes if "forward" in cls.__dict__}
    for cls, original in originals.items():
        setattr(cls, "forward", staticmethod(_recording_forward(cls, original, uses, stack, verdicts)))
    try:
        yield uses
    finally:
        for cls, original in originals.items():
            if cls in own:
                setattr(cls, "forward", original)
            else:
                delattr(cls, "forward")


def _made_here(arg: Any) -> bool:
    """Whether ``arg`` is a tensor the traced forward computed from none of the graph's inputs
    (parameters, buffers and the caller's tensors are all inputs of export's graph), such as
    ``torch.tensor(scale)``: whatever a Function's backward returns for it is never read."""
    mode = get_proxy_mode()
    slot = get_proxy_slot(arg, mode.tracer, None) if mode is not None and isinstance(arg, torch.Tensor) else None
    if slot is None:
        return False
    seen, stack = set(), [slot.proxy.node]
    while stack:
        node = stack.pop()
        if node.op == "placeholder":
            return False
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return True


def _function_classes() -> list[type[Function]]:
    """Every subclass of ``Function`` defined outside torch and autotp whose ``forward`` is
    defined outside torch (its own or a base class's)."""
    seen: set[type[Function]] = set()
    todo = list(Function.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    outside = [c for c in seen if not c.__module__.startswith(("torch.", "autotp."))]
    return [c for c in outside if any("forward" in b.__dict__ and not b.__module__.startswith("torch.") for b in c.__mro__)]


def _recording_forward(cls: type[Function], original: Any, uses: list[FunctionUse], stack: list[str], verdicts: FunctionVerdicts) -> Any:
    fn = original.__func__ if isinstance(original, staticmethod) else original
    takes_ctx = not _is_setup_context_defined(cls.setup_context)

    @functools.wraps(fn)  # Function.apply binds default arguments by forward's signature
    def forward(*args: Any, **kwargs: Any) -> Any:
        if calls.inside_kernel():
            return fn(*args, **kwargs)
        inputs = args[1:] if takes_ctx else args
        if cls in verdicts.kept:
            key, tensors = calls.register_call(cls, inputs, kwargs)
            return calls.call(key).output(ops.FUNCTION(tensors, key, calls.call(key).name))
        if cls in verdicts.recomputed:
            with grad_left_on(), checkpointed():
                return fn(*args, **kwargs)
        # grad mode is not checked: a graph traced under no_grad may later run for training
        if any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in torch.utils._pytree.tree_leaves((inputs, kwargs))):
            where = stack[-1] if stack else "<root>"
            uses.append(FunctionUse(cls, inputs, where, _caller_line(), tuple(map(_made_here, inputs)), module_state_names(inputs)))
        return fn(*args, **kwargs)

    return forward


def _caller_line() -> str:
    ours = str(Path(__file__).resolve().parents[1])  # the autotp package
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and not f.filename.startswith(ours)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "unknown line"


@dataclass(eq=False)
class TensorHook:
    """A hook registered on a tensor in the forward, and where."""

    fn: Callable[[torch.Tensor], torch.Tensor | None]
    where: str  # the module and source line of the registration
    # the registration's handle, emptied when the forward removes the hook (RemovableHandle refers to it weakly, as a dict cannot be)
    handles: OrderedDict[int, Any] = field(default_factory=OrderedDict)


class HookedIdentity(Function):
    """The identity whose backward is a tensor hook: ``fn(grad)``, or ``grad`` where it returns None."""

    @staticmethod
    def forward(x: torch.Tensor, hook: TensorHook) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.hook = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        changed = ctx.hook.fn(grad)
        return (grad if changed is None else changed), None


def register_tensor_hook(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor | None], stack: list[str]) -> RemovableHandle:
    """What ``t.register_hook(fn)`` does while tracing: an ``ops.FUNCTION`` call of ``HookedIdentity``
    on ``t`` that nothing reads until ``route_through_hooks``."""
    hook = TensorHook(fn, f"module {stack[-1] if stack else '<root>'} at {_caller_line()}")
    handle = RemovableHandle(hook.handles)
    hook.handles[handle.id] = fn
    key, tensors = calls.register_call(HookedIdentity, (t, hook), {})
    ops.FUNCTION(tensors, key, f"register_hook in {hook.where}")
    return handle


def route_through_hooks(gm: GraphModule) -> None:
    """Move each tensor hook's node to right after its tensor, every other use of the tensor reading
    it instead; drop the hooks the forward removed. Taken last to first, hooks on one tensor end up
    chained so that the first registered gets the gradient first, as in autograd."""
    for node in reversed(list(gm.graph.nodes)):
        hook = tensor_hook(node)
        if hook is None:
            continue
        getters = list(node.users)
        if not hook.handles:
            for getter in getters:
                gm.graph.erase_node(getter)
            gm.graph.erase_node(node)
            continue
        if not getters:
            with gm.graph.inserting_after(node):
                getters = [gm.graph.call_function(operator.getitem, (node, 0))]
            getters[0].meta = {**node.meta, "val": node.meta["val"][0]}
        (source,), (getter,) = node.args[0], getters
        source.replace_all_uses_with(getter, delete_user_cb=lambda user: user is not node)
        source.append(node)
        node.append(getter)
    gm.graph.lint()


def hook_gradient_graph(node: Node) -> GraphModule | None:
    """The gradient change of the tensor hook at ``node``, traced on a fake gradient of its
    tensor's shape (one input, the gradient; one output, the one that replaces it); None where
    ``node`` is no hook's, or the hook cannot be traced alone."""
    hook = tensor_hook(node)
    val = node.args[0][0].meta.get("val") if hook is not None else None
    if not isinstance(val, torch.Tensor):
        return None

    def changed(grad: torch.Tensor) -> torch.Tensor:
        out = hook.fn(grad)
        return grad if out is None else out

    try:
        with FakeTensorMode():
            return make_fx(changed)(torch.empty(val.shape, dtype=val.dtype))
    except Exception:  # noqa: BLE001 - a hook that cannot be traced alone is not proven to keep rows apart
        return None


def tensor_hook(node: Node) -> TensorHook | None:
    """The tensor hook whose call ``node`` is, if it is one."""
    if node.target is not ops.FUNCTION or calls.call(node.args[1]).cls is not HookedIdentity:
        return None
    return next(c for c in calls.call(node.args[1]).constants if isinstance(c, TensorHook))


def mark_elementwise(gm: GraphModule) -> None:
    """Turn each ``ops.FUNCTION`` node whose call is elementwise, forward and backward, into an
    ``ops.ELEMENTWISE_FUNCTION`` node (its one output replaces the ``getitem`` of it)."""
    for node in list(gm.graph.nodes):
        if node.target is not ops.FUNCTION or not _is_elementwise(node):
            continue
        (getter,) = node.users
        with gm.graph.inserting_before(node):
            single = gm.graph.call_function(ops.ELEMENTWISE_FUNCTION, node.args)
        single.meta = {**node.meta, "val": getter.meta["val"]}
        getter.replace_all_uses_with(single)
        gm.graph.erase_node(getter)
        gm.graph.erase_node(node)
    gm.graph.lint()


def _is_elementwise(node: Node) -> bool:
    """Whether the call at ``node`` maps each element of its inputs to the element at the same
    position of its one output, forward and backward (traced on fake inputs of its shapes)."""
    outs = node.meta.get("val")
    users = list(node.users)
    if not isinstance(outs, (list, tuple)) or len(outs) != 1 or len(users) != 1 or users[0].target is not operator.getitem:
        return False
    shape = tuple(outs[0].shape)
    inputs = [a.meta.get("val") for a in node.args[0]]
    if not all(isinstance(v, torch.Tensor) and tuple(v.shape) in (shape, ()) for v in inputs):
        return False
    fc = calls.call(node.args[1])

    def joint(xs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
        args, kwargs = fc.arguments(xs)
        out = fc.cls.apply(*args, **kwargs)
        (y,) = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        wrt = [x for x in xs if x.requires_grad]
        if not y.requires_grad or not wrt:
            return [y]
        return [y, *(g for g in torch.autograd.grad([y], wrt, [grad], allow_unused=True) if g is not None)]

    try:
        with FakeTensorMode(), torch.enable_grad():
            xs = [torch.empty(v.shape, dtype=v.dtype).requires_grad_(v.is_floating_point()) for v in inputs]
            grad = torch.empty(shape, dtype=outs[0].dtype)
            graph = make_fx(joint)(xs, grad).graph
    except Exception:  # noqa: BLE001 - a call that cannot be traced alone is not proven elementwise
        return False
    for n in graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) not in (shape, ()):
            return False
        if n.op != "call_function":
            continue
        if n.target is aten.lift_fresh_copy.default and tuple(val.shape) == ():  # a scalar the call makes (``torch.tensor(scale)``)
            continue
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags or (not is_pointwise(n.target) and n.target not in _ELEMENTWISE_UNTAGGED):
            return False
    return True
