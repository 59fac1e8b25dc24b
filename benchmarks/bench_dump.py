"""Wall time of ``autotp dump llama3-8b --tp 8 --rank 0 --format svg``, against compile_rank alone.

    python benchmarks/bench_dump.py [--json PATH]

Runs the command as a user would (a fresh process: imports, build on meta, compile,
annotate, DOT, Graphviz), then, in this process, the same steps one by one. The
same-run baseline is ``compile_rank`` alone on the same model and inputs (bf16,
input_ids and labels [1, 2048]); the ratio shows what dumping adds to compiling.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from autotp import compile_rank, presets
from autotp.report import dump
from autotp.cost_model.graph_costs import build_report

TARGET_S = 20.0
MODEL, TP, SEQ = "llama3-8b", 8, 2048
COMMAND = ["-m", "autotp", "dump", MODEL, "--tp", str(TP), "--rank", "0", "--format", "svg"]


def measure() -> dict[str, object]:
    if shutil.which("dot") is None:
        raise SystemExit("this benchmark renders SVG: install Graphviz (apt-get install graphviz)")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, *COMMAND, "--out", tmp], check=True, capture_output=True)
        command_s = time.perf_counter() - start

        # One small compile first, so the in-process steps do not pay torch's one-time warm-up.
        tiny = presets.build_model("llama-tiny")
        compile_rank(tiny, tp=2, example_inputs={"input_ids": torch.zeros(1, 16, dtype=torch.long)})

        start = time.perf_counter()
        model = presets.build_model(MODEL, dtype=torch.bfloat16)
        built = time.perf_counter()
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        compiled = compile_rank(model, tp=TP, rank=0, example_inputs={"input_ids": ids, "labels": ids})
        compiled_at = time.perf_counter()
        report = build_report(compiled.graph, compiled.plan, 0)
        reported = time.perf_counter()
        dump.write(report, MODEL, "svg", Path(tmp), "bench")
        written = time.perf_counter()
    compile_s = compiled_at - built
    return {
        "model": MODEL,
        "tp": TP,
        "seq": SEQ,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "command_s": command_s,
        "target_s": TARGET_S,
        "build_s": built - start,
        "compile_rank_s": compile_s,
        "report_s": reported - compiled_at,
        "dot_and_svg_s": written - reported,
        "command_over_compile_rank": command_s / compile_s,
    }


def report_text(result: dict[str, object]) -> str:
    return "\n".join(
        [
            f"autotp dump {MODEL} --tp {TP} --rank 0 --format svg (input_ids and labels [1, {SEQ}], bf16, meta)",
            f"  command, fresh process     {result['command_s']:7.2f} s  (target {TARGET_S:.0f} s)",
            "  in this process:",
            f"    build model on meta      {result['build_s']:7.2f} s",
            f"    compile_rank (baseline)  {result['compile_rank_s']:7.2f} s",
            f"    annotate (build_report)  {result['report_s']:7.2f} s",
            f"    DOT + Graphviz SVG       {result['dot_and_svg_s']:7.2f} s",
            f"command / compile_rank = {result['command_over_compile_rank']:.2f}x",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    result = measure()
    print(report_text(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
