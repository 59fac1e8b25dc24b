"""Cost-model accuracy: predicted against measured ``train_step`` time, after calibration.

One run calibrates the GPUs (``autotp.cli.measure``), measures
``autotp.parallelize(...).train_step(...)`` for every configuration in ``RUNS`` (1, 2
and 4 GPUs, tp/pp/dp/interleaved mixes, two Llama-shaped models, two global batches;
bf16, NCCL, median of timed steps after warm-up), then predicts each with the planner's
``estimate`` on the calibrated profile and prints predicted, measured, the error, the
MAPE, and per group of alternatives (same model, batch and GPUs) whether the plan the
planner ranks first is within 5% of the fastest measured one:

    python benchmarks/bench_cost_model.py [--json out.json]       # on a 4-GPU machine
    python benchmarks/bench_cost_model.py --cpu                    # smoke run: gloo, tiny models
    python benchmarks/bench_cost_model.py --measured out.json      # re-predict saved measurements
    python benchmarks/bench_cost_model.py --validate [--top 4]     # held-out check, on a 2-GPU machine
    python benchmarks/bench_cost_model.py --validate --compile     # the same, ranks under torch.compile
    python benchmarks/bench_cost_model.py --repredict h100 saved.json  # re-predict a saved --validate run (CPU)

``--validate`` keeps fitting and validation apart: it plans models and batches that no
constant was fitted on (``VALIDATION``: neither the calibration's models nor ``RUNS``)
with the built-in profile (uncalibrated), runs the top plans as a user would
(``parallelize(plan=...)``, ``train_step`` with the plan's microbatches and schedule,
``torch.optim.AdamW`` step), calibrates the same machine, predicts the same plans with
the calibrated profile, and prints predicted against measured time (optimizer included)
and peak memory, both MAPEs, and whether the top plan is within 3% of the fastest.

``train_step`` does not step the optimizer, so the prediction is the estimate's step
time minus its optimizer time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from autotp.cli.measure import calibrate, fitted_profile
from autotp.compiler import trace_for_planning
from autotp.cost_model.calibrate import describe
from autotp.cost_model.hardware import HardwareProfile
from autotp.cost_model.planner import (
    Cluster,
    Config,
    Training,
    estimate,
)
from transformers import LlamaConfig

from autotp.runtime.processes.launcher import spawn_ranks
from autotp.runtime.execution.live_memory import PeakLiveBytes

GPUS_PER_NODE = 4
WARMUP, STEPS = 3, 10
MODELS = {  # name: (hidden, intermediate, layers, heads, kv heads, vocab, seq)
    "llama-0.2b": (1024, 2816, 8, 16, 8, 32000, 1024),
    "llama-1b": (2048, 5632, 16, 16, 8, 32000, 1024),
}
# Held out: not a calibration model (llama-tiny, calibrate.SCALE_MODEL) and not in RUNS.
VALIDATION = {  # name: (dims as in MODELS, global batch)
    "llama-8bw-8l": ((4096, 14336, 8, 32, 8, 32000, 2048), 8),
    "llama-3bw-12l": ((3072, 8192, 12, 24, 8, 50304, 1024), 16),
    "llama-2.5kw-8l-152k": ((2560, 6912, 8, 20, 4, 151936, 1024), 8),  # widths and a vocabulary no run was fitted on
    "llama-1.5kw-12l-100k": ((1536, 4096, 12, 12, 4, 100352, 2048), 8),  # other widths, vocabulary and sequence
}
CPU_VALIDATION = {"tiny-c": ((96, 192, 4, 4, 2, 384, 48), 8)}
CPU_MODELS = {
    "tiny-a": (64, 128, 2, 4, 2, 512, 64),
    "tiny-b": (128, 256, 4, 4, 2, 512, 64),
}


@dataclass(frozen=True)
class Run:
    model: str
    gpus: int
    tp: int
    pp: int
    vpp: int
    microbatches: int
    global_batch: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}" * (self.tp > 1), f"pp{self.pp}" * (self.pp > 1), f"vpp{self.vpp}" * (self.vpp > 1), f"dp{self.dp}" * (self.dp > 1)]
        return "-".join(p for p in parts if p) or "1gpu"


RUNS = [
    Run("llama-0.2b", 1, 1, 1, 1, 1, 8),
    Run("llama-1b", 1, 1, 1, 1, 1, 8),
    Run("llama-1b", 1, 1, 1, 1, 2, 16),
    Run("llama-0.2b", 2, 2, 1, 1, 1, 8),
    Run("llama-1b", 2, 2, 1, 1, 1, 16),
    Run("llama-1b", 2, 1, 2, 1, 4, 16),
    Run("llama-1b", 2, 1, 1, 1, 1, 16),
    Run("llama-0.2b", 4, 4, 1, 1, 1, 8),
    Run("llama-1b", 4, 4, 1, 1, 1, 16),
    Run("llama-1b", 4, 2, 2, 1, 4, 16),
    Run("llama-1b", 4, 1, 4, 1, 8, 16),
    Run("llama-1b", 4, 1, 4, 2, 8, 16),
    Run("llama-1b", 4, 2, 1, 1, 1, 16),
    Run("llama-1b", 4, 1, 1, 1, 1, 16),
]
CPU_RUNS = [
    Run("tiny-a", 1, 1, 1, 1, 1, 4),
    Run("tiny-b", 1, 1, 1, 1, 2, 8),
    Run("tiny-b", 2, 2, 1, 1, 1, 8),
    Run("tiny-b", 2, 1, 2, 1, 2, 8),
    Run("tiny-b", 2, 1, 1, 1, 1, 8),
    Run("tiny-a", 2, 2, 1, 1, 1, 4),
]


def model_config(dims: tuple[int, ...]) -> LlamaConfig:
    hidden, intermediate, layers, heads, kv, vocab, seq = dims
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)


def build_model(dims: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The Llama of ``dims`` with HF's random initialization, built on ``device``. Not ``to_empty``: uninitialized
    memory is mostly zeros, and GEMMs on zeros draw less power, so a power-limited GPU runs them faster than on
    the weights anyone trains (on one H100 the 8B-width step's GEMMs ran at 934 TFLOP/s, random data at ~700)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(model_config(dims)).to(dtype)


def _worker(rank: int, world: int, runs: list[Run], models: dict[str, tuple[int, ...]]) -> list[dict]:
    from transformers.utils import logging

    import autotp

    logging.set_verbosity_error()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    results = []
    for run in runs:
        dims = models[run.model]
        model = build_model(dims, device, dtype).eval()
        ids = torch.randint(0, dims[5], (run.global_batch, dims[6]), generator=torch.Generator().manual_seed(0)).to(device)
        micro = ids[: run.global_batch // (run.dp * run.microbatches)]
        pm = autotp.parallelize(model, tp=run.tp, pp=run.pp, vpp=run.vpp, example_inputs={"input_ids": micro, "labels": micro})
        del model
        times = []
        for step in range(WARMUP + STEPS):
            dist.barrier()
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = pm.train_step(input_ids=ids, labels=ids, num_microbatches=run.microbatches)
            if on_gpu:
                torch.cuda.synchronize()
            if step >= WARMUP:
                times.append(time.perf_counter() - start)
            for p in pm.parameters():
                p.grad = None
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0
        results.append({**asdict(run), "measured_s": statistics.median(times), "peak_gib": peak, "loss": loss.item()})
        del pm
        gc.collect()  # the runtime's fx graphs are reference cycles holding the parameters: free them before the next run
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return results


def measure(runs: list[Run], models: dict[str, tuple[int, ...]], backend: str, save: Callable[[list[dict]], None]) -> list[dict]:
    """Measure every run, the largest world first; ``save`` gets the rows so far after each world."""
    rows: list[dict] = []
    for world in sorted({r.gpus for r in runs}, reverse=True):
        mine = [r for r in runs if r.gpus == world]
        per_rank = spawn_ranks(_worker, world, mine, models, backend=backend, timeout_s=900)
        for i, row in enumerate(per_rank[0]):
            rows.append({**row, "measured_s": max(r[i]["measured_s"] for r in per_rank), "peak_gib": max(r[i]["peak_gib"] for r in per_rank)})
            print(f"measured {row['model']} on {world}: {Run(**{k: row[k] for k in Run.__dataclass_fields__}).name}, "
                  f"{rows[-1]['measured_s'] * 1e3:.1f} ms", flush=True)
        save(rows)
    return rows


def predict(rows: list[dict], models: dict[str, tuple[int, ...]], profile: HardwareProfile, cpu: bool) -> list[dict]:
    dtype = torch.float32 if cpu else torch.bfloat16
    costs = {name: trace_for_planning(model_config(dims), dims[6], dtype=dtype) for name, dims in models.items()}
    out = []
    for row in rows:
        run = Run(**{k: row[k] for k in Run.__dataclass_fields__})
        config = Config(run.tp, run.pp, run.dp, run.vpp, run.global_batch // (run.dp * run.microbatches), run.microbatches)
        training = Training(run.global_batch, "fp32" if cpu else "bf16-pure", gather_outputs=True)
        est = estimate(costs[run.model], Cluster(run.gpus, min(run.gpus, GPUS_PER_NODE), profile), training, config)
        predicted = est.step_s - est.optimizer_s
        out.append({**row, "name": run.name, "predicted_s": predicted, "error": predicted / row["measured_s"] - 1,
                    "predicted_gib": est.mem_bytes_per_gpu / 2**30})
    return out


def report(rows: list[dict]) -> str:
    lines = [
        (
            f"{'model':11s} {'gpus':>4s} {'config':14s} {'B':>3s} {'m':>2s} {'predicted ms':>12s} {'measured ms':>11s} "
            f"{'error':>7s} {'peak GiB':>8s} {'pred GiB*':>9s}"
        )
    ]
    for r in rows:
        lines.append(f"{r['model']:11s} {r['gpus']:>4d} {r['name']:14s} {r['global_batch']:>3d} {r['microbatches']:>2d} "
                     f"{r['predicted_s'] * 1e3:>12.1f} {r['measured_s'] * 1e3:>11.1f} {r['error']:>+7.1%} "
                     f"{r['peak_gib']:>8.1f} {r['predicted_gib']:>9.1f}")
    mape = statistics.mean(abs(r["error"]) for r in rows)
    lines.append(f"MAPE {mape:.1%} over {len(rows)} configurations (* predicted memory includes AdamW states, which train_step does not allocate)")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["gpus"], r["global_batch"]), []).append(r)
    for (model, gpus, batch), members in groups.items():
        if len(members) < 2:
            continue
        chosen = min(members, key=lambda r: r["predicted_s"])
        fastest = min(members, key=lambda r: r["measured_s"])
        gap = chosen["measured_s"] / fastest["measured_s"] - 1
        lines.append(f"top plan, {model} on {gpus} GPUs, batch {batch}: predicted best {chosen['name']} measures "
                     f"{gap:+.1%} against the fastest ({fastest['name']}): {'within' if gap <= 0.05 else 'NOT within'} 5%")
    return "\n".join(lines)


def _validate_worker(rank: int, world: int, dims: tuple[int, ...], global_batch: int, plans: list,
                     snapshots: Path | None = None, compile: bool = False) -> list[dict]:  # fmt: skip
    from transformers.utils import logging

    import autotp

    logging.set_verbosity_error()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    ids = torch.randint(0, dims[5], (global_batch, dims[6]), generator=torch.Generator().manual_seed(0)).to(device)
    results = []
    for plan in plans:
        model = build_model(dims, device, dtype)
        micro = ids[: plan.microbatch_size]
        pm = autotp.parallelize(model, tp=plan.tp, pp=plan.pp, dp=plan.dp, vpp=plan.vpp, plan=plan,
                                example_inputs={"input_ids": micro, "labels": micro}, compile=compile)
        del model
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-5, foreach=True)  # foreach: the GPU default, also on CPU
        times, train_peak = [], 0.0
        tracker = contextlib.nullcontext() if on_gpu else PeakLiveBytes()  # CPU: peak live tensor bytes
        if snapshots and on_gpu:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with tracker:
            for step in range(WARMUP + STEPS):
                dist.barrier()
                _sync(on_gpu)
                start = time.perf_counter()
                pm.train_step(input_ids=ids, labels=ids)
                if step == 0:
                    train_peak = (torch.cuda.max_memory_allocated() if on_gpu else tracker.peak) / 2**30
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                _sync(on_gpu)
                if step >= WARMUP:
                    times.append(time.perf_counter() - start)
        peak = (torch.cuda.max_memory_allocated() if on_gpu else tracker.peak) / 2**30
        results.append({"measured_s": statistics.median(times), "peak_gib": peak, "train_step_peak_gib": train_peak})
        if snapshots and on_gpu:  # what was alive at the peak: drag onto https://pytorch.org/memory_viz
            snapshots.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snapshots / f"dims{dims[0]}x{dims[2]}-plan{len(results)}-rank{rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        del pm, optimizer
        gc.collect()  # the runtime's fx graphs are reference cycles holding the parameters: free them before the next run
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return results


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def validate(cpu: bool, top: int, json_path: Path | None, gpus: int, snapshots: Path | None = None,
             names: list[str] | None = None, compile: bool = False) -> None:  # fmt: skip
    """Plan each held-out workload (those of ``names``, default all) uncalibrated, run its top plans (``compile``:
    under ``torch.compile``, planned as such), then calibrate and re-predict. ``json_path`` gets the measurements
    after each workload."""
    from autotp.cost_model.candidates import Config
    from autotp.cost_model.hardware import get_profile
    from autotp.cost_model.planner import plan as rank_plans

    workloads = CPU_VALIDATION if cpu else VALIDATION
    workloads = {k: v for k, v in workloads.items() if names is None or k in names}
    setup = f"torch {torch.__version__}, {datetime.date.today().isoformat()}" + ", compile=True" * compile
    dtype, precision = (torch.float32, "fp32") if cpu else (torch.bfloat16, "bf16-pure")
    builtin = get_profile("cpu" if cpu else _builtin_name(), calibrated=False)
    rows: list[dict] = []
    for name, (dims, global_batch) in workloads.items():
        costs = trace_for_planning(model_config(dims), dims[6], dtype=dtype)
        training = Training(global_batch, precision, gather_outputs=True, compiled=compile)
        planned = rank_plans(costs, Cluster(gpus, gpus, builtin), training, top=top)
        measured = spawn_ranks(_validate_worker, gpus, dims, global_batch, [p.plan for p in planned], snapshots, compile,
                               backend="gloo" if cpu else "nccl", timeout_s=1200)
        for i, p in enumerate(planned):
            m = max(measured, key=lambda r: r[i]["measured_s"])[i]
            config = Config(p.plan.tp, p.plan.pp, p.plan.dp, p.plan.vpp, p.microbatch_size, p.microbatches)
            rows.append({"model": name, "rank": i + 1, "config": asdict(config), "compiled": compile,
                         "sequence_parallel": p.plan.sequence_parallel,
                         "tp_overlap": list(p.plan.tp_overlap), "predicted_s": p.step_s,
                         "predicted_gib": p.mem_bytes_per_gpu / 2**30, "measured_s": m["measured_s"],
                         "peak_gib": max(r[i]["peak_gib"] for r in measured),
                         "train_step_peak_gib": max(r[i]["train_step_peak_gib"] for r in measured)})
            print(f"measured {name} plan {i + 1} ({_config_name(config, p.plan.sequence_parallel, p.plan.tp_overlap)}): {m['measured_s'] * 1e3:.1f} ms, peak "
                  f"{rows[-1]['peak_gib']:.1f} GiB ({rows[-1]['train_step_peak_gib']:.1f} before the optimizer's first step)", flush=True)
        if json_path:
            _write(json_path, {"setup": setup, "rows": rows})
    calibration: dict = {}
    if gpus >= 2:  # calibration measures collectives between ranks
        _, calibration = calibrate(gpus)
        calibrated = fitted_profile(calibration, gpus)
    for name, (dims, global_batch) in workloads.items():
        costs = trace_for_planning(model_config(dims), dims[6], dtype=dtype)
        for row in (r for r in rows if r["model"] == name):
            training = Training(global_batch, precision, gather_outputs=True, compiled=compile)
            row["calibrated_s"] = estimate(costs, Cluster(gpus, gpus, calibrated), training, Config(**row["config"]),
                                           sequence_parallel=row["sequence_parallel"],
                                           tp_overlap=tuple(row["tp_overlap"])).step_s if calibration else float("nan")  # fmt: skip
    print(validation_report(rows, builtin.name, calibrated.name if calibration else "no calibration (one rank)"))
    if json_path:
        _write(json_path, {"setup": setup, "calibration": calibration, "rows": rows})


def repredict(profile_name: str, path: Path) -> None:
    """Predict the rows of a saved ``--validate`` run again with today's cost model and the built-in profile
    ``profile_name`` (the measurements stay as saved: nothing is fitted to them), beside the saved prediction."""
    from autotp.cost_model.candidates import Config
    from autotp.cost_model.hardware import get_profile

    saved = json.loads(path.read_text())
    builtin = get_profile(profile_name, calibrated=False)
    gpus = max(Config(**r["config"]).tp * Config(**r["config"]).pp * Config(**r["config"]).dp for r in saved["rows"])
    lines = [f"{path.name}: {gpus} x {builtin.name}, measured {saved['setup']}",
             f"{'model':20s} {'plan':22s} {'saved ms':>9s} {'now ms':>8s} {'measured ms':>11s} {'err saved':>9s} {'err now':>8s}"]
    errors: list[tuple[float, float]] = []
    for name in dict.fromkeys(r["model"] for r in saved["rows"]):
        dims, global_batch = VALIDATION[name]
        costs = trace_for_planning(model_config(dims), dims[6], dtype=torch.bfloat16)
        for row in (r for r in saved["rows"] if r["model"] == name):
            config = Config(**row["config"])
            sp, overlap = row.get("sequence_parallel", False), tuple(row.get("tp_overlap", ()))
            training = Training(global_batch, "bf16-pure", gather_outputs=True, compiled=row.get("compiled", False))
            now = estimate(costs, Cluster(gpus, gpus, builtin), training, config, sequence_parallel=sp, tp_overlap=overlap).step_s
            errors.append((row["predicted_s"] / row["measured_s"] - 1, now / row["measured_s"] - 1))
            lines.append(f"{name:20s} {_config_name(config, sp, overlap):22s} {row['predicted_s'] * 1e3:>9.1f} {now * 1e3:>8.1f} "
                         f"{row['measured_s'] * 1e3:>11.1f} {errors[-1][0]:>+9.1%} {errors[-1][1]:>+8.1%}")
    lines.append(f"time MAPE: saved {statistics.mean(abs(e) for e, _ in errors):.1%}, now {statistics.mean(abs(e) for _, e in errors):.1%}")
    print("\n".join(lines), flush=True)


def _builtin_name() -> str:
    from autotp.cost_model.hardware import PROFILES, profile_for_gpu

    profile = profile_for_gpu(torch.cuda.get_device_name(0))
    return next(key for key, p in PROFILES.items() if p is profile) if profile else "h100"


def _config_name(c, sequence_parallel: bool = False, tp_overlap: tuple | list = ()) -> str:
    parts = [f"tp{c.tp}" * (c.tp > 1), f"pp{c.pp}" * (c.pp > 1), f"vpp{c.vpp}" * (c.vpp > 1), f"dp{c.dp}" * (c.dp > 1)]
    sp = " sp" * sequence_parallel + "+ov" * bool(tp_overlap)
    return "-".join(p for p in parts if p) + f" mbs{c.microbatch_size} m{c.microbatches}{sp}"


def validation_report(rows: list[dict], builtin: str, calibrated: str) -> str:
    """Predicted (built-in and calibrated) against measured step time and memory, MAPEs and the top plan's gap."""
    from autotp.cost_model.candidates import Config

    lines = [f"{'model':14s} {'#':>2s} {'plan':22s} {'builtin ms':>10s} {'calib ms':>9s} {'measured ms':>11s} "
             f"{'err':>7s} {'err cal':>7s} {'pred GiB':>8s} {'peak GiB':>8s} {'err':>7s}"]
    for r in rows:
        err, err_cal = r["predicted_s"] / r["measured_s"] - 1, r["calibrated_s"] / r["measured_s"] - 1
        mem_err = r["predicted_gib"] / r["peak_gib"] - 1 if r["peak_gib"] else float("nan")
        lines.append(f"{r['model']:14s} {r['rank']:>2d} {_config_name(Config(**r['config']), r.get('sequence_parallel', False), r.get('tp_overlap', ())):22s} {r['predicted_s'] * 1e3:>10.1f} "
                     f"{r['calibrated_s'] * 1e3:>9.1f} {r['measured_s'] * 1e3:>11.1f} {err:>+7.1%} {err_cal:>+7.1%} "
                     f"{r['predicted_gib']:>8.1f} {r['peak_gib']:>8.1f} {mem_err:>+7.1%}")
    mape = statistics.mean(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows)
    mape_cal = statistics.mean(abs(r["calibrated_s"] / r["measured_s"] - 1) for r in rows)
    lines.append(f"time MAPE: {mape:.1%} with the built-in {builtin} profile (uncalibrated), {mape_cal:.1%} with {calibrated}")
    with_memory = [r for r in rows if r["peak_gib"]]
    if with_memory:
        lines.append(f"memory MAPE: {statistics.mean(abs(r['predicted_gib'] / r['peak_gib'] - 1) for r in with_memory):.1%} "
                     "(peak torch.cuda.max_memory_allocated, or on CPU autotp.runtime.execution.live_memory.PeakLiveBytes; AdamW states included)")
    for model in dict.fromkeys(r["model"] for r in rows):
        members = [r for r in rows if r["model"] == model]
        fastest = min(members, key=lambda r: r["measured_s"])
        gap = members[0]["measured_s"] / fastest["measured_s"] - 1
        lines.append(f"top plan of {model} measures {gap:+.1%} against the fastest measured ({fastest['rank']}): "
                     f"{'within' if gap <= 0.03 else 'NOT within'} 3%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write calibration, measurements and predictions here")
    parser.add_argument("--cpu", action="store_true", help="gloo ranks and tiny models (a smoke run of this script)")
    parser.add_argument("--measured", type=Path, help="re-predict the measurements of an earlier --json instead of measuring")
    parser.add_argument("--validate", action="store_true", help="held-out validation (see above) on 2 ranks")
    parser.add_argument("--top", type=int, default=4, help="plans per held-out workload to run (default: 4)")
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the held-out validation (default: 2)")
    parser.add_argument("--memory-snapshots", type=Path, help="--validate on GPUs: dump a CUDA memory snapshot per plan and rank here")
    parser.add_argument("--workloads", nargs="+", choices=list(VALIDATION), help="--validate: these held-out workloads only")
    parser.add_argument("--compile", action="store_true", help="--validate: plan and run the ranks with compile=True")
    parser.add_argument("--repredict", nargs=2, metavar=("PROFILE", "JSON"), help="re-predict a saved --validate run")
    args = parser.parse_args()
    if args.repredict:
        repredict(args.repredict[0], Path(args.repredict[1]))
        return
    if args.validate:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        validate(args.cpu or not torch.cuda.is_available(), args.top, args.json, args.gpus, args.memory_snapshots, args.workloads,
                 args.compile)  # fmt: skip
        return
    if args.measured:
        saved = json.loads(args.measured.read_text())
        cpu, calibration, rows = saved["cpu"], saved["calibration"], saved["runs"]
        calibrated_on, setup = saved["calibrated_ranks"], saved["setup"]
    else:
        cpu = args.cpu or not torch.cuda.is_available()
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        start = time.perf_counter()
        calibrated_on = 2 if cpu else torch.cuda.device_count()
        _, calibration = calibrate(calibrated_on)
        calibrated_at = time.perf_counter()
        print(f"calibration {calibrated_at - start:.0f} s", flush=True)
        setup = f"torch {torch.__version__}, {datetime.date.today().isoformat()}" + ", compile=True" * compile

        def save(rows: list[dict]) -> None:
            if args.json:
                _write(args.json, {"cpu": cpu, "calibrated_ranks": calibrated_on, "setup": setup, "calibration": calibration, "runs": rows})

        rows = measure(CPU_RUNS if cpu else RUNS, CPU_MODELS if cpu else MODELS, "gloo" if cpu else "nccl", save)
        print(f"measurements {time.perf_counter() - calibrated_at:.0f} s")
    profile = fitted_profile(calibration, calibrated_on)
    print(describe(profile, calibration))
    rows = predict(rows, CPU_MODELS if cpu else MODELS, profile, cpu)
    print(f"{calibrated_on} x {calibration['device_name']}, {setup}")
    print(report(rows))
    if args.json:
        _write(args.json, {"cpu": cpu, "calibrated_ranks": calibrated_on, "setup": setup, "calibration": calibration, "runs": rows})


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
