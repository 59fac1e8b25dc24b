"""The expert-parallel dispatch ops (namespace ``autotp``): schemas, fake kernels, autograd.

An MoE layer's expert computation reads rows sorted by expert (``offsets``: cumulative
counts per expert, the grouped matmul's ``offs``). ``passes/expert_parallel`` moves those
rows to the ranks that hold their experts and back:

* ``moe_route(offsets, rows, num_experts, capacity, ep, ep_group, tp, tp_group, layer)``
  -> ``(route, local_offsets)``. This rank takes its tp share of the ``rows`` rows (the
  tokens are replicated over tp; tp rank r dispatches the rows ``i % tp == r``, so every
  expert's rows split evenly over tp), counts them per expert and exchanges the counts
  over the ep group (an all-to-all of ``E`` integers). ``route`` (int64) is ``[tp rank, tp,
  sent per expert (E), received per source rank and local expert (ep x E/ep)]``; ``local_offsets`` are the cumulative row counts of this
  rank's ``E/ep`` experts in the received rows, the ``offs`` of its grouped matmuls (both modes).
* ``moe_to_experts(x, route, ...)`` -> the received rows, grouped by local expert, then by
  source rank: the permute and the all-to-all.
* ``moe_from_experts(y, route, rows, ...)`` -> the ``rows`` rows in their original order
  (each rank's part back, the tp shares all-gathered).

Each movement is the other's backward. Two modes, fixed by ``capacity``:

* ``capacity == 0``, **dropless**: the all-to-all splits are the counts, read on the host
  (one sync per movement, a CUDA-graph capture blocker), and the received rows vary.
* ``capacity > 0``, **sync-free**: every (rank, expert) pair sends exactly ``capacity``
  rows (zero-padded; rows past it are dropped and counted, device-side), so every shape is
  static and nothing syncs: the layer captures as one CUDA graph. The received rows are
  packed at the front of the static ``E * capacity``-row output, local expert by local
  expert, and ``local_offsets`` count only them: the grouped matmuls multiply what arrived.

The kernels (``autotp.runtime.processes.moe_dispatch``) register per device; without a process
group (one rank) the movements are local permutations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx.node import has_side_effect
from torch.library import Library

NAMESPACE = "autotp"
DROPLESS, SYNC_FREE = "dropless", "sync_free"
MODES = (DROPLESS, SYNC_FREE)

_LIB = Library(NAMESPACE, "FRAGMENT")
_LAYOUT = "int num_experts, int capacity, int ep, str ep_group, int tp, str tp_group"


def _define(schema: str) -> torch._ops.OpOverload:
    _LIB.define(schema)
    return getattr(getattr(torch.ops, NAMESPACE), schema.split("(")[0]).default


MOE_ROUTE = _define(f"moe_route(Tensor offsets, SymInt rows, {_LAYOUT}, str layer) -> (Tensor, Tensor)")
MOE_TO_EXPERTS = _define(f"moe_to_experts(Tensor x, Tensor route, {_LAYOUT}) -> Tensor")
MOE_FROM_EXPERTS = _define(f"moe_from_experts(Tensor y, Tensor route, SymInt rows, {_LAYOUT}) -> Tensor")
DISPATCH_OPS: frozenset[torch._ops.OpOverload] = frozenset({MOE_ROUTE, MOE_TO_EXPERTS, MOE_FROM_EXPERTS})


def received_rows(rows: int, num_experts: int, capacity: int, ep: int, tp: int) -> int:
    """Rows a rank receives: in sync-free mode the static ``E/ep * ep * capacity`` (with one
    ep rank no more than its own tp slice ``ceil(rows/tp)``: nothing arrives from elsewhere);
    with balanced routing, its tp slice of ``rows`` in dropless mode (the expected value)."""
    if not capacity:
        return rows // tp
    return num_experts * capacity if ep > 1 else min(num_experts * capacity, -(-rows // tp))


@torch.library.register_fake(MOE_ROUTE, lib=_LIB)
def _route_fake(offsets: Tensor, rows: int, num_experts: int, capacity: int, ep: int, ep_group: str, tp: int,
                tp_group: str, layer: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    route = offsets.new_empty(2 + 2 * num_experts, dtype=torch.int64)
    return route, offsets.new_empty(num_experts // ep)


@torch.library.register_fake(MOE_TO_EXPERTS, lib=_LIB)
def _to_experts_fake(x: Tensor, route: Tensor, num_experts: int, capacity: int, ep: int, ep_group: str, tp: int,
                     tp_group: str) -> Tensor:  # fmt: skip
    n: Any = received_rows(x.shape[0], num_experts, capacity, ep, tp)
    if not capacity:
        try:  # under FakeTensor with a shape environment (export, torch.compile): data-dependent
            n = torch.library.get_ctx().new_dynamic_size()
        except (RuntimeError, AttributeError, torch._subclasses.fake_tensor.DynamicOutputShapeException):
            pass  # on meta (planning): the expected count
    return x.new_empty((n, *x.shape[1:]))


@torch.library.register_fake(MOE_FROM_EXPERTS, lib=_LIB)
def _from_experts_fake(y: Tensor, route: Tensor, rows: int, num_experts: int, capacity: int, ep: int, ep_group: str,
                       tp: int, tp_group: str) -> Tensor:  # fmt: skip
    return y.new_empty((rows, *y.shape[1:]))


def _keep_route(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, route, *rest = inputs
    ctx.save_for_backward(route)
    ctx.rows = x.shape[0]
    ctx.layout = rest[-6:]


def _to_experts_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    (route,) = ctx.saved_tensors
    return (MOE_FROM_EXPERTS(grad.contiguous(), route, ctx.rows, *ctx.layout), *([None] * 7))


def _from_experts_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    (route,) = ctx.saved_tensors
    return (MOE_TO_EXPERTS(grad.contiguous(), route, *ctx.layout), *([None] * 8))


torch.library.register_autograd(MOE_TO_EXPERTS, _to_experts_backward, setup_context=_keep_route, lib=_LIB)
torch.library.register_autograd(MOE_FROM_EXPERTS, _from_experts_backward, setup_context=_keep_route, lib=_LIB)

for _op in DISPATCH_OPS:
    has_side_effect(_op)
