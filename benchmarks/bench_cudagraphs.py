"""CUDA graphs against eager autotp on GPUs: numerics, launch-bound, compute-bound, MoE.

In one launch of ``--tp`` × ``--pp`` ranks (NCCL), for each case it builds the same model twice,
``parallelize``s one copy eagerly and one with ``cuda_graphs=True``, and runs
``train_step`` (forward + backward, no optimizer) on both:

* ``numerics``: fp32, three steps of two microbatches with an SGD update in between;
  the largest |difference| of loss, logits and unsharded grads (target: 1e-6). Llama
  (24 layers, h=512) and Mixtral (fp32: its experts take transformers'
  grouped_mm_fallback, which syncs, so capture is partial);
* ``launch``: Llama 24 layers, h=512, batch 1, seq 128, bf16: step time, speedup
  (target >= 2x), and the eager host time per kernel launch (eager step time over the
  cost model's launch count, which calibrates ``CudaGraphPolicy.launch_s``);
* ``compute`` (tp=1 only): DESIGN.md §5's Llama with 4 layers of Llama-3-8B shape, b=4,
  s=2048, bf16. The cost model declines to capture it (GPU time dominates); the case
  records that verdict, then forces capture (``cost_model.cudagraphs.ALWAYS``) and
  reports the step-time ratio eager/graph (target >= 0.98) and the memory overhead;
* ``moe``: Mixtral (8 layers, h=512, 8 experts, top-2, batch 1, seq 128) in bf16 (the
  experts run ``aten._grouped_mm`` after a sort/histc dispatch: the whole model is one
  region) and in fp32 (partial capture around the syncing expert matmuls);
* ``pipeline`` (``--pp`` > 1 only): the launch-bound Llama under 1F1B with microbatches
  of 1 sequence, 4 and then 8 per step: step times, peak memory and the captures per
  stage (``ParallelModel.cudagraph_slots``), which follow the microbatches in flight
  (``pp - stage``), not the microbatches per step. ``numerics`` also runs under ``--pp``.

    python benchmarks/bench_cudagraphs.py --tp 1 --cases numerics launch compute moe --json out/cg_tp1.json
    python benchmarks/bench_cudagraphs.py --tp 1 --pp 2 --cases numerics pipeline --json out/cg_pp2.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from autotp.runtime.processes.launcher import spawn_ranks

WARMUP, STEPS = 3, 15
CASES = ("numerics", "launch", "compute", "moe", "pipeline")
PIPELINE_MICROBATCHES = (4, 8)


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(use_cache=False, vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).train(False)


def _mixtral(seq: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(use_cache=False, vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=seq)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return MixtralForCausalLM(config).train(False)


def _launch_model() -> torch.nn.Module:
    return _llama(layers=24, hidden=512, heads=8, kv=8, ffn=1408, seq=128)


def _batch(model: torch.nn.Module, batch: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).cuda()
    return {"input_ids": ids, "labels": ids}


def _pair(model: torch.nn.Module, tp: int, batch: dict[str, torch.Tensor], policy: Any = None, pp: int = 1) -> tuple[Any, Any]:
    """(eager, captured) ParallelModels of two copies of ``model``."""
    import autotp

    eager = autotp.parallelize(copy.deepcopy(model), tp=tp, pp=pp, example_inputs=batch)
    plan = replace(eager.plan, cudagraph_policy=policy) if policy is not None else None
    graphed = autotp.parallelize(model, tp=tp, pp=pp, example_inputs=batch, plan=plan, cuda_graphs=True)
    return eager, graphed


def _regions(pm: Any, batch: dict[str, torch.Tensor], policy: Any = None) -> dict[str, Any]:
    from autotp.report.cudagraphs import cudagraph_report

    plan = replace(pm.plan, cudagraph_policy=policy) if policy is not None else pm.plan
    report = cudagraph_report(pm.graph_for(**batch), plan)
    return {
        "regions": len(report["cudagraph_regions"]),
        "launches": sum(r["launches"] for r in report["cudagraph_regions"]),
        "declined": [d["reason"] for d in report["declined_regions"]],
        "blockers": sorted({b["reason"] for b in report["blockers"]}),
        "impl": report["cudagraph_impl"],
    }


def _time(step: Callable[[], Any], zero: Callable[[], None]) -> tuple[float, float]:
    """(median step seconds, peak GiB allocated) of ``step``, grads zeroed between steps."""
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(WARMUP + STEPS):
        zero()
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def _perf(eager: Any, graphed: Any, batch: dict[str, torch.Tensor], microbatches: int = 1) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pm in (("eager", eager), ("graph", graphed)):
        step = functools.partial(pm.train_step, **batch, num_microbatches=microbatches)
        seconds, peak = _time(step, lambda pm=pm: pm.zero_grad(set_to_none=True))
        out[f"{name}_ms"] = seconds * 1e3
        out[f"{name}_peak_gib"] = peak
    out["speedup"] = out["eager_ms"] / out["graph_ms"]
    out["memory_overhead_gib"] = out["graph_peak_gib"] - out["eager_peak_gib"]
    return out


def _max_diff(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    return max((x - y).abs().max().item() for k, x in a.items() if x is not None for y in [b[k]] if y is not None)


def _numerics(model: torch.nn.Module, tp: int, pp: int) -> dict[str, Any]:
    batch = _batch(model, 4, 128)
    eager, graphed = _pair(model, tp, batch, pp=pp)
    optimizers = [torch.optim.SGD(pm.parameters(), lr=0.1) for pm in (eager, graphed)]
    worst = {"loss": 0.0, "grads": 0.0, "logits": 0.0}
    for _ in range(3):
        losses = [pm.train_step(**batch, num_microbatches=2) for pm in (eager, graphed)]
        worst["loss"] = max(worst["loss"], (losses[0] - losses[1]).abs().item())
        worst["grads"] = max(worst["grads"], _max_diff(eager.unshard_grads(), graphed.unshard_grads()))
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    micro = {k: v[:2] for k, v in batch.items()}  # the signature train_step compiled and captured
    with torch.no_grad():
        logits = [pm(**micro).logits for pm in (eager, graphed)]
    worst["logits"] = (logits[0] - logits[1]).abs().max().item()
    return {**worst, **_regions(graphed, micro), "slots": graphed.cudagraph_slots}


def _pipeline(tp: int, pp: int) -> dict[str, Any]:
    model = _launch_model().to(torch.bfloat16)
    eager, graphed = _pair(model, tp, _batch(model, 1, 128), pp=pp)
    out: dict[str, Any] = {}
    for m in PIPELINE_MICROBATCHES:
        batch = _batch(model, m, 128)
        out[f"m{m}"] = {**_perf(eager, graphed, batch, m), "slots": graphed.cudagraph_slots}
    return {**out, **_regions(graphed, _batch(model, 1, 128))}


def _case(name: str, tp: int, pp: int) -> dict[str, Any]:
    from autotp.cost_model.cudagraphs import ALWAYS
    from autotp.ir.plan import CudaGraphPolicy

    if name == "numerics":
        return {"llama24_fp32": _numerics(_launch_model().float(), tp, pp), "mixtral_fp32": _numerics(_mixtral(128).float(), tp, pp)}
    if name == "pipeline":
        return _pipeline(tp, pp) if pp > 1 else {"skipped": "the pipeline case needs --pp > 1"}
    if pp > 1:
        return {"skipped": f"the {name} case runs without a pipeline"}
    if name == "launch":
        model = _launch_model().to(torch.bfloat16)
        batch = _batch(model, 1, 128)
        eager, graphed = _pair(model, tp, batch)
        result: dict[str, Any] = {**_perf(eager, graphed, batch), **_regions(graphed, batch)}
        result["eager_host_us_per_launch"] = result["eager_ms"] * 1e3 / result["launches"]
        return result
    if name == "compute":
        if tp != 1:
            return {"skipped": "the compute-bound case runs at tp=1"}
        model = _llama(layers=4, hidden=4096, heads=32, kv=8, ffn=14336, seq=2048).to(torch.bfloat16)
        batch = _batch(model, 4, 2048)
        eager, graphed = _pair(model, tp, batch, policy=ALWAYS)
        default = _regions(graphed, batch, policy=CudaGraphPolicy())
        return {**_perf(eager, graphed, batch), **_regions(graphed, batch), "cost_model_default": default}
    assert name == "moe"
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = _mixtral(128).to(dtype)
        batch = _batch(model, 1, 128)
        eager, graphed = _pair(model, tp, batch)
        out[str(dtype).removeprefix("torch.")] = {**_perf(eager, graphed, batch), **_regions(graphed, batch)}
        del eager, graphed, model
        torch.cuda.empty_cache()
    return out


def _rank(rank: int, world: int, cases: list[str], pp: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    tp = world // pp
    results: dict[str, Any] = {"tp": tp, "pp": pp, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in cases:
        start = time.perf_counter()
        try:
            results[name] = _case(name, tp, pp)
        except Exception:  # noqa: BLE001 - recorded, so that the other cases still run
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name + "_wall_s"] = time.perf_counter() - start
        torch.cuda.empty_cache()
        if rank in (0, world - 1):
            print(json.dumps({f"rank {rank}": {name: results[name]}}, indent=1), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--json", help="write every rank's results here")
    parser.add_argument("--timeout", type=float, default=540)
    args = parser.parse_args()
    results = spawn_ranks(_rank, args.tp * args.pp, args.cases, args.pp, backend="nccl", timeout_s=args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
