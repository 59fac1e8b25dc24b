"""Pipeline schedules on GPUs: step time and measured bubble against (p-1)/m (and /vpp).

Runs, in one launch of 4 ranks (NCCL, bf16, Llama-shaped model), every configuration
below with the same global batch, after warm-up steps, and prints one table:

    python benchmarks/bench_pipeline.py [--json out.json]

Measured bubble = (step time - busy time) / busy time on the busiest-idle rank, where
busy time is the rank's chunk compute timed between device syncs. The schedule's ideal
is (p-1)/m for 1F1B and (p-1)/(m·vpp) for interleaved 1F1B. tp=4 has no pipeline and is
the baseline the ratios refer to.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from autotp.runtime.launcher import spawn_ranks

CONFIGS = [  # (name, tp, pp, vpp, microbatches, schedule)
    ("tp4", 4, 1, 1, 8, None),
    ("tp2-pp2-1f1b", 2, 2, 1, 8, "1f1b"),
    ("pp4-1f1b", 1, 4, 1, 8, "1f1b"),
    ("pp4-vpp2-interleaved", 1, 4, 2, 8, "interleaved"),
    ("pp4-gpipe", 1, 4, 1, 8, "gpipe"),
]
GLOBAL_BATCH, SEQ, WARMUP, STEPS = 16, 1024, 2, 5


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _worker(rank: int, world: int) -> list[dict]:
    import autotp
    from transformers.utils import logging

    logging.set_verbosity_error()
    results = []
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (GLOBAL_BATCH, SEQ), generator=gen).cuda()
    for name, tp, pp, vpp, m, schedule in CONFIGS:
        model = _model()
        micro = GLOBAL_BATCH // (m * (world // (tp * pp)))
        pm = autotp.parallelize(model, tp=tp, pp=pp, vpp=vpp, example_inputs={"input_ids": ids[:micro], "labels": ids[:micro]})
        del model
        pm.measure_busy = pp > 1
        times, idle = [], []
        for step in range(WARMUP + STEPS):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = pm.train_step(input_ids=ids, labels=ids, num_microbatches=m, schedule=schedule)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            for p in pm.parameters():
                p.grad = None
            if step >= WARMUP:
                times.append(elapsed)
                idle.append((elapsed - pm.last_busy_s) / pm.last_busy_s if pp > 1 else 0.0)
        # busy time is measured with syncs; report the step time of a separate unmeasured run
        pm.measure_busy = False
        plain = []
        for _ in range(STEPS):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            pm.train_step(input_ids=ids, labels=ids, num_microbatches=m, schedule=schedule)
            torch.cuda.synchronize()
            plain.append(time.perf_counter() - start)
            for p in pm.parameters():
                p.grad = None
        ideal = (pp - 1) / (m * vpp) if pp > 1 else 0.0
        results.append({"config": name, "tp": tp, "pp": pp, "vpp": vpp, "microbatches": m, "schedule": schedule or "-",
                        "step_ms": statistics.median(plain) * 1e3, "loss": loss.item(),
                        "bubble_measured": statistics.median(idle), "bubble_formula": ideal,
                        "mem_gb": torch.cuda.max_memory_allocated() / 2**30})
        del pm
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    per_rank = spawn_ranks(_worker, 4, backend="nccl", timeout_s=900)
    rows = []
    for i, first in enumerate(per_rank[0]):
        worst_bubble = max(r[i]["bubble_measured"] for r in per_rank)
        rows.append({**first, "bubble_measured": worst_bubble, "mem_gb": max(r[i]["mem_gb"] for r in per_rank)})
    base = rows[0]["step_ms"]
    print(f"{torch.cuda.get_device_name(0)} x4, torch {torch.__version__}, global batch {GLOBAL_BATCH} x {SEQ} tokens, bf16")
    print(f"{'config':24s} {'step ms':>8s} {'vs tp4':>7s} {'bubble':>7s} {'(p-1)/(m*v)':>11s} {'mem GB':>7s} {'loss':>7s}")
    for r in rows:
        print(f"{r['config']:24s} {r['step_ms']:8.1f} {base / r['step_ms']:7.2f} {r['bubble_measured']:7.3f} "
              f"{r['bubble_formula']:11.3f} {r['mem_gb']:7.1f} {r['loss']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
