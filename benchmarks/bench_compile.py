"""Compile time of one tensor-parallel rank of Llama-3-8B, against plain torch.export.

    python benchmarks/bench_compile.py [--json PATH]

Builds ``llama3-8b`` (32 layers) on the meta device, so nothing is allocated, and times
``compile_rank(tp=8, rank=0)`` on input_ids of shape [1, 2048]: export (trace), plan and
each pass. As a same-run baseline it times plain non-strict ``torch.export.export`` of the
same model and input; the ratio shows autotp's overhead over export alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from autotp import compile_rank, presets

TARGET_S = 15.0
MODEL, TP, SEQ = "llama3-8b", 8, 2048


def _export_s(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.export.export(model, (), {"input_ids": input_ids, "use_cache": False}, strict=False)
    return time.perf_counter() - start


def measure() -> dict[str, object]:
    # One small export first, so neither measurement pays torch's one-time warm-up.
    tiny = presets.build_model("llama-tiny")
    _export_s(tiny, torch.zeros(1, 16, dtype=torch.long, device="meta"))

    model = presets.build_model(MODEL)
    baseline = _export_s(model, torch.zeros(1, SEQ, dtype=torch.long, device="meta"))
    compiled = compile_rank(model, tp=TP, rank=0, example_inputs={"input_ids": torch.zeros(1, SEQ, dtype=torch.long)})
    total = compiled.trace_s + compiled.plan_s + sum(compiled.pass_s.values())
    return {
        "model": MODEL,
        "tp": TP,
        "seq": SEQ,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "export_s": compiled.trace_s,
        "plan_s": compiled.plan_s,
        "pass_s": compiled.pass_s,
        "total_s": total,
        "target_s": TARGET_S,
        "total_over_target": total / TARGET_S,
        "plain_export_s": baseline,
        "total_over_plain_export": total / baseline,
    }


def report(result: dict[str, object]) -> str:
    passes: dict[str, float] = result["pass_s"]  # type: ignore[assignment]
    rows = [("export (trace)", result["export_s"]), ("plan", result["plan_s"])]
    rows += [(f"pass {name}", seconds) for name, seconds in passes.items()]
    width = max(len(name) for name, _ in rows)
    lines = [f"compile_rank({result['model']}, tp={result['tp']}, rank=0), input_ids [1, {result['seq']}], meta device"]
    lines += [f"  {name:<{width}}  {seconds:8.3f} s" for name, seconds in rows]
    lines += [
        f"  {'total':<{width}}  {result['total_s']:8.3f} s  ({result['total_over_target']:.2f}x the {TARGET_S:.0f} s target)",
        f"baseline: plain torch.export.export (non-strict) {result['plain_export_s']:.3f} s; "
        f"compile_rank total is {result['total_over_plain_export']:.2f}x that",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    result = measure()
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
