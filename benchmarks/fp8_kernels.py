"""What inductor makes of one FP8 decoder layer: graph nodes, kernels and bytes, against bf16.

    python benchmarks/fp8_kernels.py [--recipes bf16,tensorwise,rowwise] [--hidden 256] [--layers 1]

Builds a Llama of ``--layers`` decoder layers (bf16 weights, batch 2 × ``--seq`` tokens),
``parallelize(tp=1, compile=True, fp8=recipe)``, runs one ``train_step`` and reads inductor's
debug trace of the forward and backward graphs it compiled:

* ``nodes``: aten nodes of the graph inductor lowers (after its post-grad passes);
* ``kernels``: the kernels inductor generated (Triton on a GPU, C++ on the CPU; one C++ kernel
  may hold several loops, one Triton kernel one pass over its data), and ``extern`` the calls
  into library kernels (GEMMs, ``_scaled_mm``, attention);
* ``GiB``: inductor's estimate of the bytes its kernels read and write (``graph.count_bytes``);
* ``fused casts``: kernels that compute an FP8 cast (``convert`` to float8) together with the
  op that produces its input (a norm, the SwiGLU product, a residual gradient), by the names
  inductor gives its fused kernels;
* ``compile_s``: the first two steps (dynamo, AOT autograd, inductor, kernel compile; a
  delayed recipe's first step runs eagerly, its second compiles).

The embedding, ``lm_head`` and the loss are in the counts of every row alike.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

KERNEL = re.compile(r"^(\w+) = async_compile\.(?:triton|cpp_pybinding|cpp)\(", re.M)
PRODUCERS = ("mean", "rsqrt", "silu", "add", "sum", "mul")


def llama(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


def graph_counts(trace_dir: Path) -> dict[str, dict[str, object]]:
    """Per compiled graph (forward, backward) of a debug trace: nodes, kernels, extern calls, fused casts."""
    out: dict[str, dict[str, object]] = {}
    for code in sorted(trace_dir.rglob("output_code.py")):
        graph = code.parent
        phase = "backward" if "backward" in graph.name else "forward"
        nodes = (graph / "fx_graph_transformed.py").read_text().count(" = torch.ops.")
        src = code.read_text()
        kernels = KERNEL.findall(src)
        casts = [k for k in kernels if "_to_copy" in k and "clamp" in k]
        fused = [k for k in casts if any(f"_{p}_" in k or k.endswith(f"_{p}") for p in PRODUCERS)]
        out[phase] = {"nodes": nodes, "kernels": len(kernels), "extern": src.count("extern_kernels."),
                      "cast kernels": len(casts), "fused casts": len(fused), "names": kernels}  # fmt: skip
    return out


def measure(recipe: str, hidden: int, layers: int, seq: int) -> dict[str, object]:
    import autotp
    from torch._inductor import metrics

    model = llama(hidden, layers)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        metrics.reset()
        torch._inductor.config.force_disable_caches = True  # a cached graph leaves no trace (and no compile time)
        torch._inductor.config.trace.enabled = True
        torch._inductor.config.trace.debug_dir = tmp
        torch._logging.set_logs(inductor_metrics=True)  # makes inductor count its bytes
        pm = autotp.parallelize(model, example_inputs={"input_ids": ids, "labels": ids}, compile=True,
                                fp8=None if recipe == "bf16" else recipe, gather_outputs=False)  # fmt: skip
        start = time.perf_counter()
        for _ in range(2):  # a delayed recipe's first step seeds its histories eagerly; the second compiles
            pm.train_step(input_ids=ids, labels=ids)
        compile_s = time.perf_counter() - start
        counts = graph_counts(Path(tmp))
    torch._inductor.config.trace.enabled = False
    return {"recipe": recipe, "compile_s": compile_s, "GiB": metrics.num_bytes_accessed / 2**30, **counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="bf16,tensorwise,rowwise,blockwise")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--names", action="store_true", help="also print every kernel's name")
    args = parser.parse_args()
    logging.getLogger("torch._inductor").setLevel(logging.WARNING)
    print(f"{'recipe':11s} {'phase':9s} {'nodes':>6s} {'kernels':>8s} {'extern':>7s} {'casts':>6s} {'fused':>6s}   GiB   compile_s")
    for recipe in args.recipes.split(","):
        row = measure(recipe, args.hidden, args.layers, args.seq)
        for phase in ("forward", "backward"):
            c = row.get(phase, {})
            print(f"{recipe:11s} {phase:9s} {c.get('nodes', 0):>6} {c.get('kernels', 0):>8} {c.get('extern', 0):>7} "
                  f"{c.get('cast kernels', 0):>6} {c.get('fused casts', 0):>6}", end="")  # fmt: skip
            print(f"  {row['GiB']:.4f}  {row['compile_s']:.1f}" if phase == "forward" else "")
            if args.names:
                for name in c.get("names", []):
                    print("     ", name)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
