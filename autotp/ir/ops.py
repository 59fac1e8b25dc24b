"""The operators autotp puts into graphs, registered in the ``torch.library`` namespace ``autotp``.

This module holds their schemas, fake kernels (so graphs run on ``meta`` and under
FakeTensor without any process group) and autograd formulas. The kernels that
communicate are registered by ``autotp.runtime.processes.collectives`` (and the RNG kernel by
``autotp.runtime.execution.rng``). Passes, reports and tests compare ``node.target`` with the
handles below.

Collectives over the group of one parallel axis, named by its key
(``autotp.ir.axes.group_key(axis, size)``: ``tp2``, ``ep4``; ``replica_group_key``), under which
the runtime registers a process group. The kernels do not depend on the axis: an op
named ``*_tp`` all-reduces over whichever group its key names.

* ``copy_to_tp(x, group)`` -- Megatron's *f*: identity forward, ``reduce_from_tp`` of the
  grad backward.
* ``reduce_from_tp(x, group)`` -- Megatron's *g*: all-reduce forward, identity backward.
* ``gather_from_tp(x, dim, size, group)`` -- all-gather along ``dim`` keeping the first
  ``size`` entries (drops vocab padding); backward keeps this rank's slice
  (``scatter_to_tp``).
* ``scatter_to_tp(x, dim, local, group)`` -- this rank's ``local``-wide slice along
  ``dim``, zero-padded past the end; backward ``gather_from_tp``.
* ``all_gather(x, dim, group_size, group)`` / ``reduce_scatter(x, dim, group_size,
  group)`` -- sequence parallelism: each is the other's backward.
* ``all_gather_matmul(x, weights, dim, group_size, group, impl)`` -> ``[all_gather(x),
  all_gather(x) @ w for w in weights]`` and ``matmul_reduce_scatter(xs, weights, dim,
  group_size, group, impl)`` -> ``reduce_scatter(sum_i xs[i] @ weights[i])``: the sequence
  parallel collective and the GEMM next to it, decomposed so that the communication runs
  behind the GEMM (``passes/tp_overlap``; kernels in ``autotp.runtime.execution.overlap``). Weights
  are ``[K, N]`` (matmul layout). Each is the other's backward: the grad of the gathered
  input is a matmul-reduce-scatter of the output grads, the grad of a matmul-reduce-scatter's
  input an all-gather-matmul of its output grad, whose gathered grad the weight grads reuse.
  ``impl`` is ``symm_mem`` (CUDA + NCCL: ``torch.ops.symm_mem`` fused ops; elsewhere the
  ring) or ``ring`` (P2P ring, one chunk per rank, on any backend).
* ``vocab_parallel_cross_entropy(logits, target, vocab_start, vocab_size, ignore_index,
  reduction, group)`` -- ``aten.cross_entropy_loss`` on logits sharded on the class dim (dim 1):
  only per-token max, sum-exp and target logit cross ranks (``vocab_parallel_nll``).
* ``linear_cross_entropy(hidden, weight, target, vocab_start, vocab_size, ignore_index,
  reduction, chunk, group_size, group, fp8_recipe="")`` -- the same loss on ``linear(hidden, weight)`` (the
  weight's rows: columns ``vocab_start...`` of the class dim), ``chunk`` tokens at a time, so
  the logits are never whole (its GEMMs in FP8 with ``fp8_recipe``, tensorwise); its
  forward also computes the gradients of ``hidden`` and
  ``weight`` (implemented in ``autotp.ir.fused_loss``, which the pass that inserts it,
  ``passes/fused_linear_cross_entropy``, imports).
* ``all_reduce_max(x, group)`` -- the elementwise max over the group (FP8 amaxes; no grad).
* ``fp8_linear(x, weights, biases, recipe, x_split, n_split, gather_dim, group_size,
  group, history=None)`` -> ``[x·Wᵢᵀ + bᵢ]`` with every GEMM in FP8 (``autotp.ir.fp8`` holds the recipes
  and the composite kernel, which ``autotp.runtime.processes.collectives`` registers); scales of operands the group splits are max-reduced over it,
  and with ``gather_dim >= 0`` x is this rank's tokens, all-gathered in FP8. A delayed recipe
  updates ``history`` in place (the kernel is composite, so tracing sees the copies; the schema
  has no alias annotation, with which the pp=2 FP8 test disagreed, not investigated).

Local ops:

* ``stage_boundary(x, chunk)`` -- identity marking ``x`` as crossing into pipeline chunk
  ``chunk``.
* ``deferred_linear(x, weight, bias)`` -- ``linear`` whose backward returns the gradients of
  the input and bias only and hands (weight, x, output grad) to the innermost of
  ``WEIGHT_GRAD_SINKS`` (``autotp.runtime.execution.weight_grads.WeightGradStore``), which computes
  the weight gradient later: a zero-bubble schedule's ``W`` (``passes/split_weight_grads``).
* ``partial_grad(x, parts)`` -- identity forward; backward divides the gradient by
  ``parts``, so that a gradient every one of ``parts`` ranks holds whole becomes their equal
  partial summands (``passes/sequence_parallel`` adds it where whole and partial gradients
  meet before one reduce-scatter).
* ``contiguous_grad(x)`` -- a copy of ``x`` forward; backward makes the gradient contiguous
  (``passes/contiguous_norm_grads``: torch's CPU batch-norm backward misreads a channels-last
  gradient of a one-sample batch).
* ``tp_dropout(x, p, train, stream)`` -- ``aten.dropout`` drawing its mask from the tp
  RNG stream ``REPLICATED`` or ``SHARDED`` (``tp_rand(like, stream)``: uniform float32 numbers shaped like ``like``; see
  ``autotp.runtime.execution.rng``).
* ``tp_attention_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, stream)`` --
  SDPA with dropout as its math, the probabilities dropped by ``tp_dropout`` from ``stream``
  (SDPA's own dropout draws the same numbers on every rank: ``passes/tp_dropout.py``).
* ``vocab_parallel_embedding(weight, ids, vocab_start, vocab_stop, vocab_size, padding_idx, wrap,
  scale_grad_by_freq)`` -- lookup in rows ``[vocab_start, vocab_stop)``; other ids give zeros (a
  partial sum). ``wrap``: a negative id counts from the end, as ``table[ids]`` reads it.
  ``scale_grad_by_freq``: each lookup's gradient divided by its id's count in all of ``ids``
  (the local lookup's own counts would count the other ranks' ids as row 0).

* ``function(inputs, key, name)`` -- a custom ``torch.autograd.Function`` kept whole, whose
  backward is the Function's own (``autotp.ir.custom_functions`` holds its kernels and the
  table of calls ``key`` indexes; ``name`` is the Function's, for people). The output is
  replicated and so are the inputs. ``elementwise_function`` is the same for a call with one
  output proven elementwise, forward and backward: tagged pointwise, so it runs on shards.

The vocab-parallel embedding and cross entropy mask ids outside the local range, so an
id outside the whole vocabulary ``[0, vocab_size)`` would silently count as zero; both
refuse it (``check_ids``) where the unmodified model raises ``IndexError``.

The identities (*f*, ``stage_boundary``, ``partial_grad``) are ``CompositeImplicitAutograd`` ops returning a
view of their input, so they cost no copy: a custom op with a kernel may not return an
alias of its input. Tracing (``torch.compile``, ``make_fx``) decomposes them into that
view, with *f*'s backward all-reduce. The other composites (dropout, embedding, loss)
decompose into aten ops and the kernel ops. Every op is registered as side-effectful,
so ``Graph.eliminate_dead_code`` keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx.node import has_side_effect
from torch.library import Library

from autotp.ir import moe_ops
from autotp.ir.errors import UserInputError
from autotp.ir.memory_order import empty_in_memory_order, reduced_like
from autotp.ir.vocab_logits import check_ids, local_logits, loss_dtype, target_in_range

NAMESPACE = "autotp"
REPLICATED = "replicated"  # dropout stream seeded alike on every tp rank
SHARDED = "sharded"  # dropout stream seeded with the tp rank mixed in

_LIB = Library(NAMESPACE, "DEF")


def _define(schema: str, tags: tuple[torch.Tag, ...] = ()) -> torch._ops.OpOverload:
    _LIB.define(schema, tags=tags)
    return getattr(getattr(torch.ops, NAMESPACE), schema.split("(")[0]).default


COPY_TO_TP = _define("copy_to_tp(Tensor x, str group) -> Tensor")
REDUCE_FROM_TP = _define("reduce_from_tp(Tensor x, str group) -> Tensor")
GATHER_FROM_TP = _define("gather_from_tp(Tensor x, int dim, SymInt size, str group) -> Tensor")
SCATTER_TO_TP = _define("scatter_to_tp(Tensor x, int dim, SymInt local, str group) -> Tensor")
ALL_GATHER = _define("all_gather(Tensor x, int dim, int group_size, str group) -> Tensor")
REDUCE_SCATTER = _define("reduce_scatter(Tensor x, int dim, int group_size, str group) -> Tensor")
ALL_GATHER_MATMUL = _define(
    "all_gather_matmul(Tensor x, Tensor[] weights, int dim, int group_size, str group, str impl) -> Tensor[]"
)
MATMUL_REDUCE_SCATTER = _define(
    "matmul_reduce_scatter(Tensor[] xs, Tensor[] weights, int dim, int group_size, str group, str impl) -> Tensor"
)
OVERLAP_IMPLS = ("symm_mem", "ring")
VOCAB_PARALLEL_NLL = _define(
    "vocab_parallel_nll(Tensor logits, Tensor target, int vocab_start, int vocab_size, str group) -> (Tensor, Tensor, Tensor)"
)
VOCAB_PARALLEL_CROSS_ENTROPY = _define(
    "vocab_parallel_cross_entropy(Tensor logits, Tensor target, int vocab_start, int vocab_size, int ignore_index, "
    "int reduction, str group) -> Tensor"
)
LINEAR_CROSS_ENTROPY = _define(
    "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, int vocab_start, int vocab_size, "
    "int ignore_index, int reduction, int chunk, int group_size, str group, str fp8_recipe=\"\") -> Tensor"
)
VOCAB_PARALLEL_EMBEDDING = _define(
    "vocab_parallel_embedding(Tensor weight, Tensor ids, int vocab_start, int vocab_stop, int vocab_size, "
    "int padding_idx, bool wrap=False, bool scale_grad_by_freq=False) -> Tensor"
)
STAGE_BOUNDARY = _define("stage_boundary(Tensor x, int chunk) -> Tensor")
PARTIAL_GRAD = _define("partial_grad(Tensor x, int parts) -> Tensor")
CONTIGUOUS_GRAD = _define("contiguous_grad(Tensor x) -> Tensor")
TP_RAND = _define("tp_rand(Tensor like, str stream) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
TP_DROPOUT = _define("tp_dropout(Tensor x, float p, bool train, str stream) -> Tensor")
TP_ATTENTION_DROPOUT = _define(
    "tp_attention_dropout(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, "
    "float? scale, bool enable_gqa, str stream) -> Tensor"
)
DEFERRED_LINEAR = _define("deferred_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
WEIGHT_GRAD_SINKS: list[Callable[[Tensor, Tensor, Tensor], None]] = []
"""Where ``deferred_linear``'s backward hands (weight, input, output grad): the last one pushed."""
ALL_REDUCE_MAX = _define("all_reduce_max(Tensor x, str group) -> Tensor")
FP8_LINEAR = _define(
    "fp8_linear(Tensor x, Tensor[] weights, Tensor?[] biases, str recipe, int x_split, int[] n_split, int gather_dim, "
    "int group_size, str group, Tensor? history=None) -> Tensor[]"
)
FUNCTION = _define("function(Tensor[] inputs, int key, str name) -> Tensor[]")
ELEMENTWISE_FUNCTION = _define("elementwise_function(Tensor[] inputs, int key, str name) -> Tensor", tags=(torch.Tag.pointwise,))

# Ops that communicate over a tp group, forward or backward.
COLLECTIVES: frozenset[torch._ops.OpOverload] = frozenset({
    COPY_TO_TP, REDUCE_FROM_TP, GATHER_FROM_TP, SCATTER_TO_TP, ALL_GATHER, REDUCE_SCATTER,
    ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, VOCAB_PARALLEL_NLL, VOCAB_PARALLEL_CROSS_ENTROPY,
    LINEAR_CROSS_ENTROPY,
    ALL_REDUCE_MAX, FP8_LINEAR,
}) | moe_ops.DISPATCH_OPS  # fmt: skip
ALL: frozenset[torch._ops.OpOverload] = COLLECTIVES | {
    VOCAB_PARALLEL_EMBEDDING, STAGE_BOUNDARY, PARTIAL_GRAD, CONTIGUOUS_GRAD, TP_RAND, TP_DROPOUT, TP_ATTENTION_DROPOUT,
    FUNCTION, ELEMENTWISE_FUNCTION,
}  # fmt: skip
# Identities forward (views of their input): f, stage boundaries, partial_grad.
IDENTITIES: frozenset[torch._ops.OpOverload] = frozenset({COPY_TO_TP, STAGE_BOUNDARY, PARTIAL_GRAD})
# Collectives that only move data forward (no arithmetic but the reduction).
COMMUNICATION_ONLY: frozenset[torch._ops.OpOverload] = frozenset({REDUCE_FROM_TP, GATHER_FROM_TP, SCATTER_TO_TP, ALL_GATHER, REDUCE_SCATTER})


def is_autotp_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE


# ---- fake kernels ---------------------------------------------------------------------


def _resized(x: Tensor, dim: int, size: Any) -> Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


torch.library.register_fake(REDUCE_FROM_TP, lambda x, group: reduced_like(x), lib=_LIB)
torch.library.register_fake(ALL_REDUCE_MAX, lambda x, group: reduced_like(x), lib=_LIB)


@torch.library.register_fake(GATHER_FROM_TP, lib=_LIB)
def _gather_from_tp_fake(x: Tensor, dim: int, size: Any, group: str) -> Tensor:
    return empty_in_memory_order(x, dim, size)


@torch.library.register_fake(SCATTER_TO_TP, lib=_LIB)
def _scatter_to_tp_fake(x: Tensor, dim: int, local: Any, group: str) -> Tensor:
    return _resized(x, dim, local)


@torch.library.register_fake(ALL_GATHER, lib=_LIB)
def _all_gather_fake(x: Tensor, dim: int, group_size: int, group: str) -> Tensor:
    return _resized(x, dim, x.shape[dim] * group_size)


def reduce_scatter_size(size: Any, group_size: int, group: str) -> Any:
    """Size of a reduce-scattered dim; raises when ``group_size`` does not divide it."""
    if size % group_size != 0:
        raise UserInputError(f"reduce_scatter over '{group}': dim of size {size} does not split into {group_size} equal parts; pad it to a multiple of {group_size}")
    return size // group_size


@torch.library.register_fake(REDUCE_SCATTER, lib=_LIB)
def _reduce_scatter_fake(x: Tensor, dim: int, group_size: int, group: str) -> Tensor:
    return _resized(x, dim, reduce_scatter_size(x.shape[dim], group_size, group))


def _check_matmul_dim(x: Tensor, dim: int, what: str) -> None:
    if dim % x.dim() == x.dim() - 1:
        raise UserInputError(f"{what} splits dim {dim} of a {x.dim()}-d tensor, the GEMM's contraction dim; split a leading dim")


@torch.library.register_fake(ALL_GATHER_MATMUL, lib=_LIB)
def _all_gather_matmul_fake(x: Tensor, weights: list[Tensor], dim: int, group_size: int, group: str, impl: str) -> list[Tensor]:
    _check_matmul_dim(x, dim, "all_gather_matmul")
    full = _resized(x, dim, x.shape[dim] * group_size)
    return [full, *(_resized(full, -1, w.shape[1]).to(w.dtype) for w in weights)]


@torch.library.register_fake(MATMUL_REDUCE_SCATTER, lib=_LIB)
def _matmul_reduce_scatter_fake(xs: list[Tensor], weights: list[Tensor], dim: int, group_size: int, group: str, impl: str) -> Tensor:
    _check_matmul_dim(xs[0], dim, "matmul_reduce_scatter")
    out = _resized(xs[0], -1, weights[0].shape[1])
    return _resized(out, dim, reduce_scatter_size(out.shape[dim], group_size, group))


@torch.library.register_fake(VOCAB_PARALLEL_NLL, lib=_LIB)
def _vocab_parallel_nll_fake(logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, group: str) -> tuple[Tensor, ...]:
    return tuple(logits.new_empty(target.shape, dtype=loss_dtype(logits.dtype)) for _ in range(3))


@torch.library.register_fake(TP_RAND, lib=_LIB)
def _tp_rand_fake(like: Tensor, stream: str) -> Tensor:
    return torch.empty_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)


# ---- autograd -------------------------------------------------------------------------


def _keep_group(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """For gather/scatter: the input's size along ``dim`` is the size the backward restores."""
    ctx.dim, ctx.size, ctx.group = inputs[1], inputs[0].shape[inputs[1]], inputs[-1]


def _identity_grad(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    return grad, None


torch.library.register_autograd(REDUCE_FROM_TP, _identity_grad, lib=_LIB)
torch.library.register_autograd(
    GATHER_FROM_TP, lambda ctx, grad: (SCATTER_TO_TP(grad, ctx.dim, ctx.size, ctx.group), None, None, None),
    setup_context=_keep_group, lib=_LIB,
)  # fmt: skip
torch.library.register_autograd(
    SCATTER_TO_TP, lambda ctx, grad: (GATHER_FROM_TP(grad, ctx.dim, ctx.size, ctx.group), None, None, None),
    setup_context=_keep_group, lib=_LIB,
)  # fmt: skip


def _keep_group_size(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.dim, ctx.group_size, ctx.group = inputs[1], inputs[2], inputs[3]


torch.library.register_autograd(
    ALL_GATHER, lambda ctx, grad: (REDUCE_SCATTER(grad, ctx.dim, ctx.group_size, ctx.group), None, None, None),
    setup_context=_keep_group_size, lib=_LIB,
)  # fmt: skip
torch.library.register_autograd(
    REDUCE_SCATTER, lambda ctx, grad: (ALL_GATHER(grad, ctx.dim, ctx.group_size, ctx.group), None, None, None),
    setup_context=_keep_group_size, lib=_LIB,
)  # fmt: skip


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _keep_matmul(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """all_gather_matmul saves the gathered input (its first output), matmul_reduce_scatter its inputs."""
    first, weights, ctx.dim, ctx.group_size, ctx.group, ctx.impl = inputs
    ctx.save_for_backward(*(output[:1] if isinstance(first, Tensor) else first), *weights)
    ctx.count = len(weights)


def _all_gather_matmul_backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Any, ...]:
    gathered, *weights = ctx.saved_tensors
    pairs = [(g, w) for g, w in zip(grads[1:], weights) if g is not None]
    grad_x = None
    if pairs:
        grad_x = MATMUL_REDUCE_SCATTER([g for g, _ in pairs], [w.t() for _, w in pairs], ctx.dim, ctx.group_size, ctx.group, ctx.impl)
    if grads[0] is not None:
        rest = REDUCE_SCATTER(grads[0], ctx.dim, ctx.group_size, ctx.group)
        grad_x = rest if grad_x is None else grad_x + rest
    rows = _rows(gathered)
    grad_w = [None if g is None else rows.t() @ _rows(g) for g in grads[1:]]
    return grad_x, grad_w, None, None, None, None


def _matmul_reduce_scatter_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    xs, weights = saved[: ctx.count], saved[ctx.count :]
    gathered, *grad_xs = ALL_GATHER_MATMUL(grad, [w.t() for w in weights], ctx.dim, ctx.group_size, ctx.group, ctx.impl)
    rows = _rows(gathered)
    grad_w = [_rows(x).t() @ rows for x in xs]
    return grad_xs, grad_w, None, None, None, None


torch.library.register_autograd(ALL_GATHER_MATMUL, _all_gather_matmul_backward, setup_context=_keep_matmul, lib=_LIB)
torch.library.register_autograd(MATMUL_REDUCE_SCATTER, _matmul_reduce_scatter_backward, setup_context=_keep_matmul, lib=_LIB)


def _nll_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    logits, target, ctx.vocab_start, ctx.vocab_size, _ = inputs
    _, row_max, sum_exp = output
    ctx.mark_non_differentiable(row_max, sum_exp)
    ctx.save_for_backward(logits, target, row_max, sum_exp)


def _nll_backward(ctx: Any, grad: Tensor, *unused: Tensor) -> tuple[Tensor | None, ...]:
    """softmax - onehot(target) on this rank's columns, times the per-token grad."""
    logits, target, row_max, sum_exp = ctx.saved_tensors
    exp = (local_logits(logits, ctx.vocab_start, ctx.vocab_size) - row_max.unsqueeze(-1)).exp()
    in_range, local_target = target_in_range(target, ctx.vocab_start, logits.shape[-1])
    g = exp / sum_exp.unsqueeze(-1)
    onehot = torch.zeros_like(g).scatter_(-1, local_target.unsqueeze(-1), 1.0) * in_range.unsqueeze(-1)
    return ((g - onehot) * grad.unsqueeze(-1)).to(logits.dtype), None, None, None, None


torch.library.register_autograd(VOCAB_PARALLEL_NLL, _nll_backward, setup_context=_nll_setup, lib=_LIB)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: str) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return REDUCE_FROM_TP(grad, ctx.group), None


class _PartialGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, parts: int) -> Tensor:  # type: ignore[override]
        ctx.parts = parts
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad / ctx.parts, None


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()  # not a view: the graph may write it in place (an in-place activation after a norm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


# ---- composite ops --------------------------------------------------------------------


def _copy_to_tp(x: Tensor, group: str) -> Tensor:
    return _CopyToTP.apply(x, group)


def _stage_boundary(x: Tensor, chunk: int) -> Tensor:
    return x.view_as(x)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            if not WEIGHT_GRAD_SINKS:
                raise RuntimeError("a deferred linear's backward ran outside WeightGradStore.collecting()")
            WEIGHT_GRAD_SINKS[-1](weight, x, grad_out)
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def _deferred_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return _DeferredLinear.apply(x, weight, bias)


def _partial_grad(x: Tensor, parts: int) -> Tensor:
    return _PartialGrad.apply(x, parts)


def _tp_dropout(x: Tensor, p: float, train: bool, stream: str) -> Tensor:
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = TP_RAND(x.detach(), stream) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def _tp_attention_dropout(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
                          scale: float | None, enable_gqa: bool, stream: str) -> Tensor:  # fmt: skip
    """SDPA's math: ``softmax(q k^T * scale + mask)``, dropped out from ``stream``, times ``v``."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return _tp_dropout(scores.softmax(dim=-1), dropout_p, True, stream) @ v


def _vocab_parallel_embedding(
    weight: Tensor, ids: Tensor, vocab_start: int, vocab_stop: int, vocab_size: int, padding_idx: int, wrap: bool = False,
    scale_grad_by_freq: bool = False,
) -> Tensor:  # fmt: skip
    if wrap:
        ids = torch.where(ids < 0, ids + vocab_size, ids)
    check_ids(ids, vocab_size, "token ids")
    outside = (ids < vocab_start) | (ids >= vocab_stop)
    local_ids = (ids - vocab_start).masked_fill(outside, 0)
    local_pad = padding_idx - vocab_start if vocab_start <= padding_idx < vocab_stop else -1
    out = torch.embedding(weight, local_ids, local_pad)
    if scale_grad_by_freq:
        counts = torch.bincount(ids.flatten(), minlength=vocab_size)[ids].unsqueeze(-1)
        held = out.detach()
        out = held + (out - held) / counts  # the same values; the gradient divided by the count
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, ignore_index: int, reduction: int, group: str
) -> Tensor:
    """``reduction`` uses aten's codes: 0 none, 1 mean, 2 sum; logits [N, C, d1, ...] are the rows of [N * d1 * ..., C]."""
    positions = target.shape
    logits, target = (logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)) if logits.dim() > 2 else (logits, target)
    valid = target != ignore_index
    check_ids(target, vocab_size, "labels (other than ignore_index)", skip=~valid)
    nll, _, _ = VOCAB_PARALLEL_NLL(logits, target, vocab_start, vocab_size, group)
    loss = nll.masked_fill(~valid, 0.0)
    if reduction == 0:
        return loss.reshape(positions).to(logits.dtype)
    total = loss.sum()
    return (total / valid.sum() if reduction == 1 else total).to(logits.dtype)


for _op, _fn in (
    (COPY_TO_TP, _copy_to_tp),
    (STAGE_BOUNDARY, _stage_boundary),
    (PARTIAL_GRAD, _partial_grad),
    (CONTIGUOUS_GRAD, _ContiguousGrad.apply),
    (DEFERRED_LINEAR, _deferred_linear),
    (TP_DROPOUT, _tp_dropout),
    (TP_ATTENTION_DROPOUT, _tp_attention_dropout),
    (VOCAB_PARALLEL_EMBEDDING, _vocab_parallel_embedding),
    (VOCAB_PARALLEL_CROSS_ENTROPY, _vocab_parallel_cross_entropy),
):
    _LIB.impl(_op._schema.name.split("::")[1], _fn, "CompositeImplicitAutograd")

for _op in ALL:
    has_side_effect(_op)
