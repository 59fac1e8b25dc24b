"""Grad-mode and autocast regions of a traced graph, made plain ops.

Export wraps the code under ``torch.no_grad()`` / ``torch.enable_grad()`` into a
``wrap_with_set_grad_enabled`` node and the code under ``torch.autocast(...)`` into a
``wrap_with_autocast`` node, each calling a submodule. Layout propagation and the passes see
such a node as one opaque op, so ``inline_regions`` replaces it by its body where the body's
meaning stays the same:

* grad disabled: the body reads its floating-point operands through ``aten.detach``, which is
  what ``no_grad`` means for the values it computes (writes through a detached tensor still
  reach the operand); grad enabled: the body as it is (graphs run with grad enabled).
* autocast: the body as it is where autocast changes no dtype in it (``enabled=False``, or a
  region whose ops all run at their own dtypes; checked by running the body on fake tensors
  without autocast). The graph runs as the model did only when no autocast is active around
  it: the inlined nodes carry ``meta_keys.AUTOCAST_INLINED`` and ``ParallelModel`` refuses to
  run them under one. A region that autocast does change keeps its node.

Reentrant activation checkpointing (``checkpoint(fn, *args, use_reentrant=True)``) is traced
as the call ``fn(*args)`` (``reentrant_checkpoint_as_call``): torch's ``CheckpointFunction``
runs ``fn`` under ``no_grad`` and recomputes it in backward, so in value and gradient it is the
plain call. Exported as it is, its body would be a grad-disabled region (no parameter inside
would get a gradient) and the grad mode ``Function.apply`` restores after it would be lost.
Export traces the non-reentrant variant as the plain call too. Both variants' nodes carry
``meta_keys.CHECKPOINTED`` (an ``fx.traceback.annotate`` around the call, moved out of export's
``custom`` meta by ``mark_checkpointed``): the planner recomputes the decoder layers holding them
(``checkpointed_layers``, ``ParallelPlan.recompute_layers``), so the rank graph keeps what the
model's own checkpointing kept.

Before that, ``reconnect_unchanged_region_outputs`` makes reads of a region's output that is
one of its operands unchanged read the operand (eager ``x.to(torch.float32)`` of an fp32 ``x``
returns ``x`` itself, gradient and all, even under ``no_grad``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
import torch.utils.checkpoint as checkpoint_module
from torch.utils.checkpoint import CheckpointFunction

from autotp.analysis.layers import layer_of
from autotp.ir import meta_keys

log = logging.getLogger(__name__)

SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
AUTOCAST = torch.ops.higher_order.wrap_with_autocast
REGIONS = {SET_GRAD, AUTOCAST}
# The generator that torch's non-reentrant ``checkpoint`` steps around its call (torch 2.14 calls
# ``_impl``, which takes the call's ``args`` and ``kwargs`` as two arguments; older releases the other).
NON_REENTRANT_GENERATOR = next(name for name in ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
                               if hasattr(checkpoint_module, name))  # fmt: skip
# Ops that return their operand itself when they change nothing.
_MAYBE_IDENTITY = {
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
    torch.ops.aten.to.other, torch.ops.aten.contiguous.default,
}  # fmt: skip


@contextmanager
def checkpointed() -> Iterator[None]:
    """The nodes traced inside carry ``CHECKPOINTED`` in their ``custom`` meta."""
    with fx_traceback.preserve_node_meta(), fx_traceback.annotate({meta_keys.CHECKPOINTED: True}):
        yield


@contextmanager
def reentrant_checkpoint_as_call() -> Iterator[None]:
    """While the body runs, ``CheckpointFunction.apply(fn, preserve_rng_state, *args)`` is
    ``fn(*args)``; the nodes either variant of ``checkpoint`` traces are marked checkpointed."""
    used: list[str] = []

    def call(fn: Any, preserve_rng_state: bool, *args: Any) -> Any:
        used.append(getattr(fn, "__qualname__", type(fn).__name__))
        with checkpointed():
            return fn(*args)

    def without_reentrant(fn: Any, *args: Any, **kwargs: Any) -> Any:
        used.append(getattr(fn, "__qualname__", type(fn).__name__))
        inner = generator(fn, *args, **kwargs)

        def marked() -> Iterator[None]:  # checkpoint runs fn between the generator's two steps
            with checkpointed():
                yield from inner

        return marked()

    own = CheckpointFunction.__dict__.get("apply")  # None: it inherits Function.apply
    generator = getattr(checkpoint_module, NON_REENTRANT_GENERATOR)
    CheckpointFunction.apply = staticmethod(call)  # type: ignore[method-assign,assignment]
    setattr(checkpoint_module, NON_REENTRANT_GENERATOR, without_reentrant)
    try:
        yield
    finally:
        setattr(checkpoint_module, NON_REENTRANT_GENERATOR, generator)
        if own is None:
            del CheckpointFunction.apply
        else:
            CheckpointFunction.apply = own  # type: ignore[method-assign]
    if used:
        log.info("the model checkpoints activations (torch.utils.checkpoint around %s, %d calls); the plan recomputes "
                 "the layers holding them", used[0], len(used))  # fmt: skip


def mark_checkpointed(gm: GraphModule) -> None:
    """Move the ``CHECKPOINTED`` annotation from export's ``custom`` meta onto the node."""
    for gm_ in gm.modules():
        if not isinstance(gm_, GraphModule):
            continue
        for n in gm_.graph.nodes:
            custom = n.meta.get("custom")
            if custom and custom.pop(meta_keys.CHECKPOINTED, False):
                n.meta[meta_keys.CHECKPOINTED] = True


def checkpointed_layers(gm: GraphModule) -> tuple[int, ...]:
    """The decoder layers some of whose nodes the model checkpointed itself."""
    return tuple(sorted({l for n in gm.graph.nodes if n.meta.get(meta_keys.CHECKPOINTED) and (l := layer_of(n)) is not None}))


def _body(gm: GraphModule, region: Node) -> tuple[int, GraphModule]:
    """The position of the region's submodule argument (its operands follow) and the submodule."""
    at = next(i for i, a in enumerate(region.args) if isinstance(a, Node) and a.op == "get_attr")
    return at, getattr(gm, str(region.args[at].target))


def _unchanged_operand(node: Node) -> Node | None:
    """The operand ``node`` returns as it is (a ``to`` to the same dtype and device, a
    ``contiguous`` of a contiguous tensor), else None."""
    if node.op != "call_function" or node.target not in _MAYBE_IDENTITY or not isinstance(node.args[0], Node):
        return None
    names = [a.name for a in node.target._schema.arguments]
    copied = node.kwargs.get("copy", node.args[names.index("copy")] if "copy" in names and len(node.args) > names.index("copy") else False)
    src, before, after = node.args[0], node.args[0].meta.get("val"), node.meta.get("val")
    if copied or not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    same = (before.dtype, before.device, before.shape, before.stride()) == (after.dtype, after.device, after.shape, after.stride())
    return src if same else None


def reconnect_unchanged_region_outputs(gm: GraphModule) -> None:
    """Point reads of a grad or autocast region's output that is one of its operands, unchanged
    (``x.to(torch.float32)`` of an fp32 ``x`` under ``no_grad``), back at the operand.

    Eager ``to`` returns ``x`` itself, so export records every later read of ``x`` as a read
    of the region's output, whose grad mode says "no gradient": layouts would then skip the
    backward all-reduce of the hidden states that a sharded linear reads there."""
    for region in gm.graph.nodes:
        if region.op != "call_function" or region.target not in REGIONS:
            continue
        at, sub = _body(gm, region)
        operands = dict(zip((p for p in sub.graph.nodes if p.op == "placeholder"), region.args[at + 1 :]))
        results = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        for user in list(region.users):
            if user.target is not operator.getitem or not isinstance(results, (tuple, list)):
                continue
            node = results[user.args[1]]
            while isinstance(node, Node) and node not in operands and (src := _unchanged_operand(node)) is not None:
                node = src
            if isinstance(node, Node) and isinstance(operands.get(node), Node):
                user.replace_all_uses_with(operands[node])


def inline_regions(gm: GraphModule) -> None:
    """Replace every region whose meaning inlining keeps by its body (see the module docstring)."""
    for region in list(gm.graph.nodes):
        if region.op != "call_function" or region.target not in REGIONS:
            continue
        at, sub = _body(gm, region)
        inline_regions(sub)
        if region.target is AUTOCAST and region.args[2] and _autocast_changes_dtypes(sub):
            log.debug("kept the autocast region %s: autocast changes dtypes in it", region.name)
            continue
        detach = region.target is SET_GRAD and not region.args[0]
        owner = region.args[at]
        if region.target is AUTOCAST:
            for n in sub.graph.nodes:
                n.meta[meta_keys.AUTOCAST_INLINED] = True
        _inline(gm, region, sub, list(region.args[at + 1 :]), detach)
        if not owner.users:
            gm.graph.erase_node(owner)
            delattr(gm, str(owner.target))
    gm.graph.lint()


def _inline(gm: GraphModule, region: Node, sub: GraphModule, operands: list[object], detach: bool) -> None:
    graph = gm.graph
    env: dict[Node, object] = {}
    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
    with graph.inserting_before(region):
        for p, operand in zip(placeholders, operands, strict=True):
            val = operand.meta.get("val") if isinstance(operand, Node) else None
            if detach and isinstance(val, torch.Tensor) and val.is_floating_point():
                detached = graph.call_function(torch.ops.aten.detach.default, (operand,))
                detached.meta = {**operand.meta, "val": val.detach()}
                operand = detached
            env[p] = operand
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = n.args[0]
                break
            assert n.op == "call_function", f"{region.name}: a {n.op} node in a region's body"
            env[n] = graph.node_copy(n, lambda x: env[x])
    for user in list(region.users):
        assert user.target is operator.getitem, f"{region.name} is read by {user.name} whole"
        user.replace_all_uses_with(env[results[user.args[1]]] if isinstance(results[user.args[1]], Node) else results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(region)


def _autocast_changes_dtypes(sub: GraphModule) -> bool:
    """Whether some node of ``sub`` (traced under autocast) has another dtype when run without it."""
    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
    vals = [p.meta.get("val") for p in placeholders]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return True

    changed: list[str] = []

    class _Dtypes(Interpreter):
        def run_node(self, n: Node) -> object:
            out = super().run_node(n)
            traced = n.meta.get("val")
            if isinstance(out, torch.Tensor) and isinstance(traced, torch.Tensor) and out.dtype != traced.dtype:
                changed.append(n.name)
            return out

    try:
        with FakeTensorMode(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]
            _Dtypes(sub).run(*fakes)
    except Exception:  # noqa: BLE001 - a body that cannot run alone keeps its region
        return True
    return bool(changed)
