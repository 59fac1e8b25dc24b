"""Where a training step's GPU time goes, measured, beside the cost model's term for each part.

    python benchmarks/profile_cost_terms.py --workload llama-8bw-8l --microbatch-size 8 2 --json out.json   # on a GPU
    python benchmarks/profile_cost_terms.py --workload llama-8bw-8l --microbatch-size 8                    # CPU: the model only

For a held-out workload of ``bench_cost_model.VALIDATION`` on one GPU, the planner's plan of each asked
microbatch size runs as ``bench_cost_model --validate`` runs it (``parallelize(plan=...)``, ``train_step``,
foreach AdamW); one step after 3 warm-ups is profiled (``torch.profiler``, CUDA kernels) and each kernel's
GPU time goes to a term: ``optimizer`` (inside ``optimizer.step``), ``loss`` (inside the fused lm_head +
loss, ``autotp.ir.fused_loss``), ``attention`` and ``gemm`` (by kernel name), ``other`` (the memory-bound
rest). The model's terms are ``compute.node_times`` summed over the same plan's segments and layers, and
``dp_sync.optimizer_step_s``; both sides also list the memory-bound time per op (``other``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_cost_model import VALIDATION, build_model, model_config

ATTENTION_KERNELS = ("flash", "fmha", "sdpa", "attention", "attn")
GEMM_KERNELS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_")
RANGES = ("optimizer", "loss")


def planned(name: str, microbatch_sizes: list[int]) -> tuple[object, dict[int, object]]:
    """The traced costs and the planner's 1-GPU plan of each microbatch size (uncalibrated H100 profile)."""
    from autotp.compiler import trace_for_planning
    from autotp.cost_model.hardware import get_profile
    from autotp.cost_model.planner import Cluster, Training
    from autotp.cost_model.planner import plan as rank_plans

    dims, global_batch = VALIDATION[name]
    costs = trace_for_planning(model_config(dims), dims[6], dtype=torch.bfloat16)
    training = Training(global_batch, "bf16-pure", gather_outputs=True)
    plans = rank_plans(costs, Cluster(1, 1, get_profile("h100", calibrated=False)), training, top=8)
    return costs, {p.microbatch_size: p for p in plans if p.microbatch_size in microbatch_sizes}


def modelled(costs, planned_plan) -> dict[str, object]:
    """The cost model's GPU seconds per term for one step of ``planned_plan`` (module docstring)."""
    from autotp.cost_model.compute import _ATTENTION, _FUSED_LOSS, _MATMUL, node_times
    from autotp.cost_model.dp_sync import optimizer_step_s
    from autotp.cost_model.hardware import H100

    rank = costs.rank(1, gather_outputs=True)
    b, m = planned_plan.microbatch_size, planned_plan.microbatches
    terms: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    segments = [(rank.embedding, 1), (rank.head, 1), (rank.preamble, 1)]
    segments += [(rank.layers[costs.traced_index(i)], 1) for i in range(costs.num_layers)]
    names = _node_names(costs, rank)
    for seg, count in segments:
        forward, backward = node_times(seg, b, H100)
        both = (forward + np.where(seg.grad, backward, 0.0)) * count * m
        for kind, term in ((_MATMUL, "gemm"), (_ATTENTION, "attention"), (_FUSED_LOSS, "loss")):
            terms[term] += float(both[seg.kinds == kind].sum())
        other = ~np.isin(seg.kinds, (_MATMUL, _ATTENTION, _FUSED_LOSS))
        terms["other"] += float(both[other].sum())
        for name, t in zip(np.array(names[id(seg)])[other], both[other]):
            ops[name] += float(t)
    params = costs.total_params()
    terms["optimizer"] = optimizer_step_s(params, "bf16-pure", 1, H100)
    return {"terms": dict(terms), "other_ops": _top(ops, terms)}


def _node_names(costs, rank) -> dict[int, list[str]]:
    """The op name of each node of each of ``rank``'s segments, in their order."""
    from autotp.cost_model.compute import PREAMBLE
    from autotp.cost_model.graph_costs import build_report
    from autotp.ir.op_facts import op_name
    from autotp.passes.split_stages import repeatable

    gm = costs._compile_fn(rank.plan)
    report = build_report(gm, rank.plan, 0)
    repeated: set = set()
    for n in gm.graph.nodes:
        if repeatable(n, repeated):
            repeated.add(n)
    groups: dict = defaultdict(list)
    for r in report.nodes:
        if r.node.op == "call_function":
            groups[PREAMBLE if r.node in repeated else r.layer].append(op_name(r.node.target))
    keys = {id(rank.embedding): "embedding", id(rank.head): "head", id(rank.preamble): PREAMBLE}
    keys.update({id(seg): i for i, seg in enumerate(rank.layers)})
    return {seg_id: groups.get(key, []) for seg_id, key in keys.items()}


def _top(ops: dict[str, float], terms: dict[str, float], count: int = 20) -> list[tuple[str, float]]:
    return sorted(((k, v) for k, v in ops.items() if v > 1e-3 * sum(terms.values())), key=lambda kv: -kv[1])[:count]


def measured(name: str, planned_plan) -> dict[str, object]:
    """One profiled step of ``planned_plan`` on the GPU: seconds per term, memory-bound seconds per op, wall time."""
    from torch.profiler import ProfilerActivity, profile, record_function
    import autotp
    from autotp.ir import fused_loss

    dims, global_batch = VALIDATION[name]
    device = torch.device("cuda")
    model = build_model(dims, device, torch.bfloat16)
    ids = torch.randint(0, dims[5], (global_batch, dims[6]), generator=torch.Generator().manual_seed(0)).to(device)
    micro = ids[: planned_plan.microbatch_size]
    pm = autotp.parallelize(model, plan=planned_plan.plan, example_inputs={"input_ids": micro, "labels": micro})
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-5, foreach=True)
    original = fused_loss._LinearCrossEntropy.forward

    def loss_forward(*args, **kwargs):
        with record_function("loss"):
            return original(*args, **kwargs)

    def step(pm: Any, optimizer: torch.optim.Optimizer) -> None:
        pm.train_step(input_ids=ids, labels=ids)
        with record_function("optimizer"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    walls = []
    for i in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(pm, optimizer)
        torch.cuda.synchronize()
        if i >= 3:
            walls.append(time.perf_counter() - start)
    fused_loss._LinearCrossEntropy.forward = staticmethod(loss_forward)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(pm, optimizer)
            torch.cuda.synchronize()
    finally:
        fused_loss._LinearCrossEntropy.forward = staticmethod(original)
    terms: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    events = prof.events()
    annotations = {e.name for e in events if e.is_user_annotation}  # their GPU-side spans are listed as kernels too
    for event in events:
        for kernel in (k for k in event.kernels if k.name not in annotations):
            term = _term(event, kernel.name)
            terms[term] += kernel.duration / 1e6
            if term == "other":
                ops[event.name] += kernel.duration / 1e6
    del pm, optimizer, model
    torch.cuda.empty_cache()
    return {"wall_s": statistics.median(walls), "terms": dict(terms), "other_ops": _top(ops, terms)}


def _term(event, kernel: str) -> str:
    parent = event
    while parent is not None:
        if parent.name in RANGES:
            return parent.name
        parent = parent.cpu_parent
    lower = kernel.lower()
    if any(k in lower for k in ATTENTION_KERNELS):
        return "attention"
    return "gemm" if any(k in lower for k in GEMM_KERNELS) else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(VALIDATION), required=True)
    parser.add_argument("--microbatch-size", type=int, nargs="+", required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    costs, plans = planned(args.workload, args.microbatch_size)
    out: dict[str, object] = {"workload": args.workload, "setup": f"torch {torch.__version__}"}
    for b, p in sorted(plans.items(), reverse=True):
        row: dict[str, object] = {"microbatch_size": b, "microbatches": p.microbatches, "predicted_step_s": p.step_s,
                                  "model": modelled(costs, p)}  # fmt: skip
        if torch.cuda.is_available():
            with contextlib.suppress(torch.cuda.OutOfMemoryError):
                row["gpu"] = measured(args.workload, p)
        out[f"mbs{b}"] = row
        print(_table(row), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))


def _table(row: dict) -> str:
    model, gpu = row["model"], row.get("gpu", {"terms": {}, "other_ops": []})
    lines = [f"mbs {row['microbatch_size']} x {row['microbatches']}: predicted step {row['predicted_step_s'] * 1e3:.1f} ms"
             + (f", measured wall {gpu['wall_s'] * 1e3:.1f} ms" if "wall_s" in gpu else "")]
    for term in ("gemm", "attention", "other", "loss", "optimizer"):
        m, g = model["terms"].get(term, 0.0), gpu["terms"].get(term, float("nan"))
        lines.append(f"  {term:10s} model {m * 1e3:8.2f} ms   GPU {g * 1e3:8.2f} ms   model/GPU {m / g if g else float('nan'):6.3f}")
    lines.append("  model, memory-bound per op (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in model["other_ops"]))
    if gpu["other_ops"]:
        lines.append("  GPU, memory-bound per op (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in gpu["other_ops"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
