"""The compile sequence: trace -> plan -> passes -> rank program, written once.

``plan_model`` traces a model at its example inputs and chooses its ``ParallelPlan``
(the caller's, the cost model's, or tp/pp's defaults). ``lower`` runs the passes and the
cost model's decision steps (``compile_steps``) on that trace for one tp rank and returns
its ``RankProgram`` (``autotp.ir.program``): the plan with the decisions made on the way,
the rank graph and its chunk graphs, ready to run. ``autotp.compile_rank`` is one
``plan_model`` + ``lower``; ``autotp.parallelize`` creates the process groups between the
two (they depend on the plan; ``lower`` needs the rank) and the ``ParallelModel`` calls
``lower_signature`` for each new input signature, and ``with_param_waits`` when a
DistributedOptimizer overlaps its parameter all-gather. The cost model compiles candidate
plans through ``model_costs``'s callback.

``lower`` hands the pass runner a copy of the traced graph that it owns: the passes may
rewrite that copy in place and the caller's graph is never touched.
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from transformers import PretrainedConfig

from autotp import presets
from autotp.analysis.batch_rows import batch_size, batch_verdicts, input_row_dims, rows_past_dim0
from autotp.analysis.layers import num_layers, repeated_modules
from autotp.analysis.pipeline_units import units
from autotp.analysis.trace import input_batch_dims, trace
from autotp.analysis.trace_guards import sparse_gradient_node
from autotp.cost_model.compute import ModelCosts
from autotp.cost_model.cudagraphs import choose_cudagraph_regions
from autotp.cost_model.expert_parallel import plan_expert_parallel
from autotp.cost_model.fp8 import check_recipe, plan_fp8, sites_plan, without_fp8
from autotp.cost_model.hardware import device_hardware
from autotp.cost_model.pipeline import plan_pipeline
from autotp.cost_model.planner import auto_plan, auto_sequence_parallel
from autotp.cost_model.recompute import RecomputeArg, with_recompute
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.cost_model.unread_params import plan_unread_params, refuse_reading_unread
from autotp.ir import meta_keys
from autotp.ir.fp8 import DEFAULT_RECIPE
from autotp.ir.plan import OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER, ParallelPlan
from autotp.ir.rank_log import warn_once
from autotp.passes import PASSES, PROGRAM_PASSES
from autotp.passes.causal_attention import CAUSAL
from autotp.ir.program import BucketLayout, RankProgram
from autotp.passes.find_cudagraph_candidates import find_cudagraph_candidates
from autotp.passes.insert_param_waits import insert_param_waits
from autotp.passes.runner import Pass, PassContext, run_passes
from autotp.passes.split_weight_grads import split_weight_grads
from autotp.ir.errors import UserInputError, describe

log = logging.getLogger(__name__)

DEFAULT_BATCH, DEFAULT_SEQ = 2, 16
LOSS_ONLY = ("loss",)
"""The output keys ``train_step`` reads without a ``loss_fn``: its graph drops the others."""
PLANNING_BATCH = 2


@dataclass(frozen=True)
class Planned:
    """A model traced at its example inputs and the plan chosen for it."""

    traced: GraphModule
    kwargs: dict[str, Any]
    plan: ParallelPlan
    trace_s: float
    plan_s: float


def example_kwargs(model: nn.Module, example_inputs: dict[str, Any] | None) -> dict[str, Any]:
    """``example_inputs``, or random ``input_ids`` of shape [2, 16] for a HF model; ``use_cache=False`` where accepted."""
    kwargs = dict(example_inputs) if example_inputs is not None else _default_inputs(model)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("use_cache", False)
    return kwargs


def _default_inputs(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    if vocab is None:
        raise UserInputError(
            f"{type(model).__name__} has no config.vocab_size to make example inputs from; "
            "pass example_inputs={'input_ids': ...} (or whatever its forward takes)"
        )
    return {"input_ids": torch.randint(0, vocab, (DEFAULT_BATCH, DEFAULT_SEQ))}


def model_costs(gm: GraphModule, num_layers_total: int | None = None) -> ModelCosts:
    """The cost model of ``gm``, compiling candidate plans as tp rank 0 on meta, as ``train_step`` runs them
    (reading only the loss; ``rank_graph``)."""
    return ModelCosts(gm, num_layers_total, compile_fn=lambda plan: rank_graph(gm, plan, outputs_read=LOSS_ONLY))


def trace_for_planning(config: PretrainedConfig, seq: int, *, dtype: torch.dtype = torch.bfloat16, traced_layers: int = 1) -> ModelCosts:
    """``ModelCosts`` of a HF config: ``traced_layers`` decoder layers traced on meta at [2, seq]."""
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise UserInputError(f"--seq {seq} exceeds the model's max_position_embeddings ({limit}); plan for {limit} or less")
    total = getattr(text, "num_hidden_layers", None)
    small = copy.deepcopy(config)
    if total is not None:
        small_text = small.get_text_config()
        small_text.num_hidden_layers = min(total, traced_layers)
        if isinstance(getattr(small_text, "layer_types", None), list):
            small_text.layer_types = small_text.layer_types[: small_text.num_hidden_layers]
    model = presets.build_from_config(small, device="meta", dtype=dtype)
    ids = torch.zeros((PLANNING_BATCH, seq), dtype=torch.long)
    gm = trace(model, {"input_ids": ids, "labels": ids, "use_cache": False}, "meta")
    return model_costs(gm, total)


def choose_plan(
    traced: GraphModule, tp: int, pp: int, dp: int, vpp: int, plan: ParallelPlan | str | None, *,
    sequence_parallel: bool | None = None, tp_overlap: bool | None = None, fp8: str = "", compiled: bool = False,
) -> ParallelPlan:  # fmt: skip
    """The caller's plan (checked against the degrees), the cost model's (``"auto"``, with
    ``sequence_parallel`` and ``tp_overlap`` fixed where not None, ``compiled`` as in ``plan_model``) or tp/pp's
    default."""
    if isinstance(plan, ParallelPlan):
        if (plan.tp, plan.pp, plan.dp, plan.vpp) != (tp, pp, dp, vpp):
            raise UserInputError(
                f"the plan is for tp={plan.tp}, pp={plan.pp}, dp={plan.dp}, vpp={plan.vpp} but "
                f"tp={tp}, pp={pp}, dp={dp}, vpp={vpp} was asked; pass matching degrees"
            )
        return plan
    if plan not in (None, "auto"):
        raise UserInputError(f"plan must be a ParallelPlan, 'auto' or None, got {plan!r}")
    if plan == "auto":  # the cost model plans what the caller left at 1: all of tp/pp, else vpp
        fixed = tp > 1 or pp > 1
        return auto_plan(model_costs(traced), tp * pp * dp, tp=tp if fixed else None, pp=pp if fixed else None,
                         vpp=vpp if vpp > 1 else None, sequence_parallel=sequence_parallel, tp_overlap=tp_overlap,
                         fp8=fp8, compiled=compiled)  # fmt: skip
    layers = num_layers(traced)
    blocks = 0 if layers or repeated_modules(traced.graph) else len(set(units(traced).values()))  # cut between blocks without a layer list
    if pp * vpp > 1 and pp * vpp > max(layers, blocks):
        raise UserInputError(f"pp*vpp = {pp}*{vpp} = {pp * vpp} pipeline chunks but the model has {layers} layers; " + _too_few_layers(traced, layers, blocks))
    chosen = plan_tensor_parallel(traced, tp)
    return replace(chosen, pp=pp, dp=dp, vpp=vpp, **plan_pipeline(traced, pp, vpp)._asdict())


def _too_few_layers(traced: GraphModule, layers: int, blocks: int) -> str:
    """The fix for a pipeline deeper than the model's layers (or, without a layer list, its blocks)."""
    if layers:
        return f"use pp*vpp <= {layers}"
    if blocks:
        return (f"without a numbered list of layers autotp cuts between the {blocks} modules the forward runs one after another; "
                f"use pp*vpp <= {blocks}")
    shared = "".join(f"; module '{path}' runs {n} times with the same parameters (cross-layer sharing), so every stage would hold "
                     "all of them and pipelining saves no memory" for path, n in list(repeated_modules(traced.graph).items())[:1])  # fmt: skip
    return ("autotp cuts between the modules of a numbered list (model.layers.0, model.layers.1, ...) and none runs in this one"
            f"{shared}; use pp=1 (tp shards it)")


def plan_model(
    model: nn.Module,
    example_inputs: dict[str, Any] | None,
    device: torch.device | str,
    *,
    tp: int,
    pp: int,
    dp: int,
    vpp: int,
    plan: ParallelPlan | str | None,
    cudagraph_impl: str | None = None,
    gather_outputs: bool = True,
    sequence_parallel: bool | str | None = None,
    tp_overlap: bool | str | None = None,
    ep: int = 1,
    etp: int | None = None,
    moe_dispatch: str | None = None,
    moe_capacity_factor: float | None = None,
    fp8: str | bool | None = None,
    recompute: RecomputeArg = None,
    compiled: bool = False,
) -> Planned:
    """Trace ``model`` on ``device`` and choose its plan. ``cudagraph_impl`` (the capture
    implementation) turns CUDA graphs on, keeping an implementation the plan names.
    ``sequence_parallel`` and ``tp_overlap``: True or False fix them; ``"auto"`` lets the
    cost model weigh both at the plan's degrees; None keeps the plan's (``plan="auto"``: the
    planner weighs them with the degrees). ``tp_overlap=True`` overlaps both kinds of
    sequence-parallel collective and needs sequence parallelism. ``fp8``: an FP8 recipe
    (``autotp.ir.fp8.RECIPES``; True: the default one) for the GEMMs ``plan_fp8`` admits,
    False for none, None keeps the plan's. ``recompute``: the decoder layers whose activations
    the backward recomputes (``cost_model.recompute.with_recompute``). ``compiled``: the rank graphs
    will run under ``torch.compile``, which the cost model's choices price (``cost_model.fused_kernels``)."""
    for name, value in (("sequence_parallel", sequence_parallel), ("tp_overlap", tp_overlap)):
        if value is not None and not isinstance(value, bool) and value != "auto":
            raise UserInputError(f"{name} must be True, False or 'auto', got {value!r}")
    keeps_off = sequence_parallel is None and plan != "auto" and not getattr(plan, "sequence_parallel", False)
    if tp_overlap is True and tp > 1 and (sequence_parallel is False or keeps_off):
        raise UserInputError(
            "tp_overlap=True overlaps the all-gathers and reduce-scatters of sequence parallelism; "
            "pass sequence_parallel=True (or 'auto') with it, or tp_overlap='auto'"
        )
    fixed_sp = sequence_parallel if isinstance(sequence_parallel, bool) else None
    fixed_overlap = tp_overlap if isinstance(tp_overlap, bool) else None
    kwargs = example_kwargs(model, example_inputs)
    start = time.perf_counter()
    traced = trace(model, kwargs, device)
    traced_at = time.perf_counter()
    recipe = fp8_recipe(fp8)
    chosen = choose_plan(traced, tp, pp, dp, vpp, plan, sequence_parallel=fixed_sp, tp_overlap=fixed_overlap, fp8=recipe,
                         compiled=compiled)  # fmt: skip
    if cudagraph_impl is not None:
        chosen = replace(chosen, cudagraphs=True, cudagraph_impl=chosen.cudagraph_impl or cudagraph_impl)
    hardware = device_hardware(torch.device(device))
    if hardware is not None and hardware != chosen.hardware:
        log.info("the plan was costed for %s; this rank runs on %s, which the compiler's cost decisions use", chosen.hardware, hardware)
        chosen = replace(chosen, hardware=hardware)
    if not gather_outputs:
        chosen = replace(chosen, gather_outputs=False)
    if "auto" in (sequence_parallel, tp_overlap) and plan != "auto":
        keep_sp = chosen.sequence_parallel if sequence_parallel is None else fixed_sp
        keep_overlap = bool(chosen.tp_overlap) if tp_overlap is None else fixed_overlap
        chosen = auto_sequence_parallel(model_costs(traced), chosen, sequence_parallel=keep_sp, tp_overlap=keep_overlap,
                                        fp8=recipe or chosen.fp8, compiled=compiled)  # fmt: skip
    else:
        chosen = _with_fixed_sequence_parallel(chosen, fixed_sp, fixed_overlap)
    if isinstance(plan, ParallelPlan):
        if ep not in (1, plan.ep):
            raise UserInputError(f"the plan is for ep={plan.ep} but ep={ep} was asked; pass ep={plan.ep} or re-plan")
    else:
        if plan == "auto" and ep == 1 and moe_dispatch is None and chosen.ep > 1:  # the planner's expert parallelism
            ep, moe_dispatch = chosen.ep, chosen.moe_dispatch
            moe_capacity_factor = chosen.moe_capacity_factor or None
        chosen = plan_expert_parallel(traced, chosen, ep=ep, etp=etp, dispatch=moe_dispatch, capacity_factor=moe_capacity_factor)
    chosen = with_fp8(traced, chosen, fp8)
    if not chosen.unread:
        chosen = plan_unread_params(traced, chosen)
    batch_dims = input_batch_dims(model, kwargs, device)
    mixing, statistics, output_rows = batch_verdicts(traced, batch_size(kwargs, batch_dims), input_row_dims(kwargs, batch_dims))
    past = rows_past_dim0(traced, kwargs) if mixing else None
    if past is not None:
        batch_dims, (mixing, statistics, output_rows) = past
        log.info("the forward mixes dim 0 of its inputs and never dim 1: the batch is on dim 1 of %s", ", ".join(batch_dims))
    chosen = replace(chosen, input_batch_dims=tuple(batch_dims.items()), batch_mixing=mixing, batch_statistics=statistics, output_batch_dims=output_rows,
                     requires_grad_set=tuple(sorted(traced.meta.get(meta_keys.REQUIRES_GRAD_SET, {}).items())),
                     branch_buffers=tuple(sorted(traced.meta.get(meta_keys.BRANCH_BUFFERS, ()))))  # fmt: skip
    chosen = with_recompute(traced, chosen, recompute, planned_here=not isinstance(plan, ParallelPlan))
    planned_at = time.perf_counter()
    _warn_replicated(traced, chosen)
    sparse = sparse_gradient_node(traced)
    if sparse is not None and chosen.tp * chosen.pp * chosen.dp > 1:
        raise UserInputError(f"{describe(sparse)} gives its weight a sparse gradient (sparse=True), which autotp does not "
                             f"shard, send between pipeline stages or average over dp ranks (tp={chosen.tp}, pp={chosen.pp}, "
                             f"dp={chosen.dp}); make the embedding with sparse=False")  # fmt: skip
    log.info("traced in %.2f s, planned in %.2f s: tp=%d pp=%d dp=%d vpp=%d", traced_at - start,
             planned_at - traced_at, chosen.tp, chosen.pp, chosen.dp, chosen.vpp)  # fmt: skip
    return Planned(traced, kwargs, chosen, traced_at - start, planned_at - traced_at)


def _with_fixed_sequence_parallel(plan: ParallelPlan, sequence_parallel: bool | None, tp_overlap: bool | None) -> ParallelPlan:
    """``plan`` with the caller's True/False for either (None keeps the plan's)."""
    if sequence_parallel is not None:
        plan = replace(plan, sequence_parallel=sequence_parallel)
    if tp_overlap is not None or not plan.sequence_parallel:
        overlap = tp_overlap and plan.sequence_parallel
        plan = replace(plan, tp_overlap=(OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER) if overlap else ())
    return plan


def fp8_recipe(fp8: str | bool | None) -> str:
    """The recipe that ``fp8`` names ("" for None or False); an unknown one raises."""
    recipe = DEFAULT_RECIPE if fp8 is True else fp8 or ""
    if recipe:
        check_recipe(recipe)
    return recipe


def with_fp8(traced: GraphModule, plan: ParallelPlan, fp8: str | bool | None) -> ParallelPlan:
    """``plan`` with the FP8 choice of every GEMM for ``fp8`` (see ``plan_model``)."""
    if fp8 is None:
        return plan
    if fp8 is False:
        return without_fp8(plan)
    recipe = fp8_recipe(fp8)
    check_recipe(recipe, plan.fp8_backend)
    lowered = lower(traced, sites_plan(plan), device="meta").graph
    chosen = plan_fp8(lowered, plan, recipe, plan.fp8_backend)
    kept = [e for e in chosen.fp8_linears if not e.recipe]
    log.info("fp8 %s: %d GEMM weights in FP8, %d kept in the model's dtype (plan.fp8_linears says why)%s",
             recipe, len(chosen.fp8_linears) - len(kept), len(kept),
             "; tp_overlap fuses only the GEMMs left in the model's dtype" if plan.tp_overlap else "")  # fmt: skip
    return chosen


REPLICATED_SLACK = 1.3
"""A rank should hold at most ``REPLICATED_SLACK / tp`` of the parameters; more is warned about."""


def _warn_replicated(traced: GraphModule, plan: ParallelPlan) -> None:
    """Log a warning naming the largest replicated parameters when a tp rank holds too much."""
    if plan.tp == 1:
        return
    params = dict(traced.named_parameters())
    total = sum(p.numel() for p in params.values())
    experts = {p for layer in plan.moe_layers for p in layer.params} if plan.ep > 1 else set()
    sharded = {pl.name for pl in plan.params} | experts
    replicated = sorted(((p.numel(), n) for n, p in params.items() if n not in sharded), reverse=True)
    on_ep = sum(params[n].numel() for n in experts if n in params)
    held = (sum(n for n, _ in replicated) + on_ep / plan.ep + (total - sum(n for n, _ in replicated) - on_ep) / plan.tp) / max(total, 1)
    if held > REPLICATED_SLACK / plan.tp:
        largest = ", ".join(f"{n} ({size})" for size, n in replicated[:5])
        warn_once(
            log,
            "a tp rank holds %.0f%% of the parameters (tp=%d; at most %.0f%% expected): the largest replicated "
            "parameters are %s; `autotp explain` and `autotp dump` show the op that kept them whole",
            100 * held, plan.tp, 100 * REPLICATED_SLACK / plan.tp, largest,
        )


def compile_steps(program: bool = True) -> list[Pass]:
    """What ``lower`` runs: the passes, with the cost model's decision steps where the passes
    after them read the decision (the CUDA-graph regions are chosen once the candidates are
    found), then, with ``program``, the passes that build the rank program's chunk graphs."""
    at = PASSES.index(find_cudagraph_candidates) + 1
    return [*PASSES[:at], choose_cudagraph_regions, *PASSES[at:], *(PROGRAM_PASSES if program else [])]


def lower(
    traced: GraphModule,
    plan: ParallelPlan,
    *,
    tp_rank: int = 0,
    device: torch.device | str = "meta",
    backend: str = "nccl",
    dump_dir: Path | None = None,
    ep_rank: int = 0,
    outputs_read: tuple[str, ...] = (),
    param_buckets: BucketLayout | None = None,
) -> RankProgram:
    """Run ``compile_steps()`` on a copy of ``traced`` for tp rank ``tp_rank`` (and expert-parallel
    rank ``ep_rank``): the rank's program, whose plan holds the decisions made on the way (the
    CUDA-graph regions) and the SDPA nodes ``causal_attention`` rewrote. ``outputs_read``: the
    output keys the caller reads (empty: all; the others become None). ``param_buckets``: make the
    graphs wait for a DistributedOptimizer's all-gather of those buckets. A rank on the CPU or gloo
    overlaps through the P2P ring whatever the plan asked for; the plan it returns says so."""
    refuse_reading_unread(traced, plan)
    if plan.tp_overlap and (torch.device(device).type == "cpu" or backend == "gloo"):
        plan = replace(plan, tp_overlap_impl="ring")
    ctx = PassContext(plan=plan, tp_rank=tp_rank, ep_rank=ep_rank, device=torch.device(device), dump_dir=dump_dir,
                      backend=backend, outputs_read=outputs_read, param_buckets=param_buckets)  # fmt: skip
    owned = _owned_copy(traced)
    owned.meta[meta_keys.BATCH_DENOMINATORS] = traced.meta.get(meta_keys.BATCH_DENOMINATORS, ())  # passes/batch_draws rewrites their draws
    gm = _run(owned, ctx, compile_steps())
    causal = tuple(n.name for n in gm.graph.nodes if n.meta.get(meta_keys.CAUSAL_MASK) == CAUSAL)
    return RankProgram.of(gm, replace(ctx.plan, causal_attention_nodes=causal), dict(ctx.timings))


def rank_graph(traced: GraphModule, plan: ParallelPlan, *, outputs_read: tuple[str, ...] = ()) -> GraphModule:
    """The rank graph ``lower`` makes for tp rank 0 on meta, without its chunk graphs (``PROGRAM_PASSES`` only add
    those, and leave the rank graph as it is): what the cost model reads of a candidate plan."""
    refuse_reading_unread(traced, plan)
    ctx = PassContext(plan=plan, device=torch.device("meta"), outputs_read=outputs_read)
    return _run(_owned_copy(traced), ctx, compile_steps(program=False))


WAIT_STEPS = [insert_param_waits, split_weight_grads]
"""What ``with_param_waits`` runs again on a lowered program: the waits, and the weight-gradient copies that keep them."""


def with_param_waits(program: RankProgram, param_buckets: BucketLayout, *, tp_rank: int, device: torch.device, backend: str) -> RankProgram:
    """``program`` with its chunk graphs waiting for the all-gathers of ``param_buckets``
    (a DistributedOptimizer made after the program was lowered); rewrites ``program``'s graphs."""
    ctx = PassContext(plan=program.plan, tp_rank=tp_rank, device=device, backend=backend, param_buckets=param_buckets)
    gm = _run(program.graph, ctx, WAIT_STEPS)
    return RankProgram.of(gm, program.plan, {k: program.pass_s.get(k, 0.0) + ctx.timings.get(k, 0.0) for k in program.pass_s | ctx.timings})


def _run(gm: GraphModule, ctx: PassContext, steps: list[Pass]) -> GraphModule:
    """The one place the passes run (``tests/test_architecture.py``)."""
    return run_passes(gm, ctx, steps)


def lower_signature(
    model: nn.Module, kwargs: dict[str, Any], plan: ParallelPlan, *, tp_rank: int, device: torch.device, backend: str,
    ep_rank: int = 0,
    outputs_read: tuple[str, ...] = (),
    param_buckets: BucketLayout | None = None,
    split_batch: bool = False,
) -> RankProgram:  # fmt: skip
    """Trace ``model(**kwargs)`` (one piece of a split step, with ``split_batch``) and lower it
    under an already chosen ``plan``."""
    return lower(trace(model, kwargs, device, split_batch, dict(plan.input_batch_dims)), plan, tp_rank=tp_rank, device=device, backend=backend, ep_rank=ep_rank,
                 outputs_read=outputs_read, param_buckets=param_buckets)


def _owned_copy(gm: GraphModule) -> GraphModule:
    """A graph the passes may rewrite in place; parameters are shared with ``gm``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deepcopy of the graph's pytree specs
        return GraphModule(gm, copy.deepcopy(gm.graph))
