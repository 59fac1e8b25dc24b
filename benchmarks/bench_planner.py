"""Planner speed: a Llama-3-70B-shaped model on 1024 GPUs, 8 per node (target: under 1 s).

    python benchmarks/bench_planner.py [--json out.json]

Times, in this process: the trace (one decoder layer on the meta device; the first
torch.export of a process pays its warm-up), the per-tp analysis (plan, passes and
report of one rank per tp degree), and the estimates of every candidate (one analytic
estimate each, no tracing); then a second, warm planning of the same model. Importing
torch and transformers is not counted. Besides wall-clock times it prints the process's CPU
time of trace + analysis + plan, which a loaded machine does not inflate.
"""

from __future__ import annotations

import argparse
import json
import time

from autotp.cost_model.hardware import H100
from autotp.cost_model.planner import (
    Cluster,
    Training,
    best_estimate,
    candidates,
    plan,
)
from autotp.cli.plan import format_table
from autotp.compiler import trace_for_planning

from autotp import presets

MODEL, GPUS, PER_NODE, GLOBAL_BATCH, SEQ = "llama3-70b", 1024, 8, 1024, 4096


def _plan_once() -> dict[str, float]:
    cpu = time.process_time()
    start = time.perf_counter()
    costs = trace_for_planning(presets.model_config(MODEL), SEQ)
    traced = time.perf_counter()
    cluster, training = Cluster(GPUS, PER_NODE, H100), Training(GLOBAL_BATCH)
    configs = candidates(costs.num_layers, cluster, GLOBAL_BATCH)
    for tp in sorted({c.tp for c in configs}):
        costs.rank(tp, frozenset(), training.gather_outputs)
    analysed = time.perf_counter()
    cpu_analysed = time.process_time()
    for config in configs:
        best_estimate(costs, cluster, training, config)
    estimated = time.perf_counter()
    cpu_timing_loop = time.process_time()
    best = plan(costs, cluster, training, top=5)
    done = time.perf_counter()
    cpu_done = time.process_time()
    print(format_table(best))
    return {
        "trace_s": traced - start,
        "analysis_s": analysed - traced,
        "candidates": len(configs),
        "estimate_per_candidate_s": (estimated - analysed) / len(configs),
        "plan_s": done - estimated,
        "total_s": (traced - start) + (analysed - traced) + (done - estimated),  # the timing loop above is not counted
        "total_cpu_s": (cpu_analysed - cpu) + (cpu_done - cpu_timing_loop),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    runs = {"cold": _plan_once(), "warm": _plan_once()}
    print(f"{MODEL} on {GPUS} x H100 ({PER_NODE} per node), global batch {GLOBAL_BATCH} x {SEQ}")
    for name, r in runs.items():
        print(
            f"{name}: trace {r['trace_s']:.2f} s, per-tp analysis {r['analysis_s']:.2f} s, {r['candidates']} candidates "
            f"at {r['estimate_per_candidate_s'] * 1e3:.2f} ms each; plan() (estimates, ranking, top plans) {r['plan_s']:.2f} s; "
            f"total {r['total_s']:.2f} s ({r['total_cpu_s']:.2f} s of CPU time)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
