"""FP8 training: which GEMMs run in FP8 (``plan_fp8``), and what FP8 GEMMs and casts cost.

**Choice** (``plan_fp8``, on a graph lowered under the plan, so layouts are final). Every
GEMM site of ``passes/fp8_linear`` gets an ``Fp8Linear`` entry for its weight: the recipe,
or the model's dtype with a reason, in this order:

* outside the decoder layers (``lm_head``, projections before the first layer):
  ``FP8_OUTSIDE_LAYERS``, the usual FP8 training default (the logits feed the loss
  directly and ``lm_head`` is the GEMM most sensitive to precision);
* a weight that is not a float of 16 or 32 bits: ``FP8_DTYPE``;
* an input that is a partial sum (the summands would be scaled apart): ``FP8_PARTIAL_INPUT``;
* a local K or N (this rank's shard) that is not a multiple of ``Recipe.align`` (16:
  cuBLAS FP8 GEMMs; 128 blockwise), or, blockwise, a shard whose ranges do not start and
  end on 128-element blocks: ``FP8_DIMS``;
* blockwise with tokens split over the tp group (a replicated weight in a sequence
  parallel region): its weight-gradient tiles run along the tokens: ``FP8_TOKEN_SPLIT``.

A weight read by several GEMMs runs in FP8 only if all of them can. With tensorwise and
sequence parallelism, ``fp8_all_gather`` lets the all-gathers into FP8 GEMMs carry FP8.

**Cost** of one ``fp8_linear`` node (``fp8_node_cost``; ``autotp.cost_model.compute`` uses it):

* GEMMs: FLOPs as the bf16 GEMMs they replace (2·M·K·N each), run at
  ``HardwareProfile.fp8_matmul_speedup`` times the bf16 rate;
* casts, memory-bound, outside the GEMM: per quantized operand of n elements of e bytes,
  an amax pass and a cast pass read it (2·e·n) and the FP8 copy is written (n).
  A delayed recipe (``autotp.ir.fp8_delayed``) reads it once: the cast does not wait for
  this step's amax, which the same pass computes (e·n + n).
  Forward: x once and every weight, plus the transposed FP8 copies that the backward's
  GEMMs read and the forward makes (each weight's for dgrad when its scale blocks are
  symmetric, x's for wgrad under tensorwise: 2 bytes moved per element each). Backward:
  each output gradient quantized and transposed, plus the transposed copies the forward
  did not make (a weight's from bf16 for other blocks, e·n + n; x's, 2 per element):
  ``cast_bytes`` forward and backward.
* a fused lm_head + loss with an FP8 lm_head (``plan.fp8_linears`` says so for its weight):
  its GEMMs at the FP8 rate, and in its forward h and W quantized (2·e·n + n each) and
  transposed (2·n), each logit gradient element quantized and transposed (2·e + 3 per element).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.fx import GraphModule, Node

from autotp.analysis.layers import layer_of
from autotp.analysis.local_shapes import TensorInfo, local_tensors
from autotp.cost_model.flops import Tensors
from autotp.ir import fp8, meta_keys, ops
from autotp.ir.errors import UserInputError
from autotp.ir.layouts import Layout, resolve
from autotp.ir.plan import FP8_DIMS, FP8_DTYPE, FP8_OUTSIDE_LAYERS, FP8_PARTIAL_INPUT, FP8_TOKEN_SPLIT, Fp8Linear, ParallelPlan
from autotp.passes.fp8_linear import FP8_OPS, GemmSite, gemm_sites, split_bits

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_recipe(recipe: str, backend: str = "torch") -> None:
    if recipe not in fp8.RECIPES:
        raise UserInputError(f"fp8={recipe!r} is not an FP8 recipe; use one of {sorted(fp8.RECIPES)} (or True for {fp8.DEFAULT_RECIPE!r})")
    if backend not in FP8_OPS:
        raise UserInputError(f"fp8 backend {backend!r} is not registered; registered: {sorted(FP8_OPS)}")


def plan_fp8(lowered: GraphModule, plan: ParallelPlan, recipe: str, backend: str = "torch") -> ParallelPlan:
    """``plan`` with every GEMM weight's FP8 choice (rules in the module docstring);
    ``lowered`` is the graph compiled under ``sites_plan(plan)`` (any rank, any device)."""
    check_recipe(recipe, backend)
    spec = fp8.RECIPES[recipe]
    if spec.delayed and plan.pp > 1:
        raise UserInputError(f"fp8={recipe!r} is not supported with a pipeline (pp={plan.pp}): its first step must "
                             f"seed the amax histories eagerly; use fp8={fp8.TENSORWISE!r} or pp=1")  # fmt: skip
    decided: dict[str, Fp8Linear] = {}
    for site in gemm_sites(lowered):
        entry = _decide(site, spec, plan.tp)
        if site.param not in decided or (decided[site.param].recipe and not entry.recipe):
            decided[site.param] = entry
    gathers = recipe == fp8.TENSORWISE and plan.sequence_parallel and plan.tp > 1
    return replace(plan, fp8=recipe, fp8_backend=backend, fp8_linears=tuple(decided.values()), fp8_all_gather=gathers)


def with_fp8_weights(plan: ParallelPlan, weights: list[str], recipe: str = "") -> ParallelPlan:
    """``plan`` with the GEMMs reading ``weights`` in FP8 (``recipe``, default the plan's),
    overriding the planner's choice: the user's opt-in for ``lm_head.weight``, which it keeps
    in the model's dtype (``parallelize(plan=...)`` runs the result)."""
    recipe = recipe or plan.fp8
    check_recipe(recipe, plan.fp8_backend)
    listed = {e.weight for e in plan.fp8_linears}
    missing = sorted(set(weights) - listed)
    if missing:
        raise UserInputError(f"{missing} are not GEMM weights of this plan (plan.fp8_linears lists {sorted(listed)}); "
                             f"plan with fp8=... first")  # fmt: skip
    edited = tuple(replace(e, recipe=recipe, reason="", detail="chosen by the user") if e.weight in weights else e
                   for e in plan.fp8_linears)  # fmt: skip
    return replace(plan, fp8=plan.fp8 or recipe, fp8_linears=edited)


def without_fp8(plan: ParallelPlan) -> ParallelPlan:
    return replace(plan, fp8="", fp8_linears=(), fp8_all_gather=False)


def sites_plan(plan: ParallelPlan) -> ParallelPlan:
    """The plan to lower for ``plan_fp8``: no FP8 and no ``tp_overlap``, whose fused ops would
    hide the GEMM sites (``fp8_linear`` runs before ``tp_overlap``, on the same layouts)."""
    return replace(without_fp8(plan), tp_overlap=())


def _decide(site: GemmSite, spec: fp8.Recipe, tp: int) -> Fp8Linear:
    def keep(reason: str, detail: str) -> Fp8Linear:
        return Fp8Linear(site.param, "", reason, detail, site.node.name)

    if layer_of(site.node) is None:
        return keep(FP8_OUTSIDE_LAYERS, "outside the decoder layers (lm_head and the like): kept in the model's dtype")
    weight = site.weight.meta["val"]
    if weight.dtype not in _FLOATS:
        return keep(FP8_DTYPE, f"the weight is {weight.dtype}")
    lay = site.x.meta.get(meta_keys.LAYOUT)
    if isinstance(lay, Layout) and lay.partial:
        return keep(FP8_PARTIAL_INPUT, f"reads {site.x.name}, a partial sum over the tp group")
    shape = local_tensors(site.weight, tp)[0].shape
    n, k = (shape[1], shape[0]) if site.kn else shape
    bad = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % spec.align]
    if bad:
        return keep(FP8_DIMS, f"local {', '.join(bad)} not a multiple of {spec.align} ({spec.name} FP8 GEMMs)")
    weight_layout = site.weight.meta.get(meta_keys.LAYOUT)
    if spec.activation[1] > 1 and isinstance(weight_layout, Layout):  # tiles must not straddle shards
        for _, var in weight_layout.dims:
            sharding = resolve(var, tp)
            ranges = [r for rank in range(tp) for r in sharding.ranges(rank, tp)]
            if any(start % spec.align or (stop - start) % spec.align for start, stop in ranges):
                return keep(FP8_DIMS, f"its tp shards are not cut on {spec.align}-element blocks")
    if spec.activation[1] > 1 and split_bits(site.x) & fp8.X_ROWS:
        return keep(FP8_TOKEN_SPLIT, "its input's tokens are split over the tp group, across the weight-gradient tiles")
    return Fp8Linear(site.param, spec.name, node=site.node.name)


def node_call(node: Node) -> fp8.Fp8Call:
    """The ``Fp8Call`` of an ``fp8_linear`` node."""
    _, _, _, recipe, x_split, n_split, gather_dim, group_size, group = node.args[:9]
    return fp8.call_of(recipe, x_split, n_split, gather_dim, group_size, group)


def has_fp8_gemms(node: Node) -> bool:
    """Whether ``node`` runs GEMMs in FP8: an ``fp8_linear``, or a fused loss with an FP8 lm_head."""
    return node.target is ops.FP8_LINEAR or (node.target is ops.LINEAR_CROSS_ENTROPY and bool(_loss_recipe(node)))


def _loss_recipe(node: Node) -> str:
    return node.args[10] if len(node.args) > 10 else node.kwargs.get("fp8_recipe", "")


def cast_bytes(node: Node, tensors: Tensors) -> tuple[int, int]:
    """(forward, backward) bytes that the casts of an ``fp8_linear`` node, or of a fused loss
    with an FP8 lm_head, move (module docstring); 0 for other nodes."""
    if node.target is ops.LINEAR_CROSS_ENTROPY and _loss_recipe(node):
        return _fused_loss_cast_bytes(node, tensors), 0
    if node.target is not ops.FP8_LINEAR:
        return 0, 0
    x, outs = tensors(node.args[0])[0], tensors(node)
    weights = [tensors(w)[0] for w in node.args[1]]
    k, m = x.shape[-1], outs[0].numel // outs[0].shape[-1]

    recipe = node_call(node).recipe
    reads = 1 if recipe.delayed else 2  # a delayed cast takes its amax in the same pass

    def quantized(t: TensorInfo) -> int:
        return reads * t.nbytes + t.numel

    symmetric, xt_early = recipe.weight[0] == recipe.weight[1], recipe.whole
    weights_t = sum(2 * w.numel if symmetric else w.nbytes + w.numel for w in weights)
    forward = quantized(x) + sum(quantized(w) for w in weights) + (weights_t if symmetric else 0)
    forward += 2 * m * k if xt_early else 0
    backward = sum(quantized(o) + 2 * o.numel for o in outs) + (0 if symmetric else weights_t)
    backward += 0 if xt_early else 2 * m * k
    return forward, backward


def _fused_loss_cast_bytes(node: Node, tensors: Tensors) -> int:
    """h and W quantized (read twice, FP8 written), W's and every chunk's h transposed (2 per
    element), the logit gradient [tokens, V] quantized from the weight's dtype and transposed."""
    h, w = tensors(node.args[0])[0], tensors(node.args[1])[0]
    logit_grads = (h.numel // h.shape[-1]) * w.shape[0]
    return 2 * h.nbytes + 3 * h.numel + 2 * w.nbytes + 3 * w.numel + logit_grads * (2 * w.nbytes // w.numel + 3)


def amax_reduce_bytes(node: Node, tensors: Tensors) -> tuple[int, int]:
    """(forward, backward) float32 bytes of the amaxes an ``fp8_linear`` node all-reduces (max)."""
    x = tensors(node.args[0])[0]
    ns = [tensors(w)[0].shape[0] for w in node.args[1]]
    forward, backward = fp8.reduced_amaxes(node_call(node), x.numel // x.shape[-1], x.shape[-1], ns)
    return 4 * forward, 4 * backward
