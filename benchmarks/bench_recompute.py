"""One GPU: activation recomputation (``parallelize(recompute=...)``) against none, with the cost
model's prediction of both, and the user's own baseline in the same process: HF +
``torch.compile`` with SDPA ``is_causal`` (``bench_single_gpu``'s strongest setup), without and
with HF's ``gradient_checkpointing_enable()`` (``--hf-batches``).

For each microbatch size b and each policy (``none``, ``full``: every decoder layer recomputed)
it builds the model (bf16, seeded), runs ``parallelize(tp=1, recompute=policy)`` and times
``STEPS`` training steps (``train_step`` + a foreach AdamW step on bf16 parameters: the
``bf16-pure`` training step the cost model prices) after ``WARMUP``. It records the median
step time, the peak memory (``max_memory_allocated`` over the steps), the loss, whether the
step ran out of memory, and the planner's ``estimate`` of the same configuration (step time and
peak bytes per GPU, built-in profile of the GPU, not calibrated), written to ``--json`` after
every row::

    python benchmarks/bench_recompute.py --layers 8 --batches 2 4 8 --compile-batches 4 --hf-batches 4 --json out.json
    python benchmarks/bench_recompute.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_single_gpu import Shape, build, causal_mask_dropped, model_flops  # noqa: E402

PEAK_FLOPS = 989.4e12  # H100/H200 SXM dense bf16, NVIDIA datasheet
WARMUP, STEPS = 1, 3
GiB = 2**30


def predict(shape: Shape, recompute: bool, hardware: str) -> dict:
    """The cost model's step time and peak memory of one GPU training ``shape`` (bf16-pure AdamW)."""
    from transformers import LlamaConfig

    from autotp.compiler import trace_for_planning
    from autotp.cost_model import step_estimate
    from autotp.cost_model.candidates import Config
    from autotp.cost_model.hardware import get_profile
    from autotp.cost_model.planner import Cluster, Training

    config = LlamaConfig(use_cache=False, vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
                         rope_theta=500000.0)  # fmt: skip
    costs = trace_for_planning(config, shape.seq)
    training = Training(shape.batch, "bf16-pure", recompute=recompute)
    est = step_estimate.estimate(costs, Cluster(1, 1, get_profile(hardware, calibrated=False)), training, Config(1, 1, 1, 1, shape.batch, 1))
    return {"predicted_step_ms": est.step_s * 1e3, "predicted_peak_gib": est.mem_bytes_per_gpu / GiB}


def measure(shape: Shape, policy: str, device: str, compile_: bool) -> dict:
    import autotp

    model = build(shape, device)
    flops = model_flops(model, shape)
    inputs = _inputs(shape, device)
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp=1, example_inputs=inputs, recompute=policy, compile=compile_)
    del model
    gc.collect()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-5, foreach=True)

    def step() -> torch.Tensor:
        loss = pm.train_step(**inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return {**_timed(step, flops, device, start), "recompute_layers": len(pm.plan.recompute_layers)}


def measure_hf(shape: Shape, policy: str, device: str) -> dict:
    """The unmodified HF model, compiled, SDPA ``is_causal``; ``full``: HF's own gradient checkpointing."""
    model = build(shape, device)
    if policy == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    flops = model_flops(model, shape)
    inputs = _inputs(shape, device)
    run = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step() -> torch.Tensor:
        loss = run(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    with causal_mask_dropped(shape.family):
        return _timed(step, flops, device, time.perf_counter())


def _inputs(shape: Shape, device: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=device, generator=torch.Generator(device).manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _timed(step: Callable[[], torch.Tensor], flops: float, device: str, start: float) -> dict:
    """Median of ``STEPS`` steps after ``WARMUP``, peak memory over them, MFU, the last loss."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(WARMUP + STEPS):
        if device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - begin)
        if i == 0:
            setup_s = time.perf_counter() - start
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / GiB if device == "cuda" else float("nan")
    return {"step_ms": seconds * 1e3, "mfu": flops / seconds / PEAK_FLOPS, "peak_gib": peak, "loss": float(loss.float()),
            "setup_s": setup_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the Llama-3-8B-wide model (default: 8)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="*", default=[2, 4, 8], help="eager autotp rows")
    parser.add_argument("--compile-batches", type=int, nargs="*", default=[], help="also time these with compile=True")
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[], help="also time HF + compile + is_causal at these, without and with its gradient checkpointing")
    parser.add_argument("--hardware", default="h100", help="the profile the predictions use (default: h100)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (tests the script)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    base = Shape("llama", 2, 64, 128, 4, 2, 1000, 1, 32) if args.smoke else Shape("llama", args.layers, 4096, 14336, 32, 8, 128256, 1, args.seq)
    results: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d"), "shape": base.__dict__, "rows": []}  # fmt: skip
    runs = [("hf-compile-causal", b, policy, True) for b in args.hf_batches for policy in ("none", "full")]
    runs += [("autotp", b, policy, False) for b in args.batches for policy in ("none", "full")]
    runs += [("autotp", b, policy, True) for b in args.compile_batches for policy in ("none", "full")]
    for setup, b, policy, compile_ in runs:
        shape = Shape(**{**base.__dict__, "batch": b})
        row: dict = {"setup": setup, "batch": b, "recompute": policy, "compile": compile_}
        if setup == "autotp":
            try:
                row.update(predict(shape, policy == "full", args.hardware))
            except Exception as e:  # noqa: BLE001 - reported, the measurement still runs
                row["predict_error"] = f"{type(e).__name__}: {e}"
        try:
            row.update(measure(shape, policy, device, compile_) if setup == "autotp" else measure_hf(shape, policy, device))
        except torch.OutOfMemoryError:
            row["oom"] = True
        except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        results["rows"].append(row)
        _keep(results, row, args.json, device)
    _ratios(results["rows"])


def _ratios(rows: list[dict]) -> None:
    """Each compiled autotp row against HF's row of the same batch and policy (step time and peak memory)."""
    hf = {(r["batch"], r["recompute"]): r for r in rows if r["setup"] != "autotp" and "step_ms" in r}
    for r in rows:
        base = hf.get((r["batch"], r["recompute"]))
        if r["setup"] == "autotp" and r["compile"] and base and "step_ms" in r:
            print(f"b{r['batch']} recompute={r['recompute']}: autotp {r['step_ms']:.1f} ms vs HF+compile+is_causal {base['step_ms']:.1f} ms "
                  f"({base['step_ms'] / r['step_ms']:.3f}x), peak {r['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB, MFU {r['mfu']:.1%} vs {base['mfu']:.1%}")


def _keep(results: dict, row: dict, path: Path | None, device: str) -> None:
    """Print the row, write every row so far, and free what the row's model left (compiled code, cached blocks)."""
    print(json.dumps(row), flush=True)
    if path:
        path.write_text(json.dumps(results, indent=1))
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
