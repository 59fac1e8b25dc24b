"""``autotp plan``: rank tp/pp/dp/vpp/microbatch plans of a model on a cluster."""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from typing import TYPE_CHECKING

from autotp import presets
from autotp.cli.progress import progress
from autotp.cost_model.memory import PRECISIONS
from autotp.ir.errors import UserInputError

if TYPE_CHECKING:
    from autotp.cost_model.compute import ModelCosts
    from autotp.cost_model.planner import PlanEstimate


def format_table(estimates: list[PlanEstimate], moe: bool = False) -> str:
    """The ranked plans, one row each; ``dist-opt``: the distributed optimizer is used, and needed to fit;
    ``host``: the share of the step the GPU waits for the host (host-bound plans: small microbatches; how long
    depends on this machine's host, which ``autotp calibrate`` measures); ``SP``: sequence parallelism;
    ``overlap``: the tp collectives run behind GEMMs (``ag`` all-gathers,
    ``rs`` reduce-scatters); ``-`` at tp=1; ``ep``: expert-parallel degree of the MoE layers (``sf``:
    sync-free dispatch; 1: tensor-parallel experts, etp = tp), ``etp`` the experts' tensor-parallel degree
    (both only for a model with MoE layers, ``moe``); ``recomp``: every decoder layer recomputes its
    activations in the backward (``all``), chosen where the plan does not fit without."""
    from autotp.cost_model.hardware import GiB

    header = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>5} {'vpp':>3} {'mbs':>4} {'m':>5} {'step s':>9} {'tokens/s':>10} "
              f"{'MFU':>6} {'GiB/GPU':>8} {'bubble':>7} {'comm':>6} {'host':>6} {'dist-opt':>8} {'SP':>3} {'overlap':>7} {'recomp':>6}" + (f" {'ep':>5} {'etp':>3}" if moe else ""))
    rows = [header]
    for i, e in enumerate(estimates, start=1):
        p = e.plan
        rows.append(
            f"{i:>3} {p.tp:>3} {p.pp:>3} {p.dp:>5} {p.vpp:>3} {e.microbatch_size:>4} {e.microbatches:>5} {e.step_s:>9.4g} "
            f"{e.tokens_per_s:>10.4g} {e.mfu:>6.1%} {e.mem_bytes_per_gpu / GiB:>8.1f} {e.bubble_share:>7.1%} {e.comm_share:>6.1%} {e.host_share:>6.1%} "
            f"{('needed' if e.needs_distributed_optimizer else 'yes') if p.distributed_optimizer else 'no':>8} "
            f"{'-' if p.tp == 1 else 'on' if p.sequence_parallel else 'off':>3} {_overlap_cell(p):>7} {'all' if p.recompute_layers else 'no':>6}"
            + (f" {str(p.ep) + ('sf' if p.moe_dispatch == 'sync_free' else ''):>5} {p.etp or p.tp:>3}" if moe else "")
        )
    return "\n".join(rows)


def _overlap_cell(p) -> str:
    from autotp.ir.op_facts import Collective  # imports torch: not at module level (``--help`` stays fast)

    if p.tp == 1 or not p.sequence_parallel:
        return "-"
    short = {Collective.ALL_GATHER: "ag", Collective.REDUCE_SCATTER: "rs"}
    return "+".join(short[k] for k in p.tp_overlap) or "no"


def explain_values(costs: ModelCosts, best: PlanEstimate, hidden: int, heads: int) -> dict:
    """Numbers for ``closed_forms``: the model's and the top plan's (n: one tp all-reduce, b·s·h bf16)."""
    from autotp.cost_model import closed_forms as cf

    p = best.plan
    return {
        cf.b: best.microbatch_size, cf.s: costs.seq, cf.h: hidden, cf.a: heads, cf.e: 2, cf.t: p.tp, cf.p: p.pp,
        cf.v: p.vpp, cf.m: best.microbatches, cf.d: p.dp, cf.r: 0, cf.Psi: costs.total_params(),
        cf.n: best.microbatch_size * costs.seq * hidden * 2,
    }  # fmt: skip


def _plan_command(args: argparse.Namespace) -> int:
    from autotp.compiler import trace_for_planning
    from autotp.cost_model import closed_forms
    from autotp.cost_model.hardware import get_profile
    from autotp.cost_model.planner import Cluster, Training, search
    from autotp.ir.training_step import TrainingStep

    hw = get_profile(args.hardware, calibrated=not args.builtin_profile)
    for name in ("gpus", "gpus_per_node", "global_batch", "seq", "top"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    config = presets.model_config(args.model)
    presets.model_class(config)  # its import is not planning: "planned in" counts from here
    gc.freeze()  # a full collection would walk every object torch and transformers made at import, for nothing
    start = time.perf_counter()
    progress(f"tracing one decoder layer of {args.model} at seq {args.seq}")
    costs = trace_for_planning(config, args.seq)
    cluster = Cluster(args.gpus, args.gpus_per_node, hw)
    choice = {"auto": None, "on": True, "off": False}
    training = Training(args.global_batch, args.precision, choice[args.distributed_optimizer],
                        overlap_param_gather=not args.no_overlap_param_gather,
                        sequence_parallel=choice[args.sequence_parallel], tp_overlap=choice[args.tp_overlap],
                        recompute=choice[args.recompute], compiled=args.compile)  # fmt: skip
    found = search(costs, cluster, training, tp=args.tp, pp=args.pp, top=args.top, progress=progress)
    estimates = found.plans
    elapsed = time.perf_counter() - start
    if args.format == "json":
        print(json.dumps([e.to_json() for e in estimates], indent=1))
        return 0
    nodes = math.ceil(args.gpus / args.gpus_per_node)
    print(
        f"{args.model} on {args.gpus} x {hw.name} ({nodes} node{'s' * (nodes > 1)} of {min(args.gpus, args.gpus_per_node)}), "
        f"global batch {args.global_batch} x {args.seq} tokens, distributed optimizer {args.distributed_optimizer}, "
        f"sequence parallelism {args.sequence_parallel}, tp overlap {args.tp_overlap}; "
        f"planned in {elapsed:.2f} s"
    )
    from autotp.cost_model.moe_costs import moe_facts

    print(format_table(estimates, moe=moe_facts(costs) is not None))
    fitting = found.candidates - found.over_memory - found.refused_candidates
    print(f"{len(estimates)} of {fitting} plans that fit shown (--top {args.top}); {found.dropped_summary(hw.usable_memory_bytes)}")
    for used in sorted({e.plan.distributed_optimizer for e in estimates}, reverse=True):
        print(f"training step{' (dist-opt yes/needed)' if used else ' (dist-opt no)'}: {TrainingStep(args.precision, used).describe()}")
        if used:
            print("  dist-opt sync: reduce-scatter overlapped with the backward; parameter all-gather "
                  + ("overlapped with the next forward (only its first bucket exposed)" if training.overlap_param_gather
                     else "exposed before the next forward (--no-overlap-param-gather)"))
    for i, e in enumerate(estimates[:3], start=1):
        if e.plan.moe_estimate is not None:
            print(f"plan {i} expert parallelism {e.plan.moe_estimate.describe()}")
    needed = [str(i) for i, e in enumerate(estimates, start=1) if e.needs_distributed_optimizer]
    if needed:
        print(f"plans {', '.join(needed)} fit only with the distributed optimizer: train them with autotp.DistributedOptimizer")
    if args.explain:
        text = config.get_text_config()
        values = explain_values(costs, estimates[0], text.hidden_size, text.num_attention_heads)
        print(f"\nclosed forms (values for plan #1, {hw.name}: alpha = {hw.collective_latency_s * 1e6:.0f} us, "
              f"B = {hw.allreduce_bus_bytes_per_s / 1e9:.0f} GB/s):")
        best = estimates[0]
        forms = closed_forms.forms_for(best.schedule or best.plan.schedule_name, args.precision)
        print(closed_forms.explain({**values, closed_forms.alpha: hw.collective_latency_s, closed_forms.B: hw.allreduce_bus_bytes_per_s}, forms))
        print(f"the table's bubble column ({best.bubble_share:.1%} for plan #1) is the modelled idle time over the whole "
              "predicted step, which also counts communication, the optimizer and unequal stages; the closed forms "
              "assume equal stages and compute only")
        print(f"\nhardware: {hw.source}")
    return 0


def add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``plan``; its handler (``args.handler``) prints the ranked plans and returns 0."""
    command = subparsers.add_parser(
        "plan",
        help="rank tp/pp/dp/vpp/microbatch plans by predicted step time and memory",
        description="Trace one decoder layer of MODEL on the meta device, estimate every tp/pp/dp/vpp/microbatch "
        "split of the cluster with the cost model (autotp.cost_model), drop those that do not fit in memory "
        "and print the fastest. Times include the optimizer step.",
    )
    command.add_argument("model", metavar="MODEL", help=f"a preset ({', '.join(presets.preset_names())}) or a folder holding config.json")
    command.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    command.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    command.add_argument("--hardware", default="h100", help="a profile name (h200, h100, a100, pcie, cpu) or a JSON profile from autotp calibrate; a name uses this machine's cached calibration of that GPU kind if there is one (default: h100)")
    command.add_argument(
        "--builtin-profile", action="store_true", help="use the built-in profile even where autotp calibrate cached one for this GPU kind here"
    )
    command.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    command.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    command.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16-fp32-grads",
                         help="params/grads/optimizer precision (autotp.ir.training_step; default: bf16-fp32-grads, "
                         "bf16 params with fp32 main grads and master weights, what autotp.DistributedOptimizer runs on bf16)")
    command.add_argument("--distributed-optimizer", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                         help="shard optimizer states over dp (ZeRO-1, autotp.DistributedOptimizer): on, off, or auto "
                         "(default: per plan, whichever is faster and fits)")
    command.add_argument("--sequence-parallel", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                         help="run the norms, residual adds and dropout between the tp regions on 1/tp of the tokens "
                         "(Megatron SP): on, off, or auto (default: per plan with tp > 1, whichever is faster and fits)")
    command.add_argument("--tp-overlap", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                         help="with sequence parallelism, run its all-gathers and reduce-scatters behind the GEMMs next "
                         "to them: on (needs sequence parallelism), off, or auto (default: per plan)")
    command.add_argument("--recompute", nargs="?", const="on", default="off", choices=("auto", "on", "off"),
                         help="recompute every decoder layer's activations in the backward: on, off (default), or auto "
                         "(per plan, where it makes the plan fit)")
    command.add_argument("--no-overlap-param-gather", action="store_true",
                         help="charge the distributed optimizer's parameter all-gather as exposed, as "
                         "DistributedOptimizer(overlap_param_gather=False) runs it (default: hidden behind the next forward)")
    command.add_argument("--compile", action="store_true",
                         help="price the ranks as parallelize(compile=True) runs them: inductor's fused kernels (default: eager)")
    command.add_argument("--tp", type=int, help="keep this tensor-parallel degree")
    command.add_argument("--pp", type=int, help="keep this pipeline-parallel degree")
    command.add_argument("--top", type=int, default=10, help="plans to show (default: 10)")
    command.add_argument("--format", choices=("table", "json"), default="table", help="default: table")
    command.add_argument("--explain", action="store_true", help="also print the closed forms with the top plan's numbers")
    command.set_defaults(handler=_plan_command)
