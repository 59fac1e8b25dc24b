"""``autotp.parallelize`` and ``autotp.compile_rank``: check the arguments, compile, build the runtime model."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from autotp import compiler
from autotp.ir.axes import Axis
from autotp.ir.errors import UserInputError
from autotp.ir import fp8_delayed
from autotp.ir.fp8 import DEFAULT_RECIPE, RECIPES
from autotp.ir.plan import ParallelPlan
from autotp.ir.program import RankProgram
from autotp.ir.plan_files import load_plan
from autotp.runtime.execution import cudagraphs, rng
from autotp.runtime.processes.groups import make_groups
from autotp.runtime.state.same_model import refuse_different_models
from autotp.runtime.execution.parallel_model import ParallelModel


@dataclass(frozen=True)
class CompiledRank:
    """One rank's rewritten graph, compiled offline (no process group, nothing run), and its
    program (the chunk graphs the runtime would run)."""

    graph: GraphModule
    plan: ParallelPlan
    trace_s: float
    plan_s: float
    pass_s: dict[str, float]
    program: RankProgram


def _default_device(model: nn.Module) -> torch.device:
    """The rank's CUDA device under NCCL; without a process group, the device the model is on
    (the CPU for a model on meta); else the CPU."""
    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    placed = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    return placed if placed is not None else torch.device("cpu")


def _check_cuda_graphs(device: torch.device) -> None:
    backend = dist.get_backend() if dist.is_initialized() else None
    if device.type != "cuda" or backend not in (None, "nccl"):
        raise UserInputError(
            f"cuda_graphs=True captures CUDA graphs, but this rank runs on {device}"
            f"{f' with {backend} collectives' if backend else ''}; run on GPUs with NCCL, or drop cuda_graphs "
            "(autotp.report.cudagraphs shows the regions and blockers without a GPU)"
        )


def _compile_backend(compile: bool | str) -> str | None:
    """``parallelize(compile=...)`` as a ``torch.compile`` backend name (None: eager)."""
    if not isinstance(compile, str):
        return "inductor" if compile else None
    known = torch._dynamo.list_backends(exclude_tags=())
    if compile not in known:
        raise UserInputError(f"compile={compile!r} is not a torch.compile backend; pass True (inductor), False or one of {known}")
    return compile


def _check_fp8(device: torch.device, fp8: str | bool | None, plan: ParallelPlan | str | None, cuda_graphs: bool = False) -> None:
    """FP8 needs FP8 tensor cores on a GPU (cuBLAS's blockwise kernels: SM90); the CPU runs it slowly."""
    recipe = fp8 if fp8 is not None else plan.fp8 if isinstance(plan, ParallelPlan) else None
    if not recipe:
        return
    spec = RECIPES.get(DEFAULT_RECIPE if recipe is True else recipe)
    if spec is None:
        return  # the compiler names the recipes
    if spec.delayed and cuda_graphs:
        raise UserInputError(fp8_delayed.CUDA_GRAPHS_REFUSAL)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        low, high = spec.min_capability, spec.max_capability
        if capability < low or (high is not None and capability > high):
            needs = f"compute capability {low[0]}.{low[1]}" + (" exactly (cuBLAS's blockwise FP8 kernels are SM90 only)" if high else " or higher (FP8 tensor cores: Ada, Hopper and later)")
            raise UserInputError(
                f"fp8={spec.name!r} needs {needs}, but {torch.cuda.get_device_name(device)} has "
                f"{capability[0]}.{capability[1]}; drop fp8{' or pick tensorwise/rowwise' if high else ''} on this GPU"
            )
    elif device.type == "cpu":
        warnings.warn(f"fp8={spec.name!r} on the CPU runs torch._scaled_mm's CPU kernels: right numbers, slowly (for tests)", stacklevel=3)


def _check_degrees(tp: int, pp: int, vpp: int) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp)):
        if value < 1:
            raise UserInputError(f"{name} must be >= 1, got {value}")
    if vpp > 1 and pp == 1:
        raise UserInputError(
            f"vpp={vpp} interleaves model chunks between pipeline stages, but pp=1 has one stage; "
            "pass pp >= 2 with vpp, or drop vpp"
        )


def compile_rank(
    model: nn.Module,
    *,
    tp: int,
    rank: int = 0,
    pp: int = 1,
    vpp: int = 1,
    example_inputs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | Path | dict | list | None = None,
    device: torch.device | str = "meta",
    dump_dir: Path | None = None,
    cuda_graphs: bool = False,
    sequence_parallel: bool | str | None = None,
    tp_overlap: bool | str | None = None,
    ep: int = 1,
    moe_dispatch: str | None = None,
    moe_capacity_factor: float | None = None,
    fp8: str | bool | None = None,
    recompute: str | bool | list[int] | None = None,
) -> CompiledRank:
    """Trace, plan and rewrite the graph of tp rank ``rank`` without any process group.

    For inspection, dumps and compile-time benchmarks; a model on ``meta`` never
    allocates its weights. With pp > 1 the graph carries the stage boundaries. With
    ``cuda_graphs`` the plan asks for CUDA graphs and the nodes carry their regions and
    blockers, as a GPU rank on NCCL would capture them. With ``ep`` (and ``moe_dispatch``,
    ``moe_capacity_factor``, as ``parallelize`` takes them) the graph is ep rank 0's, dp the
    smallest that ep folds onto. ``recompute`` as ``parallelize`` takes it.
    """
    _check_degrees(tp, pp, vpp)
    plan = load_plan(plan)
    if not 0 <= rank < tp:
        raise UserInputError(f"rank {rank} is outside tp={tp}; pick 0..{tp - 1}")
    impl = cudagraphs.implementation() if cuda_graphs else None
    planned = compiler.plan_model(model, example_inputs, device, tp=tp, pp=pp, dp=ep // math.gcd(ep, tp), vpp=vpp, plan=plan,
                                  cudagraph_impl=impl, sequence_parallel=sequence_parallel, tp_overlap=tp_overlap, ep=ep,
                                  moe_dispatch=moe_dispatch, moe_capacity_factor=moe_capacity_factor, fp8=fp8,
                                  recompute=recompute)  # fmt: skip
    lowered = compiler.lower(planned.traced, planned.plan, tp_rank=rank, device=device, dump_dir=dump_dir)
    return CompiledRank(lowered.graph, lowered.plan, planned.trace_s, planned.plan_s, lowered.pass_s, lowered)


def parallelize(
    model: nn.Module,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    vpp: int = 1,
    example_inputs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | Path | dict | list | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    gather_outputs: bool = True,
    timeout_s: float = 300.0,
    compile: bool | str = False,
    cuda_graphs: bool = False,
    sequence_parallel: bool | str | None = None,
    tp_overlap: bool | str | None = None,
    checkpoint: str | Path | None = None,
    ep: int = 1,
    etp: int | None = None,
    moe_dispatch: str | None = None,
    moe_capacity_factor: float | None = None,
    fp8: str | bool | None = None,
    recompute: str | bool | list[int] | None = None,
) -> ParallelModel:
    """Compile ``model`` into this rank's ``ParallelModel``; tp·pp·dp must be the world size.

    Ranks are laid out in Megatron's order (tp fastest, then dp, then pp).
    ``example_inputs`` (keyword arguments of ``model.forward``) fix the first traced
    signature; HF models default to random ``input_ids`` of shape [2, 16]. ``plan`` is a
    ``ParallelPlan`` to follow (also as the path of its JSON, or a dict: ``pm.plan.to_json()``
    or ``autotp plan --format json``, whose first plan is taken; ``autotp.ir.plan_files``),
    whose degrees are used when tp, pp, dp and vpp are left at their defaults, or None /
    ``"auto"`` to let the cost model decide; ``vpp``
    model chunks per pipeline rank select the interleaved schedule. ``device`` defaults
    to the rank's CUDA device under NCCL, to the model's device in a single process without a
    process group, else the CPU. A collective that waits longer
    than ``timeout_s`` (a rank crashed or diverged) raises instead of hanging. With
    ``compile``, each per-rank graph (or pipeline chunk) also runs through
    ``torch.compile``, which fuses the elementwise work between the collectives (a string
    names the ``torch.compile`` backend: ``"aot_eager"`` runs the same AOT-autograd graphs
    with eager kernels, which tells inductor's numerics apart from the graphs'). With
    ``cuda_graphs`` (CUDA and NCCL), the regions that the cost model picks are captured
    as CUDA graphs on the first call and replayed after (``autotp.runtime.execution.cudagraphs``); with
    pp > 1, once per microbatch a stage holds in flight. Both together capture each region's
    compiled code. ``sequence_parallel`` runs the
    norms, residual adds and dropout between the tp regions on 1/tp of the tokens, and
    ``tp_overlap`` runs those all-gathers and reduce-scatters behind the GEMMs next to them
    (``passes/tp_overlap``: symmetric-memory fused ops on CUDA + NCCL, a P2P ring elsewhere).
    Either takes True or False (kept, also by ``plan="auto"``), ``"auto"`` (the cost model
    weighs both at the plan's degrees) or None (the plan's: off by default; with
    ``plan="auto"`` the planner weighs both with the degrees and records its choice).
    ``fp8`` runs the GEMMs of the decoder layers in FP8 (``passes/fp8_linear``): a recipe,
    ``"tensorwise"`` (True), ``"rowwise"``, ``"blockwise"`` (``autotp.ir.fp8``) or
    ``"tensorwise-delayed"`` (scales from earlier steps' amaxes, ``autotp.ir.fp8_delayed``;
    pp=1), with scales that tp ranks share; ``plan.fp8_linears`` says which GEMMs stay in the model's
    dtype and why. It needs FP8 tensor cores (compute capability 8.9+; blockwise 9.0).
    ``recompute`` recomputes decoder layers' activations in the backward instead of keeping
    them (``passes/recompute_layers``): ``"full"`` (True) every layer, a list of layer indices,
    ``"none"`` (False) none, None the plan's (a new plan: the layers the model checkpoints
    itself with ``torch.utils.checkpoint``; ``plan="auto"``: the planner's, where memory needs it).

    ``ep`` spreads the experts of MoE layers over ep ranks (MoE folding: expert layers run on
    ``etp-ep-edp-pp`` over the ranks dense layers use as ``tp-dp-pp``; ep divides tp*dp and
    each expert count; ``etp=1``). ``moe_dispatch`` picks how rows reach their experts:
    ``"dropless"`` (the default with ep > 1) or ``"sync_free"`` (static capacity
    ``moe_capacity_factor`` x balanced per expert, overflow dropped and counted by
    ``pm.moe_drop_counts()``, every shape static: the layer captures as one CUDA graph, also
    at ep=1).

    ``model`` may be built on ``meta``: each rank then allocates only its shards, reads
    them from ``checkpoint`` (a local HF safetensors folder, this rank's slices only) and
    initializes the rest with the model's own init (``autotp.runtime.state.init_meta`` says
    what that guarantees).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = load_plan(plan)
    if isinstance(plan, ParallelPlan) and (tp, pp, dp, vpp) == (1, 1, None, 1):
        tp, pp, dp, vpp = plan.tp, plan.pp, plan.dp, plan.vpp
    _check_degrees(tp, pp, vpp)
    if tp > world:
        raise UserInputError(
            f"tp={tp} is larger than the world size {world}; start {tp} processes (torchrun --nproc-per-node {tp} "
            f"or autotp run --tp {tp}) or lower tp"
        )
    if ep > world:
        raise UserInputError(f"ep={ep} is larger than the world size {world}: each ep rank holds 1/ep of the experts; "
                             f"start {ep} processes (torchrun --nproc-per-node {ep}) with dp*tp a multiple of {ep}, or lower ep")  # fmt: skip
    if dp is None:
        if world % (tp * pp):
            raise UserInputError(
                f"tp*pp = {tp}*{pp} = {tp * pp} does not divide the world size {world}, so no dp fits; "
                f"choose tp and pp whose product divides {world}"
            )
        dp = world // (tp * pp)
    if tp * pp * dp != world:
        raise UserInputError(
            f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not match the world size {world}; "
            f"choose degrees whose product is {world}"
        )
    if device is None:
        device = _default_device(model)
    device = torch.device(device)
    cuda_graphs = cuda_graphs or (isinstance(plan, ParallelPlan) and plan.cudagraphs)
    _check_fp8(device, fp8, plan, cuda_graphs)
    if cuda_graphs:
        _check_cuda_graphs(device)
    compile_backend = _compile_backend(compile)
    impl = cudagraphs.implementation() if cuda_graphs else None
    planned = compiler.plan_model(model, example_inputs, device, tp=tp, pp=pp, dp=dp, vpp=vpp, plan=plan,
                                  cudagraph_impl=impl, gather_outputs=gather_outputs,
                                  sequence_parallel=sequence_parallel, tp_overlap=tp_overlap, ep=ep, etp=etp,
                                  moe_dispatch=moe_dispatch, moe_capacity_factor=moe_capacity_factor, fp8=fp8,
                                  recompute=recompute, compiled=compile_backend == "inductor")  # fmt: skip
    coords = make_groups(planned.plan, timeout_s)
    refuse_different_models(model, planned.traced, planned.plan, compare_values=checkpoint is None)
    rng.seed_tp_rng(seed + 1009 * (coords.dp_rank + planned.plan.dp * coords.pp_rank), coords.tp_rank)
    backend = dist.get_backend() if dist.is_initialized() else "nccl"
    lowered = compiler.lower(planned.traced, planned.plan, tp_rank=coords.tp_rank, device=device, backend=backend,
                             ep_rank=coords.rank(Axis.EP))  # fmt: skip
    pm = ParallelModel(model, lowered, planned.kwargs, coords, device, compile_backend)
    pm.materialize(model, checkpoint, seed)
    return pm
