"""Tensor parallelism on GPUs: autotp against one GPU and PyTorch DTensor TP, one run.

The model is DESIGN.md §5's: HF Llama with 4 layers of Llama-3-8B shape (h=4096, 32
heads, 8 KV heads, ffn 14336), vocab 32000, bf16, forward + backward, b=4, s=2048.
In one launch of N ranks (NCCL) it measures, after warm-up, the median step time of:

* the unmodified model on one GPU (rank 0 alone), eager (the baseline every ratio
  refers to) and with ``torch.compile`` (to show what fusion alone buys);
* DTensor TP with the hand plan (q/k/v/gate/up colwise, o/down rowwise; embedding and
  lm_head replicated), at every tp in --tp;
* autotp at every tp in --tp (tp < N runs N/tp independent tp groups side by side),
  eager and with ``compile=True`` (torch.compile of the per-rank graph).

It prints step time, tokens/s, speedups and memory, checks the losses against the
one-GPU loss, and writes JSON:

    python benchmarks/bench_tp.py --tp 2 4 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autotp.runtime.launcher import spawn_ranks

BATCH, SEQ, LAYERS, WARMUP, STEPS = 4, 2048, 4, 3, 10


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).train(False)


def _time(step: Callable[[], torch.Tensor], group: dist.ProcessGroup | None) -> tuple[float, float, float]:
    """(median step seconds, loss, peak GiB) of ``step`` (forward + backward)."""
    times = []
    torch.cuda.reset_peak_memory_stats()
    loss = torch.zeros(())
    for i in range(WARMUP + STEPS):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times), loss.item(), torch.cuda.max_memory_allocated() / 2**30


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (BATCH, SEQ), generator=gen).cuda()
    return ids, ids.clone()


def _fwd_bwd(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.detach()


def _dtensor_tp(tp: int, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    model = _model()
    plan = {}
    for i in range(LAYERS):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _worker(rank: int, world: int, tps: list[int]) -> list[dict]:
    import autotp
    from transformers.utils import logging

    logging.set_verbosity_error()
    ids, labels = _batch()
    rows = []
    alone = dist.new_group([0])
    if rank == 0:
        for compiled in (False, True):
            single = _model()
            run = torch.compile(single) if compiled else single
            step_s, loss, mem = _time(functools.partial(_fwd_bwd, run, ids, labels), alone)
            setup = "1 GPU" + (" +compile" if compiled else "")
            rows.append({"setup": setup, "tp": 1, "step_ms": step_s * 1e3, "loss": loss, "mem_gib": mem})
            del single, run
            torch.cuda.empty_cache()
    dist.barrier()
    for tp in tps:
        model = _dtensor_tp(tp, world)
        step_s, loss, mem = _time(functools.partial(_fwd_bwd, model, ids, labels), None)
        rows.append({"setup": f"DTensor TP={tp}", "tp": tp, "step_ms": step_s * 1e3, "loss": loss, "mem_gib": mem})
        del model
        torch.cuda.empty_cache()
        for compiled in (False, True):
            model = _model()
            pm = autotp.parallelize(model, tp=tp, dp=world // tp, example_inputs={"input_ids": ids, "labels": labels},
                                    gather_outputs=False, compile=compiled)  # a training step needs no full logits
            del model
            torch.cuda.empty_cache()
            step_s, loss, mem = _time(functools.partial(_fwd_bwd, pm, ids, labels), None)
            setup = f"autotp TP={tp}" + (" +compile" if compiled else "")
            rows.append({"setup": setup, "tp": tp, "step_ms": step_s * 1e3, "loss": loss, "mem_gib": mem})
            del pm
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = max(args.tp)
    per_rank = spawn_ranks(_worker, world, args.tp, backend="nccl", timeout_s=1200)
    rows = per_rank[0]
    for row in rows:  # memory: the largest over ranks
        row["mem_gib"] = max(r["mem_gib"] for r in (rr for ranks in per_rank for rr in ranks) if r["setup"] == row["setup"])
    base = rows[0]
    tokens = BATCH * SEQ
    print(f"{torch.cuda.get_device_name(0)} x{world}, torch {torch.__version__}, Llama {LAYERS}x(8B layer), "
          f"vocab 32000, bf16, b={BATCH}, s={SEQ}, fwd+bwd")
    print(f"{'setup':16s} {'step ms':>8s} {'tokens/s':>10s} {'vs 1 GPU':>9s} {'vs DTensor':>10s} {'mem GiB':>8s} {'loss':>8s}")
    dtensor = {r["tp"]: r for r in rows if r["setup"].startswith("DTensor")}
    for r in rows:
        r["tokens_per_s"] = tokens / (r["step_ms"] / 1e3)
        r["speedup_vs_1gpu"] = base["step_ms"] / r["step_ms"]
        r["vs_dtensor"] = dtensor[r["tp"]]["step_ms"] / r["step_ms"] if r["tp"] in dtensor else None
        r["loss_rel_err"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
        vs = f"{r['vs_dtensor']:10.2f}" if r["vs_dtensor"] is not None else f"{'-':>10s}"
        print(f"{r['setup']:16s} {r['step_ms']:8.1f} {r['tokens_per_s']:10.0f} {r['speedup_vs_1gpu']:9.2f} {vs} "
              f"{r['mem_gib']:8.1f} {r['loss']:8.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
