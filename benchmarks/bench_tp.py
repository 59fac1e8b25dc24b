"""Tensor parallelism on GPUs: autotp against one GPU and PyTorch DTensor TP, one run.

Models (``--shape``): ``small`` is DESIGN.md §5's HF Llama with 4 layers of Llama-3-8B
shape (h=4096, 32 heads, 8 KV heads, ffn 14336), vocab 32000, b=4, s=2048 (``small-b1``: the same
tokens as b=1, s=8192, where the overlap's fused ops copy nothing to reorder); ``8b`` is the
full Llama-3-8B (32 layers, vocab 128256), b=2, s=4096. bf16, forward + backward. In one
launch of N ranks (NCCL) it measures, after warm-up, the median step time of:

``--suite scaling`` (default):

* the unmodified model on one GPU (rank 0 alone), eager (the baseline every ratio
  refers to) and with ``torch.compile``;
* DTensor TP with the hand plan (q/k/v/gate/up colwise, o/down rowwise; embedding and
  lm_head replicated), at every tp in --tp;
* autotp at every tp in --tp (tp < N runs N/tp independent tp groups side by side),
  eager and with ``compile=True``.

``--suite strong``: the strongest plans a PyTorch user writes, all compiled (each decoder
layer through ``torch.compile``), against autotp compiled without sequence parallelism,
with it, and with it and its collectives overlapped with the GEMMs (``tp_overlap=True``:
``torch.ops.symm_mem`` fused all-gather-matmul / matmul-reduce-scatter); ratios refer to
the fastest DTensor variant:

* ``DTensor strong``: vocab-parallel embedding, colwise q/k/v/gate/up, rowwise o/down,
  colwise ``lm_head`` with ``loss_parallel``;
* ``DTensor SP``: the same with ``SequenceParallel`` norms, ``PrepareModuleInput``
  all-gathers before attention and MLP, ``RowwiseParallel(output_layouts=Shard(1))``,
  embedding output and ``lm_head`` input ``Shard(1)``;
* ``DTensor SP+async``: SP with inductor's micro-pipeline TP on symmetric memory.

The user patch the DTensor variants need (an unmodified HF Llama sizes its causal mask
and positions from the local, sequence-sharded embedding): ``position_ids`` are passed
for the full sequence and ``create_causal_mask`` returns None, so SDPA runs
``is_causal=True`` (the flash kernel). autotp gets no patch: its ``causal_attention`` pass
drops the mask it proves causal.

Every model is built with ``use_cache=False``, as a training run sets it: with HF's default a
training step fills a KV cache, and a decoder layer compiled on its own then recompiles per
layer (the cache update reads its ``layer_idx``), past dynamo's limit of 8, and runs eager.

MFU = (6·N·tokens + 6·layers·b·s²·h, causal attention fwd+bwd) / (step · GPUs · 989 TFLOP/s).
It prints step time, tokens/s, ratios, MFU and peak memory, checks every loss against the
first row's, and writes JSON. The strong suite also profiles ``PROFILED_STEPS`` steps of
every row (``torch.profiler``, rank 0's GPU) and prints, per step, the time communication
kernels run (``comm ms``: NCCL kernels, peer and device-to-device copies, symmetric-memory
barriers; local device-to-device copies count too) and the part of it during which no
other kernel computes (``exposed``): what overlap hides shows as ``exposed`` falling
while ``comm ms`` stays.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set by default here)

    python benchmarks/bench_tp.py --tp 2 4 --json out.json
    python benchmarks/bench_tp.py --suite strong --shape 8b --tp 2 --json strong_8b.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.runtime.processes.launcher import spawn_ranks
from bench_single_gpu import causal_mask_dropped

WARMUP, STEPS = 3, 10
PROFILED_STEPS = 3
_COMM_NAMES = ("nccl", "memcpy ptop", "memcpy dtod", "barrier", "symm", "multimem")
_GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")
PEAK_FLOPS = 989e12  # H100/H200 dense bf16


@dataclass(frozen=True)
class Shape:
    layers: int
    vocab: int
    batch: int
    seq: int
    hidden: int = 4096


SHAPES = {"small": Shape(4, 32000, 4, 2048), "small-b1": Shape(4, 32000, 1, 8192), "8b": Shape(32, 128256, 2, 4096)}


def _model(shape: Shape) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(use_cache=False, vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=14336,
                         num_hidden_layers=shape.layers, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=shape.seq)  # fmt: skip
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


def _intervals_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _uncovered(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of ``spans`` (disjoint, sorted) outside ``cover`` (disjoint, sorted)."""
    total, j = 0.0, 0
    for start, end in spans:
        at = start
        while j < len(cover) and cover[j][1] <= at:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            total += max(0.0, cover[k][0] - at)
            at = max(at, cover[k][1])
            k += 1
        total += max(0.0, end - at)
    return total


def _profile_comm(step: Callable[[], torch.Tensor]) -> dict[str, object]:
    """Per step, from a profiler trace (module docstring): communication ms, exposed communication ms,
    the GEMM kernels' ms and the other computing kernels' ms, and the longest kernels by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    comm, compute = [], []
    gemm_us = other_us = 0.0
    by_name: dict[str, float] = {}
    for e in prof.events():
        # a range of the GPU timeline named by ``record_function`` (``nccl:all_reduce``, the fused ops) is no kernel
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start and not e.is_user_annotation:
            name, span = e.name.lower(), (e.time_range.start, e.time_range.end)
            by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + e.time_range.elapsed_us()
            if any(k in name for k in _COMM_NAMES):
                comm.append(span)
                continue
            compute.append(span)
            if any(k in name for k in _GEMM_NAMES):
                gemm_us += e.time_range.elapsed_us()
            else:
                other_us += e.time_range.elapsed_us()
    comm_spans = _intervals_union(comm)
    total_us = sum(end - start for start, end in comm_spans)
    exposed_us = _uncovered(comm_spans, _intervals_union(compute))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"comm_ms": total_us / PROFILED_STEPS / 1e3, "exposed_comm_ms": exposed_us / PROFILED_STEPS / 1e3,
            "gemm_ms": gemm_us / PROFILED_STEPS / 1e3, "other_compute_ms": other_us / PROFILED_STEPS / 1e3,
            "top_kernels_ms": [(name, us / PROFILED_STEPS / 1e3) for name, us in top]}  # fmt: skip


def _batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen).cuda()
    return ids, ids.clone()


def _fwd_bwd(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.detach()


def _tp_mesh(tp: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def _dtensor_tp(shape: Shape, tp: int, world: int) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model(shape)
    plan = {}
    for i in range(shape.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, _tp_mesh(tp, world), plan)


def _dtensor_strong(shape: Shape, tp: int, world: int, sp: bool, async_tp: bool) -> torch.nn.Module:
    """The strongest DTensor plans (module docstring), each decoder layer compiled."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)  # fmt: skip

    mesh = _tp_mesh(tp, world)
    seq_or_rep = Shard(1) if sp else Replicate()
    plan: dict = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_or_rep),
        "lm_head": ColwiseParallel(input_layouts=seq_or_rep, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
    for i in range(shape.layers):
        layer = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.self_attn.{name}"] = ColwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"{layer}.mlp.{name}"] = ColwiseParallel()
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel(output_layouts=seq_or_rep)
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel(output_layouts=seq_or_rep)
        if sp:
            plan[f"{layer}.input_layernorm"] = SequenceParallel()
            plan[f"{layer}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{layer}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})  # fmt: skip
            plan[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh.get_group().group_name)
    model = parallelize_module(_model(shape), mesh, plan)
    for layer in model.model.layers:
        layer.compile()
    return model




def _loss_parallel_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's shifted causal-LM loss on vocab-sharded logits (``loss_parallel``)."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    logits = model.lm_head(hidden).float()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()


def _row(setup: str, tp: int, measured: tuple) -> dict:
    step_s, loss, mem, *profiled = measured
    row = {"setup": setup, "tp": tp, "step_ms": step_s * 1e3, "loss": loss, "mem_gib": mem}
    if profiled:
        row.update(profiled[0])
        kernels = ", ".join(f"{name} {ms:.1f}" for name, ms in row["top_kernels_ms"])
        if dist.get_rank() == 0:
            print(f"{setup}: GEMM {row['gemm_ms']:.1f} ms, other compute {row['other_compute_ms']:.1f} ms, "
                  f"communication {row['comm_ms']:.1f} ms ({row['exposed_comm_ms']:.1f} exposed) per step; longest: {kernels}",
                  flush=True)  # fmt: skip
    return row


def _measure(step: Callable[[], torch.Tensor], profiled: bool) -> tuple:
    measured = _time(step, None)
    return (*measured, _profile_comm(step)) if profiled else measured


def _autotp(shape: Shape, ids: torch.Tensor, labels: torch.Tensor, tp: int, world: int, profiled: bool = False,
            **options) -> tuple[float, ...]:  # fmt: skip
    import autotp

    model = _model(shape)
    pm = autotp.parallelize(model, tp=tp, dp=world // tp, example_inputs={"input_ids": ids, "labels": labels},
                            gather_outputs=False, **options)  # a training step needs no full logits
    del model
    torch.cuda.empty_cache()
    if pm.plan.tp_overlap:
        print(f"autotp overlaps {', '.join(pm.plan.tp_overlap)} ({pm.plan.tp_overlap_impl})", flush=True)
    measured = _measure(functools.partial(_fwd_bwd, pm, ids, labels), profiled)
    del pm
    torch.cuda.empty_cache()
    return measured


def _scaling(shape: Shape, rank: int, world: int, tps: list[int], ids: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    rows = []
    alone = dist.new_group([0])
    if rank == 0:
        for compiled in (False, True):
            single = _model(shape)
            run = torch.compile(single) if compiled else single
            rows.append(_row("1 GPU" + (" +compile" if compiled else ""), 1,
                             _time(functools.partial(_fwd_bwd, run, ids, labels), alone)))  # fmt: skip
            del single, run
            torch.cuda.empty_cache()
    dist.barrier()
    for tp in tps:
        model = _dtensor_tp(shape, tp, world)
        rows.append(_row(f"DTensor TP={tp}", tp, _time(functools.partial(_fwd_bwd, model, ids, labels), None)))
        del model
        torch.cuda.empty_cache()
        for compiled in (False, True):
            rows.append(_row(f"autotp TP={tp}" + (" +compile" if compiled else ""), tp,
                             _autotp(shape, ids, labels, tp, world, compile=compiled)))  # fmt: skip
    return rows


def _strong(shape: Shape, world: int, tps: list[int], ids: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    rows = []
    for tp in tps:
        for name, sp, overlap in (("", False, False), (" SP", True, False), (" SP+overlap", True, True)):
            rows.append(_row(f"autotp TP={tp}{name}", tp, _autotp(shape, ids, labels, tp, world, profiled=True, compile=True,
                                                                   sequence_parallel=sp, tp_overlap=overlap)))  # fmt: skip
        for name, sp, async_tp in (("strong", False, False), ("SP", True, False), ("SP+async", True, True)):
            with causal_mask_dropped("llama"):
                model = _dtensor_strong(shape, tp, world, sp, async_tp)
                rows.append(_row(f"DTensor {name} TP={tp}", tp,
                                 _measure(functools.partial(_loss_parallel_step, model, ids, labels), True)))  # fmt: skip
            del model
            torch._inductor.config._micro_pipeline_tp = False
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return rows


def _worker(rank: int, world: int, suite: str, shape: Shape, tps: list[int]) -> list[dict]:
    from transformers.utils import logging

    logging.set_verbosity_error()
    ids, labels = _batch(shape)
    return _scaling(shape, rank, world, tps, ids, labels) if suite == "scaling" else _strong(shape, world, tps, ids, labels)


def _flops(shape: Shape) -> float:
    """6·N·tokens + causal attention (fwd+bwd 3 × 2·b·s²·h per layer)."""
    h, ffn, kv = shape.hidden, 14336, 1024
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    params = shape.layers * per_layer + 2 * shape.vocab * h + h
    tokens = shape.batch * shape.seq
    return 6 * params * tokens + 6 * shape.layers * shape.batch * shape.seq**2 * h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--suite", choices=("scaling", "strong"), default="scaling")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    shape = SHAPES[args.shape]
    world = max(args.tp)
    per_rank = spawn_ranks(_worker, world, args.suite, shape, args.tp, backend="nccl", timeout_s=3000)
    rows = per_rank[0]
    for row in rows:  # memory: the largest over ranks
        row["mem_gib"] = max(r["mem_gib"] for ranks in per_rank for r in ranks if r["setup"] == row["setup"])
    tokens = shape.batch * shape.seq
    print(f"{torch.cuda.get_device_name(0)} x{world}, torch {torch.__version__}, Llama {shape}, bf16, fwd+bwd, "
          f"suite {args.suite}")  # fmt: skip
    base = rows[0]
    reference = {tp: min((r for r in rows if r["tp"] == tp and r["setup"].startswith("DTensor")), key=lambda r: r["step_ms"])
                 for tp in args.tp}  # fmt: skip
    print(f"{'setup':24s} {'step ms':>8s} {'tokens/s':>10s} {'vs first':>9s} {'vs best DT':>10s} {'MFU':>6s} "
          f"{'mem GiB':>8s} {'mem/DT':>7s} {'loss':>8s} {'comm ms':>8s} {'exposed':>8s}")  # fmt: skip
    for r in rows:
        best = reference.get(r["tp"])
        r["tokens_per_s"] = tokens / (r["step_ms"] / 1e3)
        r["speedup_vs_first"] = base["step_ms"] / r["step_ms"]
        r["vs_best_dtensor"] = best["step_ms"] / r["step_ms"] if best else None
        r["mem_vs_best_dtensor"] = r["mem_gib"] / best["mem_gib"] if best else None
        r["mfu"] = _flops(shape) / (r["step_ms"] / 1e3 * r["tp"] * PEAK_FLOPS)
        r["loss_rel_err"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
        vs = f"{r['vs_best_dtensor']:10.3f}" if best else f"{'-':>10s}"
        mem = f"{r['mem_vs_best_dtensor']:7.2f}" if best else f"{'-':>7s}"
        comm = f"{r['comm_ms']:8.1f} {r['exposed_comm_ms']:8.1f}" if "comm_ms" in r else f"{'-':>8s} {'-':>8s}"
        print(f"{r['setup']:24s} {r['step_ms']:8.1f} {r['tokens_per_s']:10.0f} {r['speedup_vs_first']:9.2f} {vs} "
              f"{r['mfu']:6.1%} {r['mem_gib']:8.1f} {mem} {r['loss']:8.4f} {comm}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r, shape=args.shape, suite=args.suite) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
