"""MoE layers under autotp: sync-free vs dropless dispatch, CUDA graphs, expert vs tensor
parallelism, against the strongest baseline a user has, in one launch.

Models (HF configs at real widths, ``--layers`` decoder layers, bf16, random init):

* ``mixtral``: Mixtral-8x7B widths (h 4096, 8 experts of 14336, top-2);
* ``fine``: fine-grained, Qwen3-30B-A3B widths (h 2048, 128 experts of 768, top-8).

Cases, each a training step (forward + backward, ``train_step``, no optimizer) at
``--batch`` x ``--seq`` tokens per GPU, timed as the median of ``--steps`` after warmup:

* ``layer`` (one GPU, or every GPU at ep=1): the unmodified HF model (its own
  ``grouped_mm`` experts), the same under ``torch.compile(mode="reduce-overhead")`` (the
  strongest single-GPU baseline: compiled and CUDA-graphed; ``--no-compile`` skips it),
  and autotp dropless / sync-free, eager and with every capturable region captured
  (``cuda_graphs=True`` with ``cost_model.cudagraphs.ALWAYS``). Sync-free uses the
  smallest capacity factor of ``CAPACITY_FACTORS`` that drops no row of the batch, so its
  loss must equal the others'; the capture count and drop counts are reported.
* ``gemm``: the experts' matmuls at the batch's routing, forward and backward:
  ``torch._grouped_mm`` called directly on the rows sorted by expert (what HF calls),
  the same over autotp's sync-free buffer (``E * capacity`` rows, the routed ones packed in
  front, offsets from the counts), and the batched matmul over ``[E, capacity, K]`` that
  sync-free ran before; TFLOP/s of useful work.
* ``ep`` (``--gpus`` > 1, NCCL): tensor-parallel experts (tp = gpus) against expert
  parallelism (ep = gpus, dp = gpus) dropless and sync-free, eager and captured, and FSDP2
  (``fully_shard`` per decoder layer over all GPUs) as the data-parallel baseline; the
  global batch is ``--batch`` x gpus sequences for every variant; tokens/s and peak memory.

    python benchmarks/bench_moe.py --gpus 1 --cases layer gemm --json out/moe_1gpu.json
    python benchmarks/bench_moe.py --gpus 4 --cases ep --json out/moe_ep4.json
    python benchmarks/bench_moe.py --gpus 2 --device cpu --cases ep --tiny   # smoke run on gloo
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
import traceback
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from autotp.runtime.processes.launcher import spawn_ranks

CAPACITY_FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)
CASES = ("layer", "gemm", "ep")


def _config(name: str, layers: int, seq: int, tiny: bool) -> Any:
    from transformers import MixtralConfig, Qwen3MoeConfig

    if name == "mixtral":
        widths = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
        if tiny:
            widths = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        return MixtralConfig(vocab_size=32000 if not tiny else 256, num_hidden_layers=layers, num_local_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=max(seq, 128), **widths)  # fmt: skip
    assert name == "fine", name
    widths = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128)  # fmt: skip
    experts = 128
    if tiny:
        widths = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)  # fmt: skip
        experts = 16
    return Qwen3MoeConfig(vocab_size=151936 if not tiny else 256, num_hidden_layers=layers, num_experts=experts,
                          num_experts_per_tok=8, max_position_embeddings=max(seq, 128), **widths)  # fmt: skip


def _model(config: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train(False)


def _batch(config: Any, batch: int, seq: int, device: torch.device, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(step: Any, device: torch.device, warmup: int, steps: int) -> dict[str, float]:
    """Median step milliseconds and peak GiB allocated."""
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return {"ms": statistics.median(times) * 1e3, "peak_gib": peak}


def _hf_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss.detach()

    return step


def _pm_step(pm: Any, batch: dict[str, torch.Tensor]) -> Any:
    def step() -> Any:
        pm.zero_grad(set_to_none=True)
        return pm.train_step(**batch)

    return step


def _parallelize(model: torch.nn.Module, batch: dict[str, torch.Tensor], graphs: bool, **kw: Any) -> Any:
    """``model`` parallelized; with ``graphs``, its plan re-run with every capturable region captured."""
    import gc

    import autotp
    from autotp.cost_model.cudagraphs import ALWAYS

    micro = {k: v[: max(1, v.shape[0] // kw.get("dp", 1))] for k, v in batch.items()}
    options = {k: v for k, v in kw.items() if k != "dp"}
    pm = autotp.parallelize(copy.deepcopy(model) if graphs else model, example_inputs=micro, **options)
    if not graphs:
        return pm
    plan = replace(pm.plan, cudagraph_policy=ALWAYS)
    del pm
    gc.collect()
    fixed = {k: v for k, v in options.items() if k not in ("moe_dispatch", "moe_capacity_factor", "ep")}
    return autotp.parallelize(model, example_inputs=micro, plan=plan, cuda_graphs=True, **fixed)


def _fitting_capacity(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kw: Any) -> tuple[float, Any]:
    """The smallest capacity factor of ``CAPACITY_FACTORS`` that drops no row of ``batch``, and its model."""
    for factor in CAPACITY_FACTORS:
        pm = _parallelize(model, batch, False, moe_dispatch="sync_free", moe_capacity_factor=factor, **kw)
        pm.moe_drop_counts(reset=True)
        with torch.no_grad():
            pm(**{k: v[: v.shape[0] // kw.get("dp", 1) or 1] for k, v in batch.items()})
        if all(dropped == 0 for dropped, _ in pm.moe_drop_counts(reset=True).values()):
            return factor, pm
    raise RuntimeError(f"every capacity factor up to {CAPACITY_FACTORS[-1]} drops rows")


def _regions(pm: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    from autotp.report.cudagraphs import cudagraph_report

    if not pm.plan.cudagraphs:
        return {}
    report = cudagraph_report(pm.graph_for(**batch), pm.plan)
    return {"regions": len(report["cudagraph_regions"]), "blockers": sorted({b["reason"] for b in report["blockers"]})[:4]}


def _run(key: str, step: Any, out: dict[str, Any], losses: dict[str, float], device: torch.device,
         args: argparse.Namespace) -> None:  # fmt: skip
    """Time ``step`` into ``out[key]`` (its first call's loss into ``losses``); an error is recorded, not raised."""
    try:
        start = time.perf_counter()
        losses[key] = float(step())
        first = time.perf_counter() - start
        out[key] = {**_time(step, device, args.warmup, args.steps), "first_call_s": first}
    except Exception as e:  # a baseline that cannot run is reported, not fatal
        out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        traceback.print_exc()


def _profile(key: str, step: Any, args: argparse.Namespace, device: torch.device) -> None:
    """Print the CUDA kernels of one step of the variants ``--profile`` names, with their summed
    time against the span (near it: the GPU sets the pace; far below: the host)."""
    if device.type == "cuda" and key.split("/")[1] in args.profile:
        from bench_single_gpu import profile_step

        table, totals = profile_step(step, rows=args.profile_rows)
        print(f"kernels of one {key} step ({totals}):\n{table}", flush=True)


def _layer_case(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = _config(name, args.layers, args.seq, args.tiny)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = _model(config, device, dtype)
    batch = _batch(config, args.batch, args.seq, device)
    out: dict[str, Any] = {"tokens": args.batch * args.seq}
    losses: dict[str, float] = {}
    variants: dict[str, Any] = {"hf_eager": _hf_step(model, batch)}
    if not args.no_compile and device.type == "cuda":
        compiled = torch.compile(model, mode="reduce-overhead")
        variants["hf_compile_reduce_overhead"] = _hf_step(compiled, batch)
    factor, syncfree = _fitting_capacity(copy.deepcopy(model), batch)
    out["capacity_factor"] = factor
    del syncfree
    builders: dict[str, Any] = {
        "autotp_dropless_eager": lambda: _parallelize(copy.deepcopy(model), batch, False),
        "autotp_syncfree_eager": lambda: _parallelize(copy.deepcopy(model), batch, False, moe_dispatch="sync_free",
                                                      moe_capacity_factor=factor),
    }  # fmt: skip
    if device.type == "cuda":
        builders["autotp_dropless_graphs"] = lambda: _parallelize(copy.deepcopy(model), batch, True)
        builders["autotp_syncfree_graphs"] = lambda: _parallelize(copy.deepcopy(model), batch, True, moe_dispatch="sync_free",
                                                                  moe_capacity_factor=factor)  # fmt: skip
    for key, step in variants.items():
        _run(key, step, out, losses, device, args)
        _profile(f"{name}/{key}", step, args, device)
    for key, build in builders.items():
        try:
            pm = build()
        except Exception as e:
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            traceback.print_exc()
            continue
        pm.moe_drop_counts(reset=True)
        _run(key, _pm_step(pm, batch), out, losses, device, args)
        _profile(f"{name}/{key}", _pm_step(pm, batch), args, device)
        if "ms" in out[key]:
            out[key].update(_regions(pm, batch), drops=pm.moe_drop_counts(reset=True))
        del pm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    variants.update(builders)
    out["losses"] = losses
    base = out["hf_eager"].get("ms")
    for key in variants:
        if "ms" in out[key] and base:
            out[key]["speedup_vs_hf_eager"] = base / out[key]["ms"]
    for mode in ("dropless", "syncfree"):
        eager, graph = out.get(f"autotp_{mode}_eager", {}), out.get(f"autotp_{mode}_graphs", {})
        if "ms" in eager and "ms" in graph:
            out[f"{mode}_graph_speedup"] = eager["ms"] / graph["ms"]
    return out


def _gemm_case(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One layer's expert matmuls at the batch's routing (random top-k), forward and backward:
    ``torch._grouped_mm`` called directly on the rows sorted by expert (what HF runs); the
    same op as autotp's sync-free dispatch runs it, over the static ``E * capacity``-row
    buffer with the received rows packed in front (capacity: the largest expert's count, so
    nothing drops); and the batched matmul over ``[E, capacity, K]`` that sync-free ran
    before (every padded row multiplied). TFLOP/s of useful work (the routed rows only)."""
    config = _config(name, 1, args.seq, args.tiny)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    k, h = config.num_experts_per_tok, config.hidden_size
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.batch * args.seq
    gen = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices.reshape(-1).to(device)
    counts = torch.bincount(choice, minlength=experts)
    rows, capacity = tokens * k, int(counts.max())
    out: dict[str, Any] = {"rows": rows, "max_rows_per_expert": capacity, "buffer_rows": experts * capacity}
    offs = counts.cumsum(0).to(torch.int32)
    for what, (kk, nn) in {"gate_up": (h, 2 * ffn), "down": (ffn, h)}.items():
        w = (torch.randn(experts, kk, nn, device=device, dtype=dtype) * 0.02).requires_grad_()
        x = torch.randn(rows, kk, device=device, dtype=dtype, requires_grad=True)
        packed = torch.cat([x.detach(), x.new_zeros((experts * capacity - rows, kk))]).requires_grad_()
        padded = torch.randn(experts, capacity, kk, device=device, dtype=dtype, requires_grad=True)
        useful = 3 * 2 * rows * kk * nn  # forward + both gradients

        def fwd_bwd(fn: Any) -> Any:
            def run() -> None:
                y = fn()
                y.backward(torch.ones_like(y))

            return run

        runs = {"torch_grouped_mm": fwd_bwd(lambda: torch._grouped_mm(x, w, offs=offs)),
                "autotp_syncfree_grouped_mm": fwd_bwd(lambda: torch._grouped_mm(packed, w, offs=offs)[:rows]),
                "bmm_capacity_before": fwd_bwd(lambda: torch.bmm(padded, w))}  # fmt: skip
        result: dict[str, Any] = {}
        for key, fn in runs.items():
            try:
                t = _time(fn, device, args.warmup, max(args.steps, 20))["ms"] / 1e3
            except Exception as e:  # grouped_mm without a kernel for this device or dtype
                result[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                continue
            result[key] = {"ms": t * 1e3, "useful_tflops": useful / t / 1e12}
        out[what] = result
    return out


def _ep_case(name: str, args: argparse.Namespace, device: torch.device, world: int) -> dict[str, Any]:
    config = _config(name, args.layers, args.seq, args.tiny)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = _model(config, device, dtype)
    batch = _batch(config, args.batch * world, args.seq, device)
    out: dict[str, Any] = {"global_tokens": args.batch * world * args.seq}
    graphs = device.type == "cuda"
    factor, _ = _fitting_capacity(copy.deepcopy(model), batch, ep=world, dp=world)
    out["capacity_factor"] = factor
    variants = {
        "tp_experts": dict(tp=world),
        "ep_dropless": dict(ep=world, dp=world),
        "ep_syncfree": dict(ep=world, dp=world, moe_dispatch="sync_free", moe_capacity_factor=factor),
    }
    for key, kw in variants.items():
        for captured in (False, True) if graphs else (False,):
            label = key + ("_graphs" if captured else "_eager")
            try:
                pm = _parallelize(copy.deepcopy(model), batch, captured, **kw)
                loss = float(pm.train_step(**batch))
                out[label] = {**_time(_pm_step(pm, batch), device, args.warmup, args.steps), "loss": loss,
                              "params_per_gpu": sum(p.numel() for p in pm.parameters())}  # fmt: skip
                del pm
            except Exception as e:
                out[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                traceback.print_exc()
    out["fsdp2"] = _fsdp2(model, batch, device, args, world)
    for key, value in out.items():
        if isinstance(value, dict) and "ms" in value:
            value["tokens_per_s"] = out["global_tokens"] / (value["ms"] / 1e3)
    return out


def _fsdp2(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """FSDP2 over every GPU, each decoder layer its own unit: the data-parallel baseline."""
    try:
        from torch.distributed.fsdp import fully_shard

        sharded = copy.deepcopy(model)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        rank = dist.get_rank()
        local = {k: v.chunk(world)[rank] for k, v in batch.items()}
        step = _hf_step(sharded, local)
        loss = float(step())
        return {**_time(step, device, args.warmup, args.steps), "loss": loss}
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    results: dict[str, Any] = {}
    for case in args.cases:
        for name in args.models:
            key = f"{case}/{name}"
            try:
                if case == "layer":
                    results[key] = _layer_case(name, args, device) if world == 1 else {"skipped": "one GPU"}
                elif case == "gemm":
                    results[key] = _gemm_case(name, args, device)
                else:
                    results[key] = _ep_case(name, args, device, world) if world > 1 else {"skipped": "needs --gpus > 1"}
            except Exception as e:
                traceback.print_exc()
                results[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                print(_summary({key: results[key]}), flush=True)  # each case as it ends: a run cut short keeps them
    return results


def _summary(results: dict[str, Any]) -> str:
    lines = []
    for key, r in results.items():
        if not isinstance(r, dict) or "/" not in key:
            continue
        cells = [f"{k}={v['ms']:.2f}ms" + (f"({v.get('regions')}r)" if "regions" in v else "")
                 for k, v in r.items() if isinstance(v, dict) and "ms" in v]  # fmt: skip
        extra = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                 if k.endswith("speedup") or k in ("capacity_factor", "losses", "max_rows_per_expert")}  # fmt: skip
        lines.append(f"{key}: {' '.join(cells)} {extra}")
        for what in ("gate_up", "down"):
            if what in r:
                lines.append(f"  {what}: " + " ".join(f"{k} {v['ms']:.3f}ms {v['useful_tflops']:.1f} TFLOP/s useful"
                                                     for k, v in r[what].items() if "ms" in v))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=["layer", "gemm"])
    parser.add_argument("--models", nargs="+", choices=("mixtral", "fine"), default=["mixtral", "fine"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="tiny widths (smoke runs)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", nargs="*", default=[], help="layer variants to profile one step of (CUDA kernels by time)")
    parser.add_argument("--profile-rows", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=3000)
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = spawn_ranks(_rank_main, args.gpus, args, backend=backend, timeout_s=args.timeout)[0]
    if args.device == "cuda":
        results["device"] = torch.cuda.get_device_name(0)
    results["args"] = vars(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(_summary(results))


if __name__ == "__main__":
    main()
