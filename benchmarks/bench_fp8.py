"""One GPU: FP8 training with autotp against autotp bf16 and HF + torchao float8, and FP8 loss curves.

    python benchmarks/bench_fp8.py [--shape 8b|tiny] [--parts check,gemm,timing,curve] [--variants ...]
                                   [--budget-s 560] [--json PATH]

* ``check``: the FP8 op on the GPU against the CPU kernels (``tests/test_fp8_gpu.py``'s check,
  one shape per recipe).
* ``gemm``: one GEMM of the 8B MLP's shape (8192 tokens, 4096 -> 14336) in bf16 and in FP8
  per recipe (operands already FP8): the rate behind ``HardwareProfile.fp8_matmul_speedup``.
* ``timing``: Llama-3-8B shape (32 layers, vocab 128256, GQA 32/8 heads), batch 2 × 4096
  tokens, forward + backward (no optimizer step), bf16 weights, every variant compiled
  with ``torch.compile``, one after another in this process: autotp tp=1 bf16, autotp FP8
  per recipe (``lm_head`` in bf16), HF + torchao float8 training per recipe (``lm_head``
  left out, HF's causal mask patched out so SDPA runs ``is_causal``, as autotp's
  ``causal_attention`` pass does; ``torchao`` compiles the whole model, ``torchao_layers``
  each decoder layer, as torchtitan does). torchao runs first by default, so that a call
  cut short still has the baseline. Median step time over timed steps after warm-up, MFU
  = (6·params·tokens + causal attention) / time against the **bf16** dense peak (989.4
  TFLOP/s), peak memory (``max_memory_allocated``: weights, grads and activations).
* ``curve``: 200 AdamW steps of a smaller Llama (8 layers, hidden 1024, byte-level vocab
  256, batch 16 × 1024 tokens; eager, bf16 weights) on byte-level tokens of the Python
  standard library's sources (offline everywhere), bf16 and each FP8 recipe from the same
  initialization and batches, the learning rate decayed by a cosine (``--curve-schedule``);
  the final loss is the mean of the last 20 steps, and the held-out loss the mean over 8
  fixed batches of the data's last 16th, which no step trains on (less noisy than the last
  steps' losses: the same batches for every recipe).

Parts run in the order asked (``timing2`` times ``--more-variants``); a timing variant or
curve that would not finish before ``--budget-s`` is skipped and reported as such. ``--shape tiny`` (2 layers, small widths) runs the whole
script in seconds, also on the CPU without compile (``--no-compile``), to check it.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import gzip
import json
import math
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from bench_attention_mask import PEAK_FLOPS, _flops
from bench_single_gpu import causal_mask_dropped

RECIPES = ("tensorwise", "rowwise", "blockwise")  # the op check and GEMM rates; curves and timing take tensorwise-delayed too
TORCHAO_RECIPES = ("tensorwise", "rowwise")
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, batch, seq
    "8b": (4096, 14336, 32, 32, 8, 128256, 2, 4096),
    "tiny": (256, 512, 2, 8, 8, 512, 2, 256),
}
CURVE = {"8b": (1024, 2816, 8, 16, 4, 256, 16, 1024), "tiny": (256, 512, 2, 8, 8, 256, 4, 128)}
WARMUP, STEPS = 2, 5  # the first step compiles (a delayed recipe: the second, its first seeds eagerly); the median of the timed ones is reported
VARIANT_S = {  # what one timing variant takes on an H200, compile included (to skip in time)
    "8b": {"autotp:bf16": 95.0, "autotp": 215.0, "autotp:tensorwise+lm_head": 230.0, "torchao": 200.0, "torchao_layers": 90.0},
    "tiny": {"autotp:bf16": 5.0, "autotp": 5.0, "torchao": 5.0, "torchao_layers": 5.0},
}
CURVE_S = {"8b": 30.0, "tiny": 5.0}  # one recipe's curve


def llama(shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab, _, seq = shape
    config = LlamaConfig(use_cache=False, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max(seq, 8192),
                         rope_theta=500000.0)  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Callable[[], torch.Tensor], device: torch.device, warmup: int, steps: int) -> dict[str, float]:
    """Median step time, peak memory and last loss of ``step`` (forward + backward)."""
    times, loss, first = [], float("nan"), 0.0
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        loss = step().item()
        _sync(device)
        elapsed = time.perf_counter() - start
        if i == 0:
            first = elapsed
        if i >= warmup:
            times.append(elapsed)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"step_ms": statistics.median(times) * 1e3, "first_step_s": first, "peak_gib": peak, "loss": loss}


def profile_step(step: Callable[[], torch.Tensor]) -> dict:
    """GPU time of one step by kernel kind (GEMM, attention, the rest), its 12 longest kernels
    and the 25 longest of the rest (casts, norms, elementwise)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    kernels = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if us <= 0:
            continue
        name = e.key.lower()
        kind = "gemm" if any(k in name for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas")) else (
            "attention" if any(k in name for k in ("flash", "fmha", "attention")) else "other")
        kinds[kind] += us / 1e3
        kernels.append((us / 1e3, e.count, e.key[:90], kind))
    ranked = sorted(kernels, reverse=True)
    return {"ms_by_kind": kinds, "top": [k[:3] for k in ranked[:12]],
            "top_other": [k[:3] for k in ranked if k[3] == "other"][:25]}  # fmt: skip


def gaps_of_step(step: Callable[[], torch.Tensor], trace: Path | None = None, shown: int = 15) -> dict:
    """Where the GPU idles during one step: the idle time between kernels, and for the longest
    gaps the kernels before and after each, the innermost host op that launched the latter and
    how long it was queued (~0: the GPU waited for the host). ``trace``: the Chrome trace, gzipped, is kept."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
    if trace is not None:
        trace.write_bytes(gzip.compress(raw))
    return idle_gaps(json.loads(raw)["traceEvents"], shown)


def idle_gaps(events: list[dict], shown: int = 15, min_us: float = 20.0) -> dict:
    """``gaps_of_step``'s analysis of a Chrome trace's events: gaps over ``min_us`` counted one by one."""
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])  # fmt: skip
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    host_ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")),
                      key=lambda e: e["ts"])  # fmt: skip
    starts = [e["ts"] for e in host_ops]

    def launch_of(kernel: dict) -> tuple[str, float | None]:
        """The innermost host op around the kernel's launch, and how long the kernel waited between its
        launch and its start (~0 where the GPU waited for the host)."""
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?", None
        at = bisect.bisect_right(starts, launch["ts"])
        inner = next((op["name"] for op in reversed(host_ops[max(0, at - 400) : at]) if launch["ts"] <= op["ts"] + op.get("dur", 0)), "?")
        return inner, round((kernel["ts"] - launch["ts"]) / 1e3, 3)

    gaps, busy_until, idle_all, before = [], None, 0.0, ""
    for k in kernels:
        if busy_until is not None and k["ts"] > busy_until:
            idle_all += k["ts"] - busy_until
        if busy_until is not None and k["ts"] - busy_until > min_us:
            gaps.append((k["ts"] - busy_until, k, before))
        if k["ts"] + k.get("dur", 0.0) > (busy_until or 0.0):
            busy_until, before = k["ts"] + k.get("dur", 0.0), k["name"][:60]
    span = (busy_until - kernels[0]["ts"]) / 1e3 if kernels else 0.0
    by_op: dict[str, float] = {}
    launched = [launch_of(k) for _, k, _ in gaps]
    for (us, _, _), (op, _) in zip(gaps, launched):
        by_op[op] = by_op.get(op, 0.0) + us / 1e3
    top = sorted(zip(gaps, launched), key=lambda g: g[0][0], reverse=True)[:shown]
    return {"kernels": len(kernels), "span_ms": span, "busy_ms": sum(k.get("dur", 0.0) for k in kernels) / 1e3,
            "idle_ms": sum(g[0] for g in gaps) / 1e3, "gaps": len(gaps), "idle_ms_any_gap": idle_all / 1e3,
            "idle_ms_by_launching_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:shown]),
            "longest": [(round(us / 1e3, 3), after, k["name"][:80], op, queued) for (us, k, after), (op, queued) in top]}  # fmt: skip


def _clear(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def parallelized(model: torch.nn.Module, example: dict, recipe: str | None, compile: bool) -> torch.nn.Module:
    """autotp at tp=1. ``recipe`` may carry options after ``+``: ``lm_head``, the lm_head's GEMMs
    in FP8 too (the plan edited with ``with_fp8_weights``; inside the fused lm_head + loss, dynamic
    tensorwise whatever the layers' recipe: the fused loss has no delayed scaling); ``graphs``,
    ``cuda_graphs=True`` (with ``compile``, the compiled regions are captured)."""
    import autotp
    from autotp.cost_model.fp8 import with_fp8_weights

    recipe, *extras = (recipe or "").split("+")
    graphs = "graphs" in extras
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = None
        if "lm_head" in extras:
            plan = with_fp8_weights(autotp.compile_rank(model, tp=1, example_inputs=example, fp8=recipe or None,
                                                        cuda_graphs=graphs).plan, ["lm_head.weight"], "tensorwise")  # fmt: skip
        return autotp.parallelize(model, tp=1, example_inputs=example, compile=compile, fp8=None if plan else recipe or None,
                                  plan=plan, gather_outputs=False, cuda_graphs=graphs)  # fmt: skip


def autotp_variant(shape: tuple[int, ...], recipe: str | None, device: torch.device, compile: bool) -> Callable[[], torch.Tensor]:
    *_, batch, seq = shape
    ids = torch.randint(0, shape[5], (batch, seq), device=device, generator=torch.Generator(device).manual_seed(0))
    pm = parallelized(llama(shape, str(device)), {"input_ids": ids, "labels": ids}, recipe, compile)
    if pm.plan.fp8_linears:
        fp8 = sum(1 for e in pm.plan.fp8_linears if e.recipe)
        print(f"  autotp {recipe}: {fp8} of {len(pm.plan.fp8_linears)} GEMM weights in FP8", flush=True)

    def step() -> torch.Tensor:
        for p in pm.parameters():
            p.grad = None
        return pm.train_step(input_ids=ids, labels=ids).detach()

    return step


def torchao_variant(shape: tuple[int, ...], recipe: str, device: torch.device, compile: bool,
                    per_layer: bool = False) -> Callable[[], torch.Tensor]:  # fmt: skip
    """HF + torchao float8 training, ``torch.compile``'d whole, or (``per_layer``) each decoder
    layer compiled on its own as torchtitan does (one compile, reused by every layer)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    *_, batch, seq = shape
    ids = torch.randint(0, shape[5], (batch, seq), device=device, generator=torch.Generator(device).manual_seed(0))
    model = llama(shape, str(device))
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    run = torch.compile(model) if compile and not per_layer else model
    if compile and per_layer:
        for layer in model.model.layers:
            layer.compile()

    def step() -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return step


def timing(shape_name: str, variants: list[str], device: torch.device, compile: bool, deadline: float,
           rows: list[dict], save: Callable[[], None], profiled: bool = False, steps: tuple[int, int] = (WARMUP, STEPS),
           gaps_dir: Path | None = None) -> list[dict]:  # fmt: skip
    """Time each variant, appending its row to ``rows`` and saving after each."""
    shape = SHAPES[shape_name]
    flops = _flops(llama(shape, "meta"), shape[6], shape[7])
    for name in variants:
        kind, _, recipe = name.partition(":")
        needs = VARIANT_S[shape_name].get(name, VARIANT_S[shape_name][kind])
        if time.perf_counter() + needs > deadline:
            rows.append({"setup": name, "skipped": "out of time"})
            print(f"{name}: skipped, out of time", flush=True)
            continue
        _clear(device)
        start = time.perf_counter()
        try:
            with causal_mask_dropped("llama") if kind.startswith("torchao") else contextlib.nullcontext():
                if kind == "autotp":
                    step = autotp_variant(shape, recipe.removeprefix("bf16") or None, device, compile)  # "bf16+graphs": no FP8
                else:
                    step = torchao_variant(shape, recipe, device, compile, per_layer=kind == "torchao_layers")
                row = {"setup": name, **time_steps(step, device, *steps)}
                if profiled and device.type == "cuda":
                    row["profile"] = profile_step(step)
                if gaps_dir is not None and device.type == "cuda":
                    row["gaps"] = gaps_of_step(step, gaps_dir / f"trace_{name.replace(':', '_').replace('+', '_')}.json.gz")
                    print(f"{name} GPU idle:", json.dumps(row["gaps"], indent=1), flush=True)
            del step
        except Exception as e:  # noqa: BLE001 - one variant's failure is a finding, the others still run
            row = {"setup": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        row["wall_s"] = time.perf_counter() - start
        if "step_ms" in row:
            row["mfu_bf16_peak"] = flops / (row["step_ms"] / 1e3) / PEAK_FLOPS
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)
    return rows


# ---- loss curves ---------------------------------------------------------------------


def stdlib_bytes(limit: int = 64 * 2**20) -> torch.Tensor:
    """Byte-level tokens of the Python standard library's sources (sorted files, up to ``limit`` bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


HELD_OUT = 1 / 16  # the tail of the curve data, never trained on: the held-out loss's batches
EVAL_BATCHES = 8


def curve(shape_name: str, recipe: str | None, tokens: torch.Tensor, device: torch.device, steps: int,
          dtype: torch.dtype, seed: int = 0, schedule: str = "cosine") -> tuple[list[float], float]:  # fmt: skip
    """The training losses, and the mean loss over ``EVAL_BATCHES`` fixed batches of the held-out
    tail after the last step. ``seed`` picks the initialization and the batches (seed 0 with the
    ``constant`` schedule: the earlier rounds' curves, but for the held-out tail). ``schedule``:
    20 warm-up steps, then a constant rate, or a cosine decay to a tenth of it at the last step."""
    shape = CURVE[shape_name]
    *_, batch, seq = shape
    gen = torch.Generator().manual_seed(1 + seed)
    train = tokens.numel() - int(tokens.numel() * HELD_OUT)
    model = llama(shape, str(device), dtype, seed)
    example = tokens[: batch * seq].view(batch, seq).to(device)
    pm = parallelized(model, {"input_ids": example, "labels": example}, recipe, False)
    del model
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for i in range(steps):
        starts = torch.randint(0, train - seq - 1, (batch,), generator=gen)
        ids = torch.stack([tokens[s : s + seq] for s in starts]).to(device)
        decay = 0.55 + 0.45 * math.cos(math.pi * i / max(1, steps - 1)) if schedule == "cosine" else 1.0
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (i + 1) / 20) * decay
        optimizer.zero_grad(set_to_none=True)
        losses.append(pm.train_step(input_ids=ids, labels=ids).item())
        torch.nn.utils.clip_grad_norm_(list(pm.parameters()), 1.0)
        optimizer.step()
    held = torch.Generator().manual_seed(12345)  # the same batches for every recipe and seed
    evals = []
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            starts = torch.randint(train, tokens.numel() - seq, (batch,), generator=held)
            ids = torch.stack([tokens[s : s + seq] for s in starts]).to(device)
            evals.append(pm(input_ids=ids, labels=ids).loss.item())
    return losses, statistics.mean(evals)


def curves(shape_name: str, device: torch.device, steps: int, recipes: list[str], deadline: float, out: dict,
           save: Callable[[], None], dtype: torch.dtype = torch.bfloat16, seeds: tuple[int, ...] = (0,),
           baseline: bool = True, schedule: str = "cosine") -> dict[str, dict]:  # fmt: skip
    """One curve per recipe (bf16 first, unless not ``baseline``) and seed, keyed ``recipe`` for
    seed 0, ``recipe@seed`` else."""
    tokens = stdlib_bytes()
    print(f"curve data: {tokens.numel() / 2**20:.1f} MiB of stdlib sources", flush=True)
    for seed in seeds:
        for recipe in ["bf16", *recipes] if baseline else recipes:
            key = recipe if seed == 0 else f"{recipe}@{seed}"
            if time.perf_counter() + CURVE_S[shape_name] > deadline:
                out[key] = {"skipped": "out of time"}
                continue
            _clear(device)
            start = time.perf_counter()
            try:
                losses, held_out = curve(shape_name, None if recipe == "bf16" else recipe, tokens, device, steps, dtype, seed,
                                         schedule)  # fmt: skip
                out[key] = {"losses": losses, "final": statistics.mean(losses[-20:]), "held_out": held_out,
                            "schedule": schedule, "wall_s": time.perf_counter() - start}  # fmt: skip
            except Exception as e:  # noqa: BLE001
                out[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            save()
            print(key, {k: v for k, v in out[key].items() if k != "losses"}, flush=True)
    return out


# ---- the op against the CPU, and GEMM rates ------------------------------------------


def check(device: torch.device) -> dict[str, float]:
    """Relative error of the op's output and grads on ``device`` against the CPU kernels."""
    import autotp.runtime.processes.collectives  # noqa: F401 - registers the kernels of autotp's ops
    from autotp.ir import ops

    out = {}
    for recipe in RECIPES:
        if recipe == "blockwise" and (device.type != "cuda" or torch.cuda.get_device_capability()[0] != 9):
            continue
        torch.manual_seed(0)
        cpu = [torch.randn(3, 100, 512), torch.randn(384, 512) / 20, torch.randn(384)]
        cpu = [t.to(torch.bfloat16).requires_grad_() for t in cpu]
        results = []
        try:
            for x, w, b in (cpu, [t.detach().to(device).requires_grad_() for t in cpu]):
                (y,) = ops.FP8_LINEAR(x, [w], [b], recipe, 0, [0], -1, 1, "")
                dy = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).view_as(y)
                grads = torch.autograd.grad([y], [x, w, b], [dy])
                results.append([t.detach().float().cpu() for t in (y, *grads)])
            out[recipe] = max(((a - b).norm() / b.norm()).item() for a, b in zip(results[1], results[0]))
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            out[recipe] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def gemm_rates(device: torch.device) -> dict[str, float]:
    """TFLOP/s of [8192, 4096] x [4096, 14336] in bf16 and FP8 per recipe (operands already FP8)."""
    from autotp.ir import fp8

    m, k, n = 8192, 4096, 14336
    x, w = torch.randn(m, k, device=device, dtype=torch.bfloat16), torch.randn(n, k, device=device, dtype=torch.bfloat16)
    runs: dict[str, Callable[[], torch.Tensor]] = {"bf16": lambda: x @ w.t()}
    for recipe in RECIPES:
        if recipe == "blockwise" and torch.cuda.get_device_capability()[0] != 9:
            continue
        spec = fp8.RECIPES[recipe]
        x8, sx = fp8.cast(x, fp8.amax(x, spec.activation), fp8.E4M3, spec.activation, spec.pow2)
        w8, sw = fp8.cast(w, fp8.amax(w, spec.weight), fp8.E4M3, spec.weight, spec.pow2)
        print(f"  {recipe}: FP8 operands {tuple(x8.shape)} x {tuple(w8.shape)}, scales {tuple(sx.shape)}, {tuple(sw.shape)}", flush=True)
        runs[recipe] = lambda x8=x8, sx=sx, w8=w8, sw=sw, spec=spec: fp8.scaled_gemm(
            x8, sx, spec.activation, w8, sw, spec.weight, torch.bfloat16, spec.fast_accum_forward)
    rates: dict[str, float | str] = {}
    for name, run in runs.items():
        try:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                run()
            torch.cuda.synchronize()
            rates[name] = 2 * m * k * n * 20 / (time.perf_counter() - start) / 1e12
        except Exception as e:  # noqa: BLE001
            rates[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return rates


def report(results: dict) -> str:
    lines = []
    timed = [r for r in results.get("timing", []) if "step_ms" in r]
    base = next((r for r in timed if r["setup"] == "autotp:bf16"), None)
    ao = next((r for r in timed if r["setup"] == "torchao:tensorwise"), None)
    if timed:
        lines.append(f"{'setup':22s} {'ms':>8s} {'vs autotp bf16':>14s} {'vs torchao tw':>13s} {'MFU(bf16 pk)':>12s} {'GiB':>6s} {'loss':>8s}")
    for r in results.get("timing", []):
        if "step_ms" not in r:
            lines.append(f"{r['setup']:22s} {r.get('skipped') or r.get('error')}")
            continue
        vs = f"{base['step_ms'] / r['step_ms']:.3f}x" if base else "-"
        vt = f"{ao['step_ms'] / r['step_ms']:.3f}x" if ao else "-"
        lines.append(f"{r['setup']:22s} {r['step_ms']:>8.1f} {vs:>14s} {vt:>13s} {r['mfu_bf16_peak']:>12.1%} {r['peak_gib']:>6.1f} {r['loss']:>8.4f}")
    if "curve" in results:
        for recipe, c in results["curve"].items():
            seed = recipe.partition("@")[2]
            bf16 = results["curve"].get(f"bf16@{seed}" if seed else "bf16", {})
            if "final" in c and c.get("losses"):
                rel = f" ({(c['final'] / bf16['final'] - 1):+.2%} vs bf16 of its seed)" if "final" in bf16 else ""
                held = f", held-out {c['held_out']:.4f}" if "held_out" in c else ""
                held += f" ({(c['held_out'] / bf16['held_out'] - 1):+.2%})" if held and "held_out" in bf16 else ""
                lines.append(f"curve {recipe:10s}: final loss {c['final']:.4f}{rel}{held}, first {c['losses'][0]:.3f}")
            else:
                lines.append(f"curve {recipe:10s}: {c.get('error') or c.get('skipped')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--parts", default="check,gemm,timing,curve,timing2")
    parser.add_argument("--variants", default="torchao:tensorwise,autotp:bf16,autotp:tensorwise",
                        help="kind:recipe; kinds autotp, torchao (whole model compiled), torchao_layers (each "
                             "decoder layer compiled)")  # fmt: skip
    parser.add_argument("--more-variants", default="autotp:rowwise,torchao:rowwise,autotp:blockwise",
                        help="what the part timing2 times")  # fmt: skip
    parser.add_argument("--curve-steps", type=int, default=200)
    parser.add_argument("--curve-recipes", default=",".join(RECIPES))
    parser.add_argument("--curve-dtype", default="bfloat16", help="the curve model's weights (float32 on a CPU)")
    parser.add_argument("--curve-seeds", default="0", help="initialization and batch seeds, one curve per recipe each")
    parser.add_argument("--curve-skip-bf16", action="store_true", help="no bf16 curves (an earlier run's serve)")
    parser.add_argument("--curve-schedule", choices=("constant", "cosine"), default="cosine",
                        help="learning rate after the warm-up: constant (the rounds before 2026-11-28) or a cosine decay to 0.1x")
    parser.add_argument("--budget-s", type=float, default=560.0)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps per variant (the first compiles)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per variant")
    parser.add_argument("--profile", action="store_true", help="also profile one step of each timing variant")
    parser.add_argument("--gaps", type=Path, metavar="DIR",
                        help="also trace one step of each timing variant: its GPU idle gaps and the host ops before them, "
                             "the Chrome trace gzipped into DIR")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    results: dict = {"device": name, "torch": torch.__version__, "shape": args.shape, "date": time.strftime("%Y-%m-%d")}
    print(f"{name}, torch {torch.__version__}, shape {args.shape}", flush=True)

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    for part in args.parts.split(","):
        if part == "check":
            results["check"] = check(device)
        elif part == "gemm" and device.type == "cuda":
            results["gemm_tflops"] = gemm_rates(device)
        elif part in ("timing", "timing2"):
            variants = (args.variants if part == "timing" else args.more_variants).split(",")
            timing(args.shape, variants, device, not args.no_compile, deadline, results.setdefault("timing", []), save,
                   args.profile, (args.warmup, args.steps), args.gaps)  # fmt: skip
        elif part == "curve":
            recipes = [r for r in args.curve_recipes.split(",") if r]
            results["curve_dtype"] = args.curve_dtype
            curves(args.shape, device, args.curve_steps, recipes, deadline, results.setdefault("curve", {}), save,
                   getattr(torch, args.curve_dtype), tuple(int(s) for s in args.curve_seeds.split(",")),
                   not args.curve_skip_bf16, args.curve_schedule)  # fmt: skip
        print(part, "done at", f"{time.perf_counter() - start:.0f} s", {k: v for k, v in results.items() if k in ("check", "gemm_tflops")}, flush=True)
        save()
    for r in results.get("timing", []):
        if "profile" in r:
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["profile"]["ms_by_kind"].items())
            print(f"profile {r['setup']}: GPU ms by kind: {kinds}")
    print(report(results))


if __name__ == "__main__":
    sys.exit(main())
