"""Pipeline parallelism on 2 GPUs: autotp against torch.distributed.pipelining, same launch.

Both sides train (forward + backward, no optimizer) an unmodified HF Llama in bf16 with
pp=2 and the same microbatches and schedule. The baseline splits the model by hand the
way torchtitan users do: stage 0 = embedding + first half of the decoder layers, stage 1
= second half + norm + ``lm_head`` (for interleaved and zero-bubble V schedules, four
quarters, two per rank). Each row runs eager and with compiled layers (autotp:
``compile=True``; torch: ``torch.compile`` on every decoder layer). Printed per row: step
time (median), peak memory (max over ranks), speed ratio torch/autotp, memory ratio,
both losses (they must agree), autotp's MFU, and its bubble (idle over busy time) as
the cost model predicts it and as measured.

    python benchmarks/bench_pipeline.py [--models small,8b] [--schedules gpipe,1f1b,interleaved,zbh1]
        [--modes eager,compiled] [--json out.json] [--profile DIR]

``--profile DIR`` also records one autotp 1F1B step of the first model with the torch
profiler on each rank and writes ``DIR/rank<r>.txt`` (kernels and ops by device time,
with NCCL waits) and ``DIR/rank<r>.json`` (a Chrome trace).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autotp.cost_model.bubble import bubble_fraction
from autotp.cost_model.hardware import H200
from autotp.runtime.processes.launcher import spawn_ranks

MODELS = {  # name -> (layers, hidden, ffn, heads, kv heads, global batch, sequence)
    "small": (16, 2048, 5632, 16, 8, 16, 1024),
    "8b": (16, 4096, 14336, 32, 8, 8, 2048),
}
VOCAB, MICROBATCHES, WARMUP, STEPS = 32000, 8, 3, 10
DEVICE = "cuda"  # "cpu" runs the same code on gloo (a smoke test of both sides, no timing)
# autotp schedule -> (torch schedule class, stages per rank, V-shaped stage placement)
TORCH_SCHEDULES = {
    "gpipe": [("ScheduleGPipe", 1, False)],
    "1f1b": [("Schedule1F1B", 1, False)],
    "interleaved": [("ScheduleInterleaved1F1B", 2, False)],
    "zbh1": [("ScheduleInterleavedZeroBubble", 2, False), ("ScheduleZBVZeroBubble", 2, True)],
}


def _model(name: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, ffn, heads, kv, _, seq = MODELS[name]
    config = LlamaConfig(use_cache=False, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return LlamaForCausalLM(config).to(torch.bfloat16 if DEVICE == "cuda" else torch.float32).train()


def _flops_per_step(name: str) -> float:
    """Model FLOPs of forward + backward: 6·(matmul weights)·tokens + causal attention."""
    layers, h, ffn, heads, kv, batch, seq = MODELS[name]
    per_layer = h * h * (2 + 2 * kv / heads) + 3 * h * ffn
    tokens = batch * seq
    return 6 * (layers * per_layer + h * VOCAB) * tokens + 6 * layers * h * seq * tokens  # attention: 12·L·h·s²·b / 2


class _Stage(nn.Module):
    """A contiguous slice of an HF Llama: optional embedding, decoder layers, optional norm and head."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary(h, positions)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ``ForCausalLMLoss``: predict token t+1 from position t, mean over tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(0, 1))


def _torch_pipeline(name: str, schedule: str, compiled: bool, rank: int) -> tuple[Callable[[], torch.Tensor], list[nn.Module]]:
    import torch.distributed.pipelining as pipelining

    cls_name, per_rank, v_shape = schedule
    layers = MODELS[name][0]
    model = _model(name)
    stages = 2 * per_rank
    mine = [rank, stages - 1 - rank] if v_shape else [rank + 2 * k for k in range(per_rank)]
    per_stage = layers // stages
    modules = [_Stage(model, range(s * per_stage, (s + 1) * per_stage), s == 0, s == stages - 1) for s in mine]
    del model
    if compiled:
        for module in modules:
            for layer in module.layers:
                layer.compile()
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    pipe_stages = [pipelining.PipelineStage(m, s, stages, device) for m, s in zip(modules, mine)]
    cls = getattr(pipelining, cls_name)
    sched = cls(pipe_stages if per_rank > 1 else pipe_stages[0], n_microbatches=MICROBATCHES, loss_fn=_causal_lm_loss)
    ids = _batch(name)

    def step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (ids,) if 0 in mine else ()
        kwargs: dict[str, Any] = {"target": ids, "losses": losses} if stages - 1 in mine else {}
        sched.step(*args, **kwargs)
        loss = torch.stack(losses).mean().float() if losses else torch.zeros((), device=device)
        dist.all_reduce(loss)  # the loss is on one rank: put it on both
        return loss

    return step, modules


def _autotp(name: str, schedule: str, compiled: bool) -> tuple[Callable[[], torch.Tensor], nn.Module]:
    import autotp

    ids = _batch(name)
    micro = ids.shape[0] // MICROBATCHES
    model = _model(name)
    vpp = 2 if schedule == "interleaved" else 1
    pm = autotp.parallelize(model, pp=2, vpp=vpp, compile=compiled,
                            example_inputs={"input_ids": ids[:micro], "labels": ids[:micro]})  # fmt: skip
    del model

    def step() -> torch.Tensor:
        return pm.train_step(input_ids=ids, labels=ids, num_microbatches=MICROBATCHES, schedule=schedule)

    return step, pm


def _batch(name: str) -> torch.Tensor:
    batch, seq = MODELS[name][5], MODELS[name][6]
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _measure(step: Callable[[], torch.Tensor], modules: list[nn.Module]) -> dict:
    def zero() -> None:
        for m in modules:
            for p in m.parameters():
                p.grad = None

    for _ in range(WARMUP):
        step()
        zero()
    _synchronize()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], torch.zeros(())
    for _ in range(STEPS):
        dist.barrier()
        _synchronize()
        start = time.perf_counter()
        loss = step()
        _synchronize()
        times.append(time.perf_counter() - start)
        zero()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return {"ms": statistics.median(times) * 1e3, "gib": peak, "loss": loss.item()}


def _measured_bubble(step: Callable[[], torch.Tensor], pm: Any) -> float:
    """Idle over busy time of this rank in one step, its chunks' compute timed between
    device syncs (``ParallelModel.measure_busy``; the syncs slow the step, so it is not timed with them)."""
    pm.measure_busy = True
    _synchronize()
    start = time.perf_counter()
    step()
    _synchronize()
    elapsed = time.perf_counter() - start
    pm.measure_busy = False
    for p in pm.parameters():
        p.grad = None
    return (elapsed - pm.last_busy_s) / pm.last_busy_s


def _run(fn: Callable[[], tuple[Callable[[], torch.Tensor], Any]]) -> dict:
    try:
        step, holder = fn()
        result = _measure(step, holder if isinstance(holder, list) else [holder])
        if hasattr(holder, "measure_busy"):
            result["bubble"] = _measured_bubble(step, holder)
    except Exception as e:  # a schedule one side does not support: reported, not fatal
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"}
    finally:
        holder = step = None  # noqa: F841
        _synchronize()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return result


def _profile(name: str, out_dir: str, rank: int) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule

    step, _ = _autotp(name, "1f1b", False)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, schedule=schedule(wait=1, warmup=2, active=2), record_shapes=False) as prof:
        for _ in range(5):
            step()
            torch.cuda.synchronize()
            prof.step()
    os.makedirs(out_dir, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    host = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"autotp 1F1B, {name}, 2 active steps, by device time\n{table}\n\nby host time\n{host}\n")
    prof.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.json"))


def _worker(rank: int, world: int, models: list[str], schedules: list[str], modes: list[str], profile_dir: str | None) -> list[dict]:
    from transformers.utils import logging

    logging.set_verbosity_error()
    rows = []
    for name in models:
        for sched in schedules:
            for mode in modes:
                compiled = mode == "compiled"
                ours = _run(lambda: _autotp(name, sched, compiled))
                for baseline in TORCH_SCHEDULES[sched]:
                    theirs = _run(lambda: _torch_pipeline(name, baseline, compiled, rank))
                    rows.append({"model": name, "schedule": sched, "mode": mode, "torch_schedule": baseline[0],
                                 "autotp": ours, "torch": theirs})  # fmt: skip
                    if rank == 0:  # a run stopped by its timeout returns nothing: keep what it measured
                        print(f"rank 0 row: {json.dumps(rows[-1])}", flush=True)
    if profile_dir:
        _profile(models[0], profile_dir, rank)
    return rows


def _cell(r: dict) -> str:
    return f"{r['ms']:8.1f} ms {r['gib']:5.1f} GiB" if "ms" in r else f"{'failed':>21s}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,8b")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,zbh1")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--profile", metavar="DIR", help="profile one autotp 1F1B step per rank into DIR")
    parser.add_argument("--timeout", type=float, default=580, help="seconds before the ranks are stopped (default 580)")
    args = parser.parse_args()
    models, schedules, modes = (a.split(",") for a in (args.models, args.schedules, args.modes))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    per_rank = spawn_ranks(_worker, 2, models, schedules, modes, args.profile, backend="nccl", timeout_s=args.timeout)
    rows = _report(per_rank)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _report(per_rank: list[list[dict]]) -> list[dict]:
    """Print the table of the ranks' rows (slowest rank's time, largest peak); return the rows."""
    rows = []
    for i, row in enumerate(per_rank[0]):
        for side in ("autotp", "torch"):
            for key in ("gib", "ms", "bubble"):
                if key in row[side]:
                    row[side][key] = max(r[i][side][key] for r in per_rank)
        rows.append(row)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"{device} x2, torch {torch.__version__}, pp=2, {MICROBATCHES} microbatches, bf16, "
          f"fwd+bwd, median of {STEPS} steps")  # fmt: skip
    print(f"{'model':6s} {'schedule':11s} {'mode':8s} {'torch (class)':30s} {'torch':>21s} {'autotp':>21s} "
          f"{'speed':>6s} {'mem':>5s} {'loss t/a':>15s} {'MFU':>5s} {'bubble pred/meas':>16s}")  # fmt: skip
    for r in rows:
        a, t = r["autotp"], r["torch"]
        speed = f"{t['ms'] / a['ms']:5.2f}x" if "ms" in a and "ms" in t else "   -  "
        mem = f"{a['gib'] / t['gib']:5.2f}" if a.get("gib") and t.get("gib") else "  -  "
        losses = f"{t.get('loss', float('nan')):7.4f}/{a.get('loss', float('nan')):7.4f}"
        mfu = f"{_flops_per_step(r['model']) / (a['ms'] * 1e-3) / (2 * H200.mfu_flops_per_s):5.1%}" if "ms" in a else "  -  "
        vpp = 2 if r["schedule"] == "interleaved" else 1
        bubble = f"{bubble_fraction(r['schedule'], 2, MICROBATCHES, vpp):.3f}/{a.get('bubble', float('nan')):.3f}"
        print(f"{r['model']:6s} {r['schedule']:11s} {r['mode']:8s} {r['torch_schedule']:30s} {_cell(t)} {_cell(a)} "
              f"{speed} {mem} {losses} {mfu} {bubble:>16s}")  # fmt: skip
        for side in ("torch", "autotp"):
            if "error" in r[side]:
                print(f"    {side}: {r[side]['error']}")
    print("speed = torch time / autotp time (>1: autotp faster); mem = autotp peak / torch peak; bubble = idle over "
          "busy time, predicted by the cost model / measured on autotp's worst rank (one step with device syncs)")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
