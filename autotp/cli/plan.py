"""``autotp plan``: rank tp/pp/dp/vpp/microbatch plans of a model on a cluster."""

from __future__ import annotations

import argparse
import json
import math
import time

from autotp import presets
from autotp.cost_model.memory import PRECISIONS
from autotp.ir.errors import UserInputError


def _plan_command(args: argparse.Namespace) -> int:
    from autotp.compiler import trace_for_planning
    from autotp.cost_model import closed_forms
    from autotp.cost_model.hardware import get_profile
    from autotp.cost_model.planner import Cluster, Training, explain_values, format_table, search

    hw = get_profile(args.hardware)
    for name in ("gpus", "gpus_per_node", "global_batch", "seq", "top"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    start = time.perf_counter()
    config = presets.model_config(args.model)
    costs = trace_for_planning(config, args.seq)
    cluster = Cluster(args.gpus, args.gpus_per_node, hw)
    training = Training(args.global_batch, args.precision, args.distributed_optimizer)
    found = search(costs, cluster, training, tp=args.tp, pp=args.pp, top=args.top)
    estimates = found.plans
    elapsed = time.perf_counter() - start
    if args.format == "json":
        print(json.dumps([e.to_json() for e in estimates], indent=1))
        return 0
    nodes = math.ceil(args.gpus / args.gpus_per_node)
    optimizer = ", distributed optimizer" if args.distributed_optimizer else ""
    print(
        f"{args.model} on {args.gpus} x {hw.name} ({nodes} node{'s' * (nodes > 1)} of {min(args.gpus, args.gpus_per_node)}), "
        f"global batch {args.global_batch} x {args.seq} tokens, {args.precision}{optimizer}; planned in {elapsed:.2f} s"
    )
    print(format_table(estimates))
    fitting = found.candidates - found.over_memory - found.refused_candidates
    print(f"{len(estimates)} of {fitting} plans that fit shown (--top {args.top}); {found.dropped_summary(hw.usable_memory_bytes)}")
    if args.explain:
        text = config.get_text_config()
        values = explain_values(costs, estimates[0], text.hidden_size, text.num_attention_heads)
        print(f"\nclosed forms (values for plan #1, {hw.name}: alpha = {hw.collective_latency_s * 1e6:.0f} us, "
              f"B = {hw.allreduce_bus_bytes_per_s / 1e9:.0f} GB/s):")
        print(closed_forms.explain({**values, closed_forms.alpha: hw.collective_latency_s, closed_forms.B: hw.allreduce_bus_bytes_per_s}))
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
    command.add_argument("--hardware", default="h100", help="a profile name (h200, h100, a100, pcie, cpu) or a JSON profile from autotp calibrate (default: h100)")
    command.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    command.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    command.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16", help="params/grads/optimizer precision (default: bf16)")
    command.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer states over dp (ZeRO-1)")
    command.add_argument("--tp", type=int, help="keep this tensor-parallel degree")
    command.add_argument("--pp", type=int, help="keep this pipeline-parallel degree")
    command.add_argument("--top", type=int, default=10, help="plans to show (default: 10)")
    command.add_argument("--format", choices=("table", "json"), default="table", help="default: table")
    command.add_argument("--explain", action="store_true", help="also print the closed forms with the top plan's numbers")
    command.set_defaults(handler=_plan_command)
