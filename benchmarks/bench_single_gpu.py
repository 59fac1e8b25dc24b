"""One GPU: autotp's per-GPU passes against the strongest single-GPU setups a user has, in one process.

For each shape it builds the model (bf16, seeded: every setup trains the same weights) and
times ``--steps`` (``STEPS``) forward + backward steps (``labels=``, no optimizer) after ``WARMUP``:

* ``hf-compile``: ``torch.compile(model)``;
* ``hf-compile-causal``: the same with HF's ``create_causal_mask`` returning None, so SDPA runs
  ``is_causal`` (the flash kernel): the strongest setup a user writes for large shapes;
* ``hf-reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs through
  inductor's cudagraph trees) on the unmodified model: the strongest for launch-bound shapes;
* ``autotp``: ``parallelize(tp=1, compile=True)`` with the plan as chosen (every pass on);
  ``autotp-no-fused-loss``, ``autotp-no-causal``: one pass switched off in the plan
  (``loss_chunk_tokens=0``, ``causal_attention=False``);
  ``autotp-eager``: ``compile=False``; ``autotp-cudagraphs``: ``cuda_graphs=True``;
  ``autotp-compile-cudagraphs``: ``compile=True`` and ``cuda_graphs=True``.

It prints per shape: step time (median), the ratio to the fastest HF setup measured in the run,
MFU (6·params·tokens + causal attention 3·2·b·s²·h·layers, over 989.4 TFLOP/s dense bf16),
peak memory (``max_memory_allocated`` over the steps, parameters and gradients included), the
loss of the last step, and the setup time (building the runner and its first step: compile and
capture; for autotp also ``parallelize_s``, the trace, plan and lowering alone). ``--sdpa`` first times SDPA's kernels (forward + backward) at the 8B attention shape,
torch's own choice among them included (``DEFAULT``: recent torch (2.11 measured) with cuDNN > 9.15 puts cuDNN
first on Hopper). ``--smoke`` runs tiny shapes on the CPU, eagerly, to test this script::

    python benchmarks/bench_single_gpu.py --shapes 8b launch moe vocab152k --json out.json
    python benchmarks/bench_single_gpu.py --shapes launch --setups hf-reduce-overhead autotp-compile-cudagraphs
    python benchmarks/bench_single_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

PEAK_FLOPS = 989.4e12  # H100/H200 SXM dense bf16, NVIDIA datasheet
WARMUP, STEPS = 3, 10


@dataclass(frozen=True)
class Shape:
    family: str  # llama, qwen2 or mixtral
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int
    experts: int = 0


SHAPES = {
    "8b": Shape("llama", 32, 4096, 14336, 32, 8, 128256, 2, 4096),
    "vocab152k": Shape("qwen2", 28, 1536, 8960, 12, 2, 151936, 2, 4096),
    "launch": Shape("llama", 24, 512, 1408, 8, 8, 32000, 1, 128),
    "moe": Shape("mixtral", 8, 512, 1024, 8, 4, 32000, 1, 128, experts=8),
}
SMOKE = {
    "8b": Shape("llama", 2, 64, 128, 4, 2, 1000, 2, 32),
    "moe": Shape("mixtral", 2, 64, 128, 4, 2, 500, 1, 16, experts=4),
}
HF_SETUPS = ("hf-compile", "hf-compile-causal", "hf-reduce-overhead")
DEFAULT_SETUPS = {
    "8b": ("hf-compile", "hf-compile-causal", "autotp", "autotp-no-fused-loss"),
    "vocab152k": ("hf-compile-causal", "autotp", "autotp-no-fused-loss"),
    "launch": ("hf-reduce-overhead", "autotp-cudagraphs", "autotp-compile-cudagraphs"),
    "moe": ("hf-reduce-overhead", "autotp-cudagraphs", "autotp-compile-cudagraphs"),
}
SMOKE_SETUPS = ("hf-eager", "autotp-eager", "autotp-eager-no-fused-loss")


def build(shape: Shape, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(use_cache=False, vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq)  # fmt: skip
    if shape.family == "mixtral":
        config, cls = MixtralConfig(**common, num_local_experts=shape.experts, num_experts_per_tok=2), MixtralForCausalLM
    elif shape.family == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config, cls = LlamaConfig(**common, rope_theta=500000.0), LlamaForCausalLM
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).train(False)
    finally:
        torch.set_default_dtype(previous)


def model_flops(model: torch.nn.Module, shape: Shape) -> float:
    """Forward + backward FLOPs of one step (the formula of bench_attention_mask)."""
    params = sum(p.numel() for p in model.parameters())
    attention = 4 * shape.batch * shape.seq**2 * shape.hidden * shape.layers / 2
    return 6 * params * shape.batch * shape.seq + 3 * attention


@contextlib.contextmanager
def causal_mask_dropped(family: str) -> Iterator[None]:
    """The user's patch: HF's ``create_causal_mask`` returns None, so SDPA runs ``is_causal``."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    original = module.create_causal_mask
    module.create_causal_mask = lambda **kwargs: None
    try:
        yield
    finally:
        module.create_causal_mask = original


Step = Callable[[], torch.Tensor]


def hf_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], mode: str | None) -> Step:
    run = model if mode == "eager" else torch.compile(model, mode=mode)

    def step() -> torch.Tensor:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = run(**inputs).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.detach().clone()

    return step


def autotp_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], setup: str) -> tuple[Step, dict]:
    import autotp
    from autotp.compiler import plan_model

    compile_ = "eager" not in setup and setup != "autotp-cudagraphs"
    graphs = setup.endswith("cudagraphs")
    off = {"no-fused-loss": {"loss_chunk_tokens": 0}, "no-causal": {"causal_attention": False}}
    fields = next((f for suffix, f in off.items() if setup.endswith(suffix)), None)
    plan = None  # as chosen: parallelize plans (and traces) once
    if fields is not None:  # a pass switched off: plan first, then edit the plan
        plan = replace(plan_model(model, inputs, next(model.parameters()).device, tp=1, pp=1, dp=1, vpp=1, plan=None).plan, **fields)
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp=1, example_inputs=inputs, plan=plan, compile=compile_, cuda_graphs=graphs)
    parallelize_s = time.perf_counter() - start
    plan = pm.plan

    def step() -> torch.Tensor:
        loss = pm.train_step(**inputs)
        for p in pm.parameters():
            p.grad = None
        return loss

    chosen = {"loss_chunk_tokens": plan.loss_chunk_tokens, "causal_attention": plan.causal_attention, "compile": compile_,
              "cuda_graphs": graphs, "parallelize_s": parallelize_s}  # fmt: skip
    return step, chosen


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(step: Step, rows: int = 25) -> tuple[str, dict]:
    """The CUDA kernels of one step, by total time (torch.profiler), and their count, summed time and
    span (first start to last end): a summed time near the span means the GPU, not the host, sets the pace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3 if kernels else 0.0
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    return table, {"kernels": len(kernels), "kernel_ms": busy, "span_ms": span}


def measure(shape: Shape, setup: str, device: str, profiled: bool = False, steps: int = STEPS) -> dict:
    """One setup on a fresh model: setup time, median step, peak memory, loss (and a kernel profile)."""
    model = build(shape, device)
    gen = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=device, generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    flops = model_flops(model, shape)
    start = time.perf_counter()
    chosen: dict = {}
    patch = causal_mask_dropped(shape.family) if setup == "hf-compile-causal" else contextlib.nullcontext()
    with patch:
        if setup.startswith("hf-"):
            mode = {"hf-compile": None, "hf-compile-causal": None, "hf-reduce-overhead": "reduce-overhead", "hf-eager": "eager"}[setup]
            step = hf_step(model, inputs, mode)
        else:
            step, chosen = autotp_step(model, inputs, setup)
            del model  # parallelize copied the weights
            gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        setup_s = time.perf_counter() - start
        times = []
        for i in range(WARMUP + steps):
            _sync(device)
            begin = time.perf_counter()
            loss = step()
            _sync(device)
            if i >= WARMUP:
                times.append(time.perf_counter() - begin)
        seconds = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        if profiled:
            table, kernels = profile_step(step)
            chosen["profile"] = kernels
            print(f"kernels of one {setup} step: {kernels}\n{table}", flush=True)
    return {"setup": setup, "step_ms": seconds * 1e3, "mfu": flops / seconds / PEAK_FLOPS, "peak_gib": peak,
            "loss": float(loss.float()), "setup_s": setup_s, **chosen}  # fmt: skip


def sdpa_kernels(batch: int = 2, heads: int = 32, seq: int = 4096, head_dim: int = 128) -> list[dict]:
    """Causal attention forward + backward on each SDPA kernel (CUDA events, median of 20)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for _ in range(3))  # fmt: skip
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 4 * batch * heads * seq * seq * head_dim / 2
    rows = []
    for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            fwd, both = [], []
            for i in range(25):
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                marks[0].record()
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                marks[1].record()
                out.backward(grad)
                marks[2].record()
                torch.cuda.synchronize()
                if i >= 5:
                    fwd.append(marks[0].elapsed_time(marks[1]))
                    both.append(marks[0].elapsed_time(marks[2]))
        f, b = statistics.median(fwd), statistics.median(both)
        rows.append({"kernel": backend.name if backend is not None else "DEFAULT", "fwd_ms": f, "fwd_bwd_ms": b, "fwd_tflops": flops / f / 1e9,
                     "bwd_tflops": 2.5 * flops / (b - f) / 1e9})  # fmt: skip
    return rows


def report(shape_name: str, shape: Shape, rows: list[dict]) -> str:
    hf = [r for r in rows if r["setup"] in HF_SETUPS or r["setup"] == "hf-eager"]
    best = min(hf, key=lambda r: r["step_ms"]) if hf else None
    lines = [f"{shape_name}: {asdict(shape)}",
             f"{'setup':28s} {'step ms':>9s} {'vs ' + (best['setup'] if best else 'n/a'):>24s} {'MFU':>6s} "
             f"{'peak GiB':>8s} {'loss':>8s} {'setup s':>8s}"]  # fmt: skip
    for r in rows:
        ratio = best["step_ms"] / r["step_ms"] if best else float("nan")
        lines.append(f"{r['setup']:28s} {r['step_ms']:>9.2f} {ratio:>23.3f}x {r['mfu']:>6.1%} {r['peak_gib']:>8.1f} "
                     f"{r['loss']:>8.4f} {r['setup_s']:>8.1f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--setups", nargs="+", help="setups to run on every shape (default: per shape, DEFAULT_SETUPS)")
    parser.add_argument("--sdpa", action="store_true", help="time the SDPA kernels at the 8B attention shape first")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager only (tests the script)")
    parser.add_argument("--profile", nargs="*", default=[], help="setups to profile one step of (CUDA kernels by time)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"timed steps per setup, after {WARMUP} warm-up (default: {STEPS})")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes = SMOKE if args.smoke else SHAPES
    names = [s for s in args.shapes if s in shapes]
    results: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d"), "shapes": {}}  # fmt: skip
    if args.sdpa and device == "cuda":
        results["sdpa"] = sdpa_kernels()
        for r in results["sdpa"]:
            print(f"SDPA {r['kernel']:20s} fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TFLOP/s), fwd+bwd "
                  f"{r['fwd_bwd_ms']:.3f} ms (bwd {r['bwd_tflops']:.0f} TFLOP/s)", flush=True)  # fmt: skip
    for name in names:
        rows = []
        for setup in args.setups or (SMOKE_SETUPS if args.smoke else DEFAULT_SETUPS[name]):
            try:
                rows.append(measure(shapes[name], setup, device, setup in args.profile, args.steps))
                print(f"{name} {setup}: {rows[-1]['step_ms']:.2f} ms, {rows[-1]['peak_gib']:.1f} GiB, loss "
                      f"{rows[-1]['loss']:.4f}, setup {rows[-1]['setup_s']:.1f} s", flush=True)  # fmt: skip
            except Exception as e:  # a setup that fails is reported, the others still run
                print(f"{name} {setup} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}", flush=True)
            results["shapes"][name] = rows
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
            torch._dynamo.reset()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"{results['device']}, torch {results['torch']}, {results['date']}, bf16, fwd+bwd, median of {args.steps} steps")
    for name in names:
        print(report(name, shapes[name], results["shapes"][name]))


if __name__ == "__main__":
    main()
