"""Trace an unmodified model into an aten-level ``GraphModule``.

Tracing uses non-strict ``torch.export`` on a *fake* copy of the model: its parameters
are fake tensors on the device the graph will run on. The copy shares no storage with
the original and allocates nothing, so a model on the CPU, a GPU or the meta device
traces the same way. The device matters: HF code branches on it (Mixtral's ``histc``
casts to float on CPU only), so a graph must be traced for the device that runs it.
Parameters keep their original dotted names as ``get_attr`` targets.

Shapes are concrete: every new input signature (names, shapes, dtypes) is traced once
and cached by ``ParallelModel``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch._dynamo._trace_wrapped_higher_order_op import mod_index
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode, UnsupportedOperatorException
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from autotp.analysis.batch_size_constants import refuse_batch_size_constants
from autotp.analysis.batch_rows import UNKNOWN_ROWS, batch_rows_at, batch_size, input_row_dims
from autotp.analysis.loss_denominators import behind_parameter_free_scalars, normalize_loss_denominators
from autotp.analysis.custom_functions import FunctionUse, custom_functions, mark_elementwise, route_through_hooks
from autotp.analysis.function_checks import FunctionVerdicts, function_verdicts
from autotp.analysis.host_draws import host_calls, host_draw_refusal, host_random_states, unseeded_draw
from autotp.analysis.trace_decompose import decompose_simple_composites, decompose_parameter_ops, draw_by_size, shape_by_size, squeeze_traced_dims
from autotp.analysis.trace_control_flow import guarded_control_flow, refuse_broken_loops
from autotp.analysis.trace_globals import global_state_restored
from autotp.analysis.trace_guards import DataAsDetach, GradientHookWatch, model_collectives_refused, process_group_hint, refuse_backward_hooks, refuse_lazy_parameters, refuse_parameter_writes, refuse_unbound_inputs, register_dataclasses, strip_opaque_outputs
from autotp.analysis.trace_regions import inline_regions, mark_checkpointed, reconnect_unchanged_region_outputs, reentrant_checkpoint_as_call
from autotp.analysis.trace_sizes import TRACER_ROOTS, assumed_sizes, name_assumptions
from autotp.ir import meta_keys
from autotp.ir.batch_draws import REPLAYED, from_default_generator
from autotp.ir.errors import UserInputError

log = logging.getLogger(__name__)

_DROPPED_TARGETS = {torch.ops.aten._assert_tensor_metadata.default}


def _fake_copy(model: nn.Module, kwargs: dict[str, Any], device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """``model`` and ``kwargs`` with every tensor replaced by a fake one on ``device``."""
    mode = FakeTensorMode()
    memo: dict[int, Any] = {}
    with mode:
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in memo:
                continue
            fake = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
        fake_kwargs = torch.utils._pytree.tree_map(
            lambda x: torch.empty(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x, kwargs
        )
    return copy.deepcopy(model, memo), fake_kwargs


def _real_modules(model: nn.Module, fake_model: nn.Module) -> Callable[[nn.Module], nn.Module | None]:
    """The module of ``model`` that a module of its fake copy (``_fake_copy``) copies. Found by the
    copy's ``__dict__``, which the proxies export makes of a module read through several paths share."""
    pairs = {id(f.__dict__): m for (_, f), (_, m) in zip(fake_model.named_modules(remove_duplicate=False), model.named_modules(remove_duplicate=False))}
    return lambda module: pairs.get(id(module.__dict__))


def _real_buffers(model: nn.Module) -> Callable[[str], torch.Tensor | None]:
    """The user's model's buffer of a name (its fake copy's buffers carry no values)."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return buffers.get


def structure_copy(model: nn.Module, branch_buffers: tuple[str, ...] = ()) -> nn.Module:
    """A copy of ``model`` with parameters and buffers on ``meta``, kept for retracing; but
    one-element buffers (a flag) and ``branch_buffers`` (``ParallelPlan.branch_buffers``), whose
    values a retrace's branches test, copied."""
    memo: dict[int, Any] = {}
    named = dict(model.named_buffers(remove_duplicate=False))
    buffers = {id(b) for b in named.values()}
    kept = {id(named[n]) for n in branch_buffers if n in named}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in buffers and (t.numel() == 1 or id(t) in kept):
            memo[id(t)] = t.detach().clone()
        elif id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


@contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """Track which submodule is executing, to name it when tracing fails."""
    stack: list[str] = []
    handles = []
    for name, mod in model.named_modules():
        label = f"{name or '<root>'} ({type(mod).__name__})"
        handles.append(mod.register_forward_pre_hook(lambda m, a, label=label: _push(stack, label)))
        handles.append(mod.register_forward_hook(lambda m, a, o: _pop(stack)))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _push(stack: list[str], label: str) -> None:
    # Inside a higher-order op's body (torch.cond) dynamo refuses writes to outside state.
    if not torch.compiler.is_dynamo_compiling():
        stack.append(label)


def _pop(stack: list[str]) -> None:
    # A forward hook that returns a value would replace the module's output.
    if stack and not torch.compiler.is_dynamo_compiling():
        stack.pop()


# FakeTensor logs each failed meta kernel with its traceback (~70 lines) before the error
# that autotp turns into one line; those records go to the debug log instead.
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"


@contextmanager
def _held_log(name: str) -> Iterator[list[logging.LogRecord]]:
    """Keep the records of logger ``name`` from its handlers while tracing; yield them."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    logger = logging.getLogger(name)
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)


@contextmanager
def _distribution_checks_off() -> Iterator[None]:
    """``torch.distributions`` checks its arguments by value (``if not valid.all(): raise``),
    a data-dependent branch that export cannot trace; the trace runs without those checks,
    which only raise and compute nothing the model reads."""
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)


def trace(model: nn.Module, kwargs: dict[str, Any], device: torch.device | str = "cpu", split_batch: bool = False,
          batch_dims: Mapping[str, int] = MappingProxyType({})) -> GraphModule:  # fmt: skip
    """Export ``model(**kwargs)`` (non-strict) on a fake copy living on ``device``. With
    ``split_batch`` the graph is one piece of a split step: its loss divides by the whole
    batch's denominators (``loss_denominators``); ``batch_dims`` names the inputs whose rows
    lie past dim 0 (``input_batch_dims``).

    Raises ``UserInputError`` naming the submodule and source line that could not trace.
    """
    refuse_lazy_parameters(model)
    refuse_backward_hooks(model)
    refuse_unbound_inputs(model, kwargs)
    register_dataclasses(kwargs)
    fake_model, fake_kwargs = _fake_copy(model, kwargs, torch.device(device))
    fake_model.register_forward_hook(strip_opaque_outputs)
    flags = {name: p.requires_grad for name, p in fake_model.named_parameters()}
    left: dict[str, bool] = {}  # the flags the forward left, read in it: export swaps other tensors in for the parameters while it runs
    fake_model.register_forward_hook(lambda module, args, out: left.update((n, p.requires_grad) for n, p in module.named_parameters()))
    with global_state_restored(model):
        ep, uses, unreachable = _export(model, fake_model, fake_kwargs)
    verdicts = function_verdicts(uses, _real_modules(model, fake_model))
    if verdicts.kept:
        log.info("custom autograd Functions kept whole (their backward is their own): %s", "; ".join(verdicts.kept.values()))
    if verdicts.recomputed:
        log.info("custom autograd Functions that recompute their forward in backward (activation checkpoints), traced "
                 "as their forward with grad on: %s", ", ".join(sorted(c.__qualname__ for c in verdicts.recomputed)))  # fmt: skip
    if verdicts.kept or verdicts.recomputed:  # again, each call of those Functions one node or its forward with grad on
        with global_state_restored(model):
            ep, _, _ = _export(model, fake_model, fake_kwargs, verdicts, unreachable)
    gm = ep.module()
    gm.meta[meta_keys.REQUIRES_GRAD_SET] = _requires_grad_set(type(model).__name__, flags, left)
    gm.meta[meta_keys.BRANCH_BUFFERS] = ep.graph_module.meta[meta_keys.BRANCH_BUFFERS]
    mark_checkpointed(gm)
    reconnect_unchanged_region_outputs(gm)
    inline_regions(gm)
    route_through_hooks(gm)  # a hook registered inside a region is in the graph now
    _clean(gm)
    decompose_parameter_ops(gm)
    decompose_simple_composites(gm)
    draw_by_size(gm)
    shape_by_size(gm)
    squeeze_traced_dims(gm)
    if split_batch:
        doubled = functools.cache(lambda: _doubled(model, kwargs, device, batch_dims))  # traced once, if either needs it
        made_rows = _rows_of_made_tensors(gm, batch_size(kwargs, batch_dims), doubled)
        normalize_loss_denominators(gm, _rows_by_name(gm, kwargs, doubled, batch_dims, made_rows), doubled)
        _mark_draw_rows(gm, made_rows)
        refuse_batch_size_constants(gm, doubled, batch_size(kwargs, batch_dims))
    mark_elementwise(gm)
    gm.recompile()  # once, after the rewrites above
    refuse_parameter_writes(type(model).__name__, gm)
    return gm


def _requires_grad_set(model_name: str, before: dict[str, bool], after: dict[str, bool]) -> dict[str, bool]:
    """The parameters whose ``requires_grad`` the forward changed, with the value it left."""
    changed = {name: flag for name, flag in after.items() if before.get(name, flag) != flag}
    if changed:
        frozen = [n for n, flag in changed.items() if not flag]
        log.info("the forward of %s sets requires_grad of %d parameters (%d to False, e.g. %s): each rank's parameters take the "
                 "values it leaves, as the model's would after its first forward", model_name, len(changed), len(frozen),
                 next(iter(frozen or changed)))  # fmt: skip
    return changed


def _rows_by_name(gm: GraphModule, kwargs: dict[str, Any], doubled: Callable[[], GraphModule],
                  batch_dims: Mapping[str, int], made_rows: Mapping[str, tuple[int, ...] | None]) -> Callable[[Node], set[int]]:  # fmt: skip
    """Where each node of ``gm`` holds the batch's rows (``batch_rows.batch_rows_at``), a tensor made
    in the forward holding them where ``made_rows`` says. A batch of one row cannot tell a sum
    over the rows from a sum over one row, so the rows are then found in a trace of the batch
    doubled, node by node of the same name."""
    made = {name: dims for name, dims in made_rows.items() if dims}
    if batch_size(kwargs, batch_dims) >= 2:
        return batch_rows_at(gm, batch_size(kwargs, batch_dims), input_row_dims(kwargs, batch_dims), made)
    twice = doubled()
    rows = batch_rows_at(twice, 2, input_row_dims(_twice(kwargs, batch_dims), batch_dims), made)
    nodes = {n.name: n for n in twice.graph.nodes}
    return lambda node: rows(nodes[node.name]) if node.name in nodes else set()


def _twice(kwargs: dict[str, Any], batch_dims: Mapping[str, int]) -> dict[str, Any]:
    """``kwargs`` with every input's rows repeated twice along their dim."""
    leaves, spec = tree_flatten_with_path(kwargs)
    dims = input_row_dims(kwargs, batch_dims)
    return tree_unflatten([v if d is None or d == UNKNOWN_ROWS else torch.cat([v, v], d) for (_, v), d in zip(leaves, dims)], spec)


def _doubled(model: nn.Module, kwargs: dict[str, Any], device: torch.device | str, batch_dims: Mapping[str, int]) -> GraphModule:
    """The trace of ``model`` on every input's rows twice."""
    return trace(model, _twice(kwargs, batch_dims), device)


def input_batch_dims(model: nn.Module, kwargs: dict[str, Any], device: torch.device | str) -> dict[str, int]:
    """The inputs whose batch rows lie past dim 0, by pytree key path: the dim, or
    ``UNKNOWN_ROWS``. Only an input with the batch's size on a later dim and not on dim 0 is
    asked about (Qwen2-VL's ``position_ids`` [3, B, S]); then ``model`` is traced once more with
    every dim of the batch's size symbolic, and a dim that the trace finds equal to the
    batch's dim 0 holds rows (an input with none is every row's)."""
    size = batch_size(kwargs)
    leaves, spec = tree_flatten_with_path(kwargs)
    rows = input_row_dims(kwargs)
    asked = [keystr(p) for (p, v), d in zip(leaves, rows)
             if d is None and isinstance(v, torch.Tensor) and size in tuple(v.shape)[1:]]  # fmt: skip
    if size < 2 or not asked:
        return {}
    auto = torch.export.Dim.AUTO
    dynamic = tree_unflatten([{d: auto for d, n in enumerate(v.shape) if n == size} if isinstance(v, torch.Tensor) else None for _, v in leaves], spec)
    fake_model, fake_kwargs = _fake_copy(model, kwargs, torch.device(device))
    try:
        ep, _, _ = _export(model, fake_model, fake_kwargs, dynamic_shapes=dynamic)
    except UserInputError as e:
        log.info("the batch dims of %s could not be traced (%s); a split step will be refused", ", ".join(asked), e)
        return dict.fromkeys(asked, UNKNOWN_ROWS)
    shapes = [n.meta.get("val") for n in ep.module().graph.nodes if n.op == "placeholder"]
    batch = {str(s.shape[0]) if isinstance(s.shape[0], torch.SymInt) else None for s, d in zip(shapes, rows) if d == 0}
    found: dict[str, int] = {}
    for (path, _), s in zip(leaves, shapes):
        if keystr(path) not in asked:
            continue
        dims = [d for d, n in enumerate(s.shape) if isinstance(n, torch.SymInt) and str(n) in batch]
        if len(batch) != 1 or None in batch or len(dims) > 1:  # the batch specialized, or several dims equal to it
            found[keystr(path)] = UNKNOWN_ROWS
        elif dims:
            found[keystr(path)] = dims[0]
    return found


def _rows_of_made_tensors(gm: GraphModule, batch: int, doubled: Callable[[], GraphModule]) -> dict[str, tuple[int, ...] | None]:
    """The dims holding the batch's rows of each tensor the forward makes from no other tensor
    (``torch.ones(b, n)``) and of each random draw: those whose size doubles in a trace of the batch
    doubled, node by node of the same name (None where a dim grows otherwise or the node is
    not there). A made tensor's size comes from the inputs' shapes, not their values, so the
    walk of the rows cannot tell. Only the replayed draws and the made tensors that have a dim
    of the batch's size and reach a scalar computed without parameters (a count a loss may
    divide by, ``mask.sum()``) are looked at: without them the batch is not traced again."""
    counted = behind_parameter_free_scalars(gm)

    def asked(n: Node) -> bool:
        if n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):
            return False
        made = not n.all_input_nodes and n in counted and (batch < 2 or batch in tuple(n.meta["val"].shape))
        return made or (n.target in REPLAYED and from_default_generator(n))

    looked_at = [n for n in gm.graph.nodes if asked(n)]
    if not looked_at:
        return {}
    twice = {n.name: n.meta.get("val") for n in doubled().graph.nodes}
    found: dict[str, tuple[int, ...] | None] = {}
    for node in looked_at:
        val, other = node.meta["val"], twice.get(node.name)
        if not isinstance(other, torch.Tensor) or other.dim() != val.dim():
            found[node.name] = None
            continue
        grown = [d for d in range(val.dim()) if other.shape[d] != val.shape[d]]
        found[node.name] = tuple(grown) if all(other.shape[d] == 2 * val.shape[d] for d in grown) else None
    return found


def _mark_draw_rows(gm: GraphModule, made_rows: Mapping[str, tuple[int, ...] | None]) -> None:
    """Mark each random draw with the dims of it that hold the batch's rows
    (``meta_keys.BATCH_DRAW_ROWS``, ``_rows_of_made_tensors``); None for a draw the pass does not
    replay."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and from_default_generator(node):
            node.meta[meta_keys.BATCH_DRAW_ROWS] = made_rows.get(node.name) if node.target in REPLAYED else None


def _export(
    model: nn.Module,
    fake_model: nn.Module,
    fake_kwargs: dict[str, Any],
    verdicts: FunctionVerdicts = FunctionVerdicts(),
    unreachable: frozenset[tuple[str, tuple[int, ...]]] = frozenset(),
    dynamic_shapes: Any = None,
    check_host_draws: bool = True,
) -> tuple[torch.export.ExportedProgram, list[FunctionUse], frozenset[tuple[str, tuple[int, ...]]]]:
    """Non-strict export of ``fake_model(**fake_kwargs)``, with the custom Functions it applied
    and the iterations of unrolled loops asserted not to run (``unreachable`` and those this
    trace found, ``trace_control_flow``); a forward drawing from a host generator is refused (``host_draws``)."""
    # torch.export prints the partial graph of a failed trace to stderr; it goes to the
    # debug log instead, and what a successful trace printed is passed on.
    printed = io.StringIO()
    retry = None
    host_states = host_random_states()
    with _module_stack(fake_model) as stack, custom_functions(stack, verdicts) as uses, _held_log(_FAKE_TENSOR_LOG) as held, reentrant_checkpoint_as_call(), _distribution_checks_off(), guarded_control_flow(fake_model, unreachable, _real_buffers(model)) as loops, GradientHookWatch(stack), assumed_sizes() as assumed, model_collectives_refused() as asked, DataAsDetach():
        try:
            with contextlib.redirect_stderr(printed):
                ep = torch.export.export(fake_model, (), fake_kwargs, strict=False, dynamic_shapes=dynamic_shapes)
            sys.stderr.write(printed.getvalue())
            name_assumptions(ep.graph, assumed)
            ep.graph_module.meta[meta_keys.BRANCH_BUFFERS] = frozenset(loops.buffers_read)
        except Exception as e:  # noqa: BLE001 - re-raised with location
            if loops.failed is not None and loops.failed not in unreachable:
                log.info("the iteration for index %s of the loop at %s indexes out of range; traced again with it asserted not to run", loops.failed[1], loops.failed[0])
                retry = unreachable | {loops.failed}
            log.debug("torch.export printed:\n%s", printed.getvalue())
            for record in held:
                log.debug("%s logged: %s", _FAKE_TENSOR_LOG, record.getMessage())
            frames = traceback.extract_tb(e.__traceback__)
            model_frames = [f for f in frames if not os.path.realpath(f.filename).startswith(TRACER_ROOTS)]
            where = f"{model_frames[-1].filename}:{model_frames[-1].lineno} ({model_frames[-1].line})" if model_frames else "unknown line"
            module = stack[-1] if stack else f"<root> ({type(model).__name__})"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if retry is None and isinstance(e, UserInputError):  # autotp's own refusal, with its fix
                raise UserInputError(f"{type(model).__name__}, module {module} at {where}: {e}") from e
            if retry is None:
                raise UserInputError(
                    f"autotp could not trace {type(model).__name__}: an operation in module {module} at {where} "
                    f"failed under torch.export: {type(e).__name__}: {first}. Fix: {_advice(e)}{process_group_hint(asked, where)}"
                ) from e
    if retry is not None:
        return _export(model, fake_model, fake_kwargs, verdicts, retry, dynamic_shapes, check_host_draws)
    refuse_broken_loops(loops)
    if check_host_draws and host_random_states() != host_states:
        with host_calls() as calls, contextlib.suppress(UserInputError):  # once more, to find the line that drew
            _export(model, fake_model, fake_kwargs, verdicts, unreachable, dynamic_shapes, check_host_draws=False)
        if not calls or (draw := unseeded_draw(calls)) is not None:
            raise host_draw_refusal(type(model).__name__, draw if calls else None)
        log.info("the forward calls Python's or NumPy's global random generator, seeded first or from generated code only (%s): "
                 "traced as it is", calls[0].where)  # fmt: skip
    return _lower_vmap(ep), uses, unreachable


def _lower_vmap(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``torch.vmap`` in the forward stays as functorch's batching markers (``_add_batch_dim``)
    in the exported graph, opaque to the layout rules. Run once more through the dispatcher
    with no decomposition (every other op is kept as it is), they become the batched aten ops
    the rules know (experts batched over stacked weights: ``matmul`` of ``[E, ...]`` operands)."""
    if not any(n.op == "call_function" and getattr(n.target, "__name__", "") == "_add_batch_dim" for n in ep.graph.nodes):
        return ep
    log.info("lowering torch.vmap in the traced forward to batched aten ops")
    ep = ep.run_decompositions({})
    _restore_score_indexing(ep.graph_module)
    return ep


def _restore_score_indexing(gm: GraphModule) -> None:
    """Inside FlexAttention's score and mask functions, a tensor indexed by the head or position
    indices (``bias[h, q_idx - kv_idx]``) is FlexAttention's ``mod_index``, whose backward sums
    the gradient of a captured parameter over the positions vmap batches; lowering vmap made it a
    plain ``aten.index``, whose backward vmap cannot batch. Each such index is ``mod_index`` again."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.higher_order.flex_attention:
            continue
        for fn in (node.args[3], node.args[4][-1]):
            sub = getattr(gm, fn.target)
            for inner in sub.graph.nodes:
                if inner.op == "call_function" and inner.target is torch.ops.aten.index.Tensor:
                    inner.target = mod_index
            sub.recompile()


def _missing_fake_kernel(error: BaseException) -> str | None:
    """The custom op that has no fake (meta) kernel, if that is why tracing failed."""
    for seen in _causes(error):
        if isinstance(seen, UnsupportedOperatorException) and seen.args:
            return str(seen.args[0]).removesuffix(".default")
        found = re.search(r"no fake impl registered for <CustomOpDef\((\S+)\)>", str(seen))
        if found:
            return found.group(1)
    return None


def _causes(error: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = error
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _shaped_by_data(error: BaseException) -> str | None:
    """The op whose output shape depends on its inputs' values, if that is why tracing failed
    (``aten._ctc_loss``'s log-alphas, sized by the longest target)."""
    found = next((e for e in _causes(error) if isinstance(e, DynamicOutputShapeException) and e.args), None)
    return None if found is None else str(found.args[0]).removesuffix(".default")


def _refusing_meta_kernel(error: BaseException) -> str | None:
    """The name of PyTorch's meta kernel that raised ``error``, if one did."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.endswith("_meta_registrations.py")]
    return next((f.name for f in frames if f.name.startswith("meta_")), frames[0].name if frames else None)


def _advice(error: BaseException) -> str:
    meta = _refusing_meta_kernel(error)
    if meta is not None:
        return (
            f"PyTorch's meta kernel ({meta}), which tracing runs instead of the real one, refused these inputs; it can be "
            "stricter than the eager kernel (torch._grouped_mm's takes only bf16 there, its CPU kernel also fp32). Give that op "
            "inputs its meta kernel accepts (e.g. bf16), or take another path for the rest (torchtitan's and transformers' fp32 "
            "expert paths loop over the experts)."
        )
    op = _missing_fake_kernel(error)
    if op is not None:
        return (
            f"the custom op {op} has no fake kernel, so tracing cannot tell its output's shape and dtype; "
            f"register one with @torch.library.register_fake(\"{op.replace('.', '::', 1)}\") returning an empty "
            "tensor of the output's shape (e.g. torch.empty_like(x))."
        )
    shaped_by_data = _shaped_by_data(error)
    if shaped_by_data is not None:
        return (
            f"{shaped_by_data} makes an output whose shape depends on the values of its inputs, which torch.export cannot "
            "trace; move it out of the forward (return what it reads, e.g. the logits, and compute it on the outputs of the "
            "parallelized model), or replace it by ops of static shapes."
        )
    if any(isinstance(e, GuardOnDataDependentSymNode) for e in _causes(error)):
        return (
            "shapes there depend on the values of a tensor (sizes, or Python numbers, read by .tolist(), .item(), int(t) or "
            "float(t)), which one traced graph cannot follow; keep such a value a tensor (a token count as "
            "mask.sum().clamp(min=1), not max(1, int(mask.sum()))), compute with static shapes (one block-diagonal mask "
            "over packed documents rather than a loop over them), or state what export asks with torch._check(...) as "
            "the error above suggests."
        )
    return (
        "make that module traceable (no data-dependent Python control flow or .item() on tensors), "
        "or pass example inputs that take a traceable path."
    )


def _clean(gm: GraphModule) -> None:
    """Drop export's runtime guards and metadata asserts; they check global shapes."""
    graph = gm.graph
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target in _DROPPED_TARGETS) or (
            node.op == "call_module" and str(node.target) == "_guards_fn"
        ):
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph.lint()
