"""Planner speed: what ``autotp plan`` does for a Llama-3-70B on 1024 H100s, 8 per node (target: under 1 s).

    python benchmarks/bench_planner.py [--runs 5] [--json out.json]

    autotp plan llama3-70b --gpus 1024 --gpus-per-node 8 --hardware h100 --global-batch 1024 --seq 4096

Each run is a fresh process that plans as the command does. Its imports (torch, transformers, the
model's modeling code, autotp) are timed apart and not counted; then, as the command, it freezes the
objects made so far out of the garbage collector's reach (``gc.freeze``) and times the planning: the
trace (one decoder layer on the meta device; a process's first ``torch.export`` pays its warm-up) and
``search`` (every tp's rank graphs, compiled once per sequence-parallel and overlap variant, then the
estimates of every candidate and the top plans). The same planning then runs again in that process
(warm: the causal-mask verdict and the schedules' moments are cached, the rest is traced and compiled
again). Prints the min and median over the runs of wall-clock and CPU time; CPU time is what a
machine shared with other jobs inflates least.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

MODEL, GPUS, PER_NODE, GLOBAL_BATCH, SEQ = "llama3-70b", 1024, 8, 1024, 4096


def _once() -> dict[str, float]:
    """One process's timings (imports, then a cold and a warm planning)."""
    start = time.perf_counter()
    import torch  # noqa: F401

    from autotp import presets
    from autotp.cli.plan import format_table
    from autotp.compiler import trace_for_planning
    from autotp.cost_model.hardware import H100
    from autotp.cost_model.planner import Cluster, Training, search

    config = presets.model_config(MODEL)
    presets.model_class(config)
    imported = time.perf_counter() - start
    gc.freeze()
    cluster = Cluster(GPUS, PER_NODE, H100)
    training = Training(GLOBAL_BATCH, "bf16-fp32-grads", distributed_optimizer=None)  # the command's defaults
    out: dict[str, float] = {"imports_s": imported}
    for name in ("cold", "warm"):
        wall, cpu = time.perf_counter(), time.process_time()
        costs = trace_for_planning(config, SEQ)
        traced = time.perf_counter()
        found = search(costs, cluster, training, top=10)
        done, cpu_done = time.perf_counter(), time.process_time()
        out |= {f"{name}_trace_s": traced - wall, f"{name}_search_s": done - traced, f"{name}_s": done - wall,
                f"{name}_cpu_s": cpu_done - cpu}  # fmt: skip
    out["candidates"] = found.candidates
    print(format_table(found.plans[:3]), file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes to time (default: 5)")
    parser.add_argument("--json", help="write every run's timings here")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(_once()))
        return
    runs = []
    for i in range(args.runs):
        done = subprocess.run([sys.executable, __file__, "--once"], check=True, capture_output=True, text=True)
        if i == 0:
            print(done.stderr.strip())
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    print(f"{MODEL} on {GPUS} x H100 ({PER_NODE} per node), global batch {GLOBAL_BATCH} x {SEQ}, "
          f"{runs[0]['candidates']:.0f} candidates; {len(runs)} fresh processes, min / median:")  # fmt: skip
    for key, label in (("imports_s", "imports (not counted)"), ("cold_trace_s", "trace"), ("cold_search_s", "search"),
                       ("cold_s", "planning"), ("cold_cpu_s", "planning, CPU time"), ("warm_s", "planning again, warm"),
                       ("warm_cpu_s", "planning again, CPU time")):  # fmt: skip
        values = [r[key] for r in runs]
        print(f"  {label:<26} {min(values):6.3f} / {statistics.median(values):6.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
