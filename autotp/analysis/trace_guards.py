"""What ``trace`` watches for and fixes around ``torch.export``.

* **Parameters written in place.** A forward that writes a parameter in place (RWKV
  rescales its weights under ``no_grad`` the first time it runs in eval mode, behind a
  Python flag that the trace cannot see) would write it again on every call and every
  pipeline microbatch of the traced graph; ``refuse_parameter_writes`` refuses it.
* **``.data``.** ``p.data`` of a parameter or buffer is a tensor autograd does not see, which
  export lifts as a constant apart from ``p``: a read would freeze the value it had when traced, a
  write (CLIP's ``logit_scale.data.clamp_(...)``) would change nothing the graph reads.
  ``DataAsDetach`` traces it as ``p.detach()``, the same storage without the autograd edge, so a
  read follows ``p`` and a write is a parameter write (refused above).
* **Lazy modules not yet run.** ``nn.LazyLinear`` and the other lazy modules have no shapes
  until their first forward; ``refuse_lazy_parameters`` names the module.
* **Sparse gradients.** An embedding made with ``sparse=True`` gives its weight a sparse
  gradient, which no collective of a split model carries; ``sparse_gradient_node`` finds it.
* **Non-tensor outputs.** A forward that returns a cache object (or any other value that
  is neither a tensor nor a Python scalar) cannot be exported; ``strip_opaque_outputs``
  is a forward hook that replaces such values by ``None`` in the root's output.
* **Dataclasses.** A forward returning (or taking) a plain ``@dataclass`` (or an attrs class) of
  tensors is exported once its class is a pytree node: ``register_dataclasses`` registers it.
* **Gradient hooks.** A hook registered on an activation in the forward (``x.register_hook``)
  becomes a node of the graph (``custom_functions.register_tensor_hook``). A hook on a
  parameter or an input (a leaf), a post-accumulate-grad hook and a module's backward hook
  change gradients where the traced graph does not run them, so the parallel model would
  differ silently; ``GradientHookWatch`` and ``refuse_backward_hooks`` refuse them.
* **The model's own collectives.** autotp parallelizes the model as one process runs it:
  inside the traced forward ``torch.distributed.is_initialized()`` is False
  (``one_process_view``), so a forward written for data parallelism takes its one-process
  path (torchmultimodal's contrastive loss gathers the batch's embeddings over the ranks only
  when a process group exists). A forward that calls a collective anyway (``SyncBatchNorm``
  training, CLIP built with its distributed option) would run it on fake tensors, over
  whichever group it finds; ``model_collectives_refused`` refuses the call, naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.overrides import TorchFunctionMode

from autotp.analysis.custom_functions import register_tensor_hook
from autotp.ir.op_facts import mutated_base
from autotp.ir.errors import UserInputError, source_line

_DATA = torch.Tensor.data.__get__
_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single", "gather", "scatter", "reduce", "barrier",
                "send", "recv", "isend", "irecv", "batch_isend_irecv")  # fmt: skip


@contextmanager
def one_process_view(asked: list[str] | None = None) -> Iterator[None]:
    """``torch.distributed.is_initialized()`` is False: code asking whether it runs in a process
    group takes the path one process takes (the trace, and the strict rule's reference run).
    ``asked`` collects the ``file:line`` of each call."""
    import torch.distributed as dist

    initialized = dist.is_initialized

    def not_initialized() -> bool:
        if asked is not None:
            caller = sys._getframe(1)
            asked.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return False

    dist.is_initialized = not_initialized
    try:
        yield
    finally:
        dist.is_initialized = initialized


@contextmanager
def model_collectives_refused() -> Iterator[list[str]]:
    """While tracing: the model sees one process (``one_process_view``), and a ``torch.distributed``
    collective it calls anyway raises ``UserInputError``. Yields where the forward asked whether a
    process group exists (``process_group_hint``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def refusal(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise UserInputError(
                f"the forward calls torch.distributed.{name}, a collective of its own (a gather of the batch for a "
                "contrastive loss, SyncBatchNorm's statistics); autotp traces the forward into rank graphs that run "
                "the collectives it places, and cannot carry the model's own. Fix: build the model with its "
                "distributed option off (or before the process group exists: CoCa and CLIP decide when built), and "
                "do the cross-rank step outside the forward."
            )

        return refuse

    saved = [(module, name, getattr(module, name)) for module in (dist, distributed_c10d) for name in _COLLECTIVES if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, refusal(name))
    asked: list[str] = []
    try:
        with one_process_view(asked):
            yield asked
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def process_group_hint(asked: list[str], where: str) -> str:
    """For a trace that failed at ``where`` on a line that asked ``torch.distributed.is_initialized()``
    (False while tracing): a model that chose when it was built, after the process group existed, to
    gather over the ranks (x-clip's CLIP asserts a group in its gather) fails there."""
    if not any(where.startswith(f"{line} ") for line in asked):
        return ""
    return (" That line asks torch.distributed.is_initialized(), which is False while autotp traces: it parallelizes "
            "the model as one process runs it. A model that chose when built to gather over the process group fails "
            "there; build it before init_process_group (or with its distributed option off).")


class DataAsDetach(TorchFunctionMode):
    """While tracing: ``t.data`` is ``t.detach()`` (export swaps the module's parameters and
    buffers for tensors of its own, so every tensor's is: an activation's means the same)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func == _DATA:
            return args[0].detach()
        return func(*args, **(kwargs or {}))


def refuse_lazy_parameters(model: torch.nn.Module) -> None:
    """Refuse a model holding a parameter or buffer that a lazy module has not sized yet."""
    for module_name, module in model.named_modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if torch.nn.parameter.is_lazy(t):
                raise UserInputError(
                    f"{name} of module {module_name or '<root>'} ({type(module).__name__}) has no shape yet: a lazy module "
                    "sizes its parameters in its first forward; run the model once on example inputs before autotp.parallelize"
                )


def refuse_unbound_inputs(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse example inputs that the model's forward does not take under their names (a forward
    hook or pre-hook may take other ones: only an unhooked forward is checked)."""
    if model._forward_pre_hooks or model._forward_hooks:
        return
    signature = inspect.signature(model.forward)
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise UserInputError(
            f"the example inputs ({', '.join(kwargs) or 'none'}) do not fit {type(model).__name__}.forward{signature}: {e}; "
            "pass them under the forward's parameter names"
        ) from None


_SPARSE_ARG = {torch.ops.aten.embedding.default: 4, torch.ops.aten._embedding_bag.default: 5}


def sparse_gradient_node(gm: GraphModule) -> Node | None:
    """The first embedding (or ``EmbeddingBag``) whose weight gets a sparse gradient (``sparse=True``)."""
    for node in gm.graph.nodes:
        pos = _SPARSE_ARG.get(node.target) if node.op == "call_function" else None
        if pos is not None and (node.args[pos] if len(node.args) > pos else node.kwargs.get("sparse", False)):
            return node
    return None


def register_dataclasses(value: Any) -> None:
    """Make every dataclass class in ``value`` (through containers and fields) a pytree node, and
    every attrs class (``@attr.define``, ``@attr.s``: ESM 3's outputs) by its ``__attrs_attrs__``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if type(value) not in torch.utils._pytree.SUPPORTED_NODES:
            torch.export.register_dataclass(type(value))
        for field in dataclasses.fields(value):
            register_dataclasses(getattr(value, field.name))
    elif hasattr(type(value), "__attrs_attrs__") and not isinstance(value, type):
        names = [a.name for a in type(value).__attrs_attrs__ if a.init]
        if type(value) not in torch.utils._pytree.SUPPORTED_NODES:
            _register_attrs_class(type(value), names)
        for name in names:
            register_dataclasses(getattr(value, name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            register_dataclasses(item)
    elif isinstance(value, dict):
        for item in value.values():
            register_dataclasses(item)


def _register_attrs_class(cls: type, names: list[str]) -> None:
    """``cls`` a pytree node whose children are its ``names`` fields, rebuilt by its constructor."""
    key = torch.utils._pytree.GetAttrKey
    torch.utils._pytree.register_pytree_node(
        cls,
        lambda v: ([getattr(v, n) for n in names], names),
        lambda values, context: cls(**dict(zip(context, values))),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda v: ([(key(n), getattr(v, n)) for n in names], names),
    )


def strip_opaque_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: ``output`` with every value that is not a tensor or a plain scalar set to
    None (a dataclass of them is registered and kept)."""
    register_dataclasses(output)
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


_HOOK_FIX = (
    "autotp runs the traced forward, which records only hooks registered on tensors computed in the forward, so the "
    "parallel model would compute other gradients than this one. Fix: register the hook on a tensor the forward "
    "computes (an activation), write the gradient change as a torch.autograd.Function (its backward runs as written, "
    "and autotp shards around it), or remove the hook before autotp.parallelize"
)


_GRADIENTS_TAKEN = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


class GradientHookWatch(TorchFunctionMode):
    """Puts a hook registered on an activation in the forward (``x.register_hook(fn)``: a
    gradient scaled or reversed there) into the graph; refuses one on a leaf (a parameter,
    an input) and a post-accumulate-grad hook, and a gradient taken in the forward
    (``torch.autograd.grad``: a test-time memory's inner step, a gradient penalty), which
    export computes once, on the trace's values, and keeps as a constant. ``stack``: the
    executing-submodule stack that ``trace`` keeps."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not torch.compiler.is_dynamo_compiling():
            if func is torch.Tensor.register_hook and args[0].requires_grad and not args[0].is_leaf:
                return register_tensor_hook(args[0], *args[1:], **(kwargs or {}), stack=self.stack)
            if func is torch.Tensor.register_hook and args[0].requires_grad:
                raise UserInputError(f"the forward registers a gradient hook on a parameter or an input (a leaf tensor, register_hook); {_HOOK_FIX}")
            if func is torch.Tensor.register_post_accumulate_grad_hook:
                raise UserInputError(f"the forward registers a gradient hook on a tensor ({func.__name__}); {_HOOK_FIX}")
            if func in _GRADIENTS_TAKEN:
                raise UserInputError(
                    f"the forward takes a gradient ({func.__module__}.{func.__qualname__}), which torch.export "
                    f"computes once while tracing and keeps as a constant, so no step would compute it. Fix: write "
                    f"that gradient as ops of the forward (its closed form: for a loss mean((x @ w.T - y)**2), "
                    f"2 * (x @ w.T - y).T @ x / n), or take it outside the model's forward"
                )
        return func(*args, **(kwargs or {}))


def refuse_backward_hooks(model: torch.nn.Module) -> None:
    """Refuse a model with a module backward hook (``register_full_backward_hook`` and its
    pre-hook, on a module or global)."""
    from torch.nn.modules import module as module_hooks

    if module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks:
        raise UserInputError(f"a global module backward hook is registered (torch.nn.modules.module.register_module_full_backward_hook); {_HOOK_FIX}")
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise UserInputError(f"module {name or '<root>'} ({type(module).__name__}) has a backward hook; {_HOOK_FIX}")
