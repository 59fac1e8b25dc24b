"""Measure, on one GPU, what the built-in profile's single-GPU constants stand for, and fit them.

    python benchmarks/measure_constants.py --json out.json     # on the GPU: measure (JSON after each part)
    python benchmarks/measure_constants.py --fit out.json      # anywhere: fit, print against the built-in profile

One process (a one-rank NCCL group, as ``autotp calibrate``'s ranks), bf16, each time the median of
repeated calls between device syncs (``autotp.cli.measure._median_s``); GEMMs and attention also as GPU
time alone (``autotp.cli.measure.gpu_time_s``: calls captured in a CUDA graph and replayed between CUDA events), which the fit
takes: the cost model adds the host's cost of issuing a kernel separately (``op_overhead_s``), and
eager timing of a small kernel counts it in the kernel (a 1024³ GEMM read 73 TFLOP/s eager, 352 replayed):

* **GEMMs** of a grid of transformer shapes (tokens M in 1k..16k, K x N from 1k x 1k to 4k x 32k),
  each as a linear runs them: forward ``x @ W^T``, input gradient ``g @ W``, weight gradient
  ``g^T @ x``. The cost model times a GEMM of F FLOPs as ``matmul_time_s(F)`` forward and twice that
  backward, so the curve holds, per FLOP count, the mean of the three; shapes are merged into bins of
  a factor sqrt(2) in FLOPs (geometric means), which keeps the curve increasing.
* **Attention**: ``scaled_dot_product_attention(is_causal=True)`` (what the ``causal_attention`` pass
  runs) over batch 1..8, sequence 1k..4k, 16 heads of 128; FLOPs are those the cost model counts for the node
  (``cost_model.flops.attention_flops``: the causal half of QKᵀ and PV, 2·b·h·s²·d; the fit once halved that
  again, which made every attention kernel cost twice its measured time),
  fitted to ``attention_latency_s + F / attention_flops_per_s`` (``fit_alpha_beta``: the rate alone went
  from 112 to 289 TFLOP/s over these shapes), with the median backward/forward ratio.
* **Memory bandwidth**: an add of 256 MB tensors (3 bytes moved per element byte), and the
  backward/forward ratio of an HF RMSNorm + SwiGLU product (``autotp.cli.measure``).
* **Host costs** the way ``autotp calibrate`` defines them (``cost_model.calibrate.fit_host``: forward and
  forward + backward at 2 and 6 layers, differences per node), on two host-bound models: calibrate's
  ``llama-tiny`` on 16 tokens, and a Llama of width 1024 on 1024 tokens (``HOST_MODEL``), whose tensors are
  of the sizes training runs; the fit takes the second. Both also run through ``train_step`` with 1 and
  4 microbatches, timed with and without the final device sync (host-bound: the two agree); what a
  further microbatch adds beyond its nodes is printed as ``train_step_call_host_s``, a check of
  ``call_host_s``.
* **Host costs under ``compile=True``** (``compiled_host``): ``HOST_MODEL``'s ``train_step`` with 4 microbatches
  of one sequence at 2 and 6 layers; ``compiled_launch_host_s`` is the host time per further kernel, the kernels
  counted as ``cost_model.fused_kernels`` counts them, ``compiled_call_host_s`` what is left per microbatch.
* **Layer time scale** (``compute_time_scale``, ``cost_model.calibrate.fit_compute_time_scale``): a
  GPU-bound Llama of widths no validation workload has (``SCALE``: h=4096, ffn 11008, 4 x 2048 tokens)
  at 2 and 4 layers, one ``train_step`` each (``autotp.cli.measure.layer_runs``; the JSON of 2026-11-25 timed
  ``pm(...).loss.backward()`` instead, a graph that also returns the logits).
* **Optimizer**: ``torch.optim.AdamW(foreach=True)`` on 1.07e9 bf16 parameters in 64 tensors: the bandwidth
  its kernels reach on the bytes ``cost_model.dp_sync.adamw_bytes_per_param`` counts (``optimizer_bytes_per_s``).

``--fit`` turns the JSON into the constants of a ``HardwareProfile`` and prints them beside the
built-in profile of the same GPU; nothing here reads a validation workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from autotp.cost_model import calibrate
from autotp.cost_model.calibrate import llama_config

GEMM_TOKENS = (1024, 2048, 4096, 8192, 16384)
GEMM_KN = ((1024, 1024), (1024, 4096), (4096, 1024), (2048, 2048), (2048, 8192), (8192, 2048), (4096, 4096),
           (4096, 14336), (14336, 4096), (4096, 32000))  # fmt: skip
ATTENTION_SHAPES = tuple((b, 16, s, 128) for b in (1, 2, 4, 8) for s in (1024, 2048, 4096) if b * s <= 16384)
SCALE = {"hidden": 4096, "ffn": 11008, "heads": 32, "kv_heads": 8, "vocab": 8192, "batch": 4, "seq": 2048}
SCALE_LAYERS = (2, 4)
HOST_MODEL = {**calibrate.HOST_MODEL, "batch": 4}  # train_step with 1 and 4 microbatches of one sequence
OPTIMIZER_TENSORS = (64, 4096, 4096)


def _gemms(device: torch.device) -> list[dict]:
    from autotp.cli.measure import gemm_row

    return [gemm_row(m, k, n, device, torch.bfloat16) for m in GEMM_TOKENS for k, n in GEMM_KN]


def _attention(device: torch.device) -> list[dict]:
    from autotp.cli.measure import attention_row

    return [attention_row(shape, device, torch.bfloat16) for shape in ATTENTION_SHAPES]


def _memory(device: torch.device) -> dict[str, float]:
    from autotp.cli.measure import _elementwise_backward_factor, _median_s

    elements = 256 * 2**20 // 2
    x, y, z = (torch.ones(elements, dtype=torch.bfloat16, device=device) for _ in range(3))
    add_s = _median_s(lambda: torch.add(x, y, out=z), device)
    return {"add_bytes": 3 * elements * 2, "add_s": add_s,
            "elementwise_backward_factor": _elementwise_backward_factor(device, torch.bfloat16)}  # fmt: skip


def _timed(fn, device: torch.device, repeats: int = 7) -> tuple[float, float]:
    """Median (host seconds until ``fn`` returns, seconds until the device is done) over ``repeats``, after 2 warm-ups."""
    from autotp.cli.measure import _sync

    hosts, walls = [], []
    for i in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        _sync(device)
        if i >= 2:
            hosts.append(returned - start)
            walls.append(time.perf_counter() - start)
    return statistics.median(hosts), statistics.median(walls)


def _train_step_runs(config: object, batch: int, seq: int, device: torch.device, microbatches: tuple[int, ...],
                     compile: bool = False) -> list[dict]:  # fmt: skip
    """``train_step`` of ``config`` on ``batch`` x ``seq`` tokens with each count of microbatches (``compile``: the rank
    graph under ``torch.compile``): host and wall seconds, and the rank graph's call nodes and autograd nodes."""
    from autotp import parallelize, presets
    from autotp.cost_model.saved_tensors import needs_grad

    torch.manual_seed(0)
    model = presets.build_from_config(config, device=device, dtype=torch.bfloat16)
    ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
    rows = []
    for m in microbatches:
        micro = ids[: batch // m]
        pm = parallelize(model, tp=1, example_inputs={"input_ids": micro, "labels": micro}, compile=compile)
        gm = pm.graph_for(input_ids=micro, labels=micro)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        grads = needs_grad(gm)
        params = list(pm.parameters())

        def step(pm=pm, params=params, m=m) -> None:
            for p in params:
                p.grad = None
            pm.train_step(input_ids=ids, labels=ids, num_microbatches=m)

        host_s, wall_s = _timed(step, device)
        rows.append({"layers": config.num_hidden_layers, "microbatches": m, "host_s": host_s, "wall_s": wall_s,
                     "calls": len(calls), "grad_calls": sum(n in grads for n in calls)})  # fmt: skip
        del pm, gm, params
    return rows


def _host(device: torch.device) -> dict[str, list]:
    from autotp import presets
    from autotp.cli.measure import _tiny_llama

    tiny = [{"tp": 1, "layers": layers, **_tiny_llama(layers, 1, device, torch.bfloat16)} for layers in (2, 6)]
    steps = []
    for layers in (2, 6):
        config = presets.model_config("llama-tiny")
        config.num_hidden_layers = layers
        steps += _train_step_runs(config, 4, 16, device, (1, 4))
    m = HOST_MODEL
    medium = [row for layers in (2, 6) for row in _train_step_runs(llama_config(m, layers), m["batch"], m["seq"], device, (1, 4))]
    sized = [{"tp": 1, "layers": layers, **_tiny_llama(layers, 1, device, torch.bfloat16, llama_config(m, layers), (1, m["seq"]))}
             for layers in (2, 6)]  # fmt: skip
    return {"tiny": tiny, "tiny_train_step": steps, "medium_train_step": medium, "medium": sized}


def _compiled_host(device: torch.device) -> list[dict]:
    """``HOST_MODEL``'s ``train_step`` under ``compile=True``, 4 microbatches of one sequence, at 2 and 6 layers."""
    m = HOST_MODEL
    return [row for layers in (2, 6) for row in _train_step_runs(llama_config(m, layers), m["batch"], m["seq"], device, (4,), True)]


def _layers(device: torch.device) -> list[dict]:
    from autotp.cli.measure import layer_runs

    return layer_runs(lambda layers: llama_config(SCALE, layers), SCALE_LAYERS, (SCALE["batch"], SCALE["seq"]), device, torch.bfloat16)


def _optimizer(device: torch.device) -> dict[str, float]:
    count, rows, cols = OPTIMIZER_TENSORS
    params = [torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.bfloat16, device=device)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    host_s, wall_s = _timed(optimizer.step, device)
    return {"params": count * rows * cols, "tensors": count, "host_s": host_s, "wall_s": wall_s}


PARTS = {"gemm": _gemms, "attention": _attention, "memory": _memory, "optimizer": _optimizer, "host": _host,
         "compiled_host": _compiled_host, "layers": _layers}


def _worker(rank: int, world: int, path: str, parts: tuple[str, ...]) -> dict:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    out: dict = {"device_name": torch.cuda.get_device_name(device), "setup": f"torch {torch.__version__}, "
                 f"{datetime.date.today().isoformat()}", "command": "python benchmarks/measure_constants.py --json"}  # fmt: skip
    if Path(path).exists():  # a run of other parts on this machine: keep them
        out = {**json.loads(Path(path).read_text()), **out}
    for name in parts:
        part = PARTS[name]
        start = time.perf_counter()
        out[name] = part(device)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        dist.barrier()
        torch.cuda.empty_cache()
        Path(path).write_text(json.dumps(out, indent=1))
    return out


def fit(measured: dict) -> dict[str, object]:
    """The profile constants of one ``--json`` measurement (module docstring)."""
    from autotp.cost_model.calibrate import fit_attention, fit_host, gemm_curve
    from autotp.cost_model.dp_sync import adamw_bytes_per_param
    from autotp.cost_model.hardware import HardwareProfile, fit_alpha_beta, profile_for_gpu

    curve = gemm_curve(measured["gemm"])
    latency, rate = fit_alpha_beta([f for f, _ in curve], [s for _, s in curve])
    memory = measured["memory"]
    host = fit_host(measured["host"].get("medium") or measured["host"]["tiny"])
    sized = "medium" in measured["host"]  # the probe of realistic widths, where measured
    steps = measured["host"]["medium_train_step" if sized else "tiny_train_step"]
    per_microbatch = _per_microbatch(steps)
    small = min((r for r in steps if r["microbatches"] == 1), key=lambda r: r["layers"])
    constants: dict[str, object] = {
        "matmul_curve": curve,
        "matmul_flops_per_s": rate,
        "matmul_latency_s": latency,
        **fit_attention(measured["attention"]),
        "memory_bytes_per_s": memory["add_bytes"] / memory["add_s"],
        "elementwise_backward_factor": memory["elementwise_backward_factor"],
        "optimizer_bytes_per_s": adamw_bytes_per_param("bf16-pure") * measured["optimizer"]["params"] / measured["optimizer"]["wall_s"],
        **host,
        "train_step_call_host_s": per_microbatch - small["calls"] * host["op_overhead_s"]
        - small["grad_calls"] * host["backward_op_overhead_s"],
    }
    base = profile_for_gpu(measured["device_name"])
    profile = dataclasses.replace(base, **{k: v for k, v in constants.items() if k in HardwareProfile.__dataclass_fields__})
    constants["compute_time_scale"] = _scale(profile, measured["layers"])
    if "compiled_host" in measured:
        constants.update(_compiled_host_fit(measured["compiled_host"]))
    return constants


def _compiled_host_fit(rows: list[dict]) -> dict[str, float]:
    """``compiled_launch_host_s``: host seconds per further kernel between the 2- and 6-layer runs, the kernels
    counted as the cost model counts them (``fused_kernels``); ``compiled_call_host_s``: what they leave of a
    microbatch of the 2-layer run."""
    kernels = {r["layers"]: r["microbatches"] * _compiled_kernels(r["layers"]) for r in rows}
    small, large = min(rows, key=lambda r: r["layers"]), max(rows, key=lambda r: r["layers"])
    launch = (large["host_s"] - small["host_s"]) / (kernels[large["layers"]] - kernels[small["layers"]])
    call = (small["host_s"] - kernels[small["layers"]] * launch) / small["microbatches"]
    return {"compiled_launch_host_s": launch, "compiled_call_host_s": call}


def _compiled_kernels(layers: int) -> float:
    """Kernels one microbatch of ``HOST_MODEL`` at ``layers`` launches forward and backward under ``compile=True``."""
    from autotp.compiler import trace_for_planning
    from autotp.cost_model.compute import compiled_launches

    m = HOST_MODEL
    costs = trace_for_planning(llama_config(m, layers), m["seq"], dtype=torch.bfloat16)
    rank = costs.rank(1, compiled=True)
    layer_list = [rank.layers[costs.traced_index(i)] for i in range(costs.num_layers)]
    return sum(float(sum(a.sum() for a in compiled_launches(seg)[0])) for seg in (rank.preamble, rank.embedding, *layer_list, rank.head))


def _per_microbatch(rows: list[dict]) -> float:
    """Host seconds ``train_step`` adds per further microbatch of the smaller model."""
    small = min(r["layers"] for r in rows)
    by_m = {r["microbatches"]: r["host_s"] for r in rows if r["layers"] == small}
    return (by_m[max(by_m)] - by_m[min(by_m)]) / (max(by_m) - min(by_m))


def _scale(profile, runs: list[dict]) -> float:
    """``fit_compute_time_scale`` on ``SCALE``'s layer runs (one traced layer at tp 1)."""
    from autotp.compiler import trace_for_planning
    from autotp.cost_model.calibrate import fit_compute_time_scale

    layer = trace_for_planning(llama_config(SCALE, 1), SCALE["seq"], dtype=torch.bfloat16).rank(1).layers[0]
    return fit_compute_time_scale(profile, runs, layer, SCALE["batch"])


def report(measured: dict) -> str:
    from autotp.cost_model.hardware import profile_for_gpu

    constants = fit(measured)
    base = profile_for_gpu(measured["device_name"])
    lines = [f"{measured['device_name']}, {measured['setup']}", f"{'constant':30s} {'measured':>14s} {'built-in':>14s}"]
    for key, value in constants.items():
        if key == "matmul_curve":
            continue
        builtin = getattr(base, key, float("nan"))
        lines.append(f"{key:30s} {value:>14.4g} {builtin:>14.4g}")
    lines.append("GEMM curve (TFLOP/s per bin): " + ", ".join(f"{f / 1e9:.0f} GF {f / s / 1e12:.0f}" for f, s in constants["matmul_curve"]))
    for r in measured.get("compiled_host", []):
        lines.append(f"compiled train_step {r['layers']} layers m{r['microbatches']}: host {r['host_s'] * 1e3:.2f} ms, "
                     f"wall {r['wall_s'] * 1e3:.2f} ms, {_compiled_kernels(r['layers']):.0f} kernels per microbatch")
    for probe in ("tiny_train_step", "medium_train_step"):
        for r in measured["host"][probe]:
            lines.append(f"{probe} {r['layers']} layers m{r['microbatches']}: host {r['host_s'] * 1e3:.2f} ms, wall {r['wall_s'] * 1e3:.2f} ms, "
                         f"{r['calls']} nodes, {r['grad_calls']} autograd")  # fmt: skip
    o = measured["optimizer"]
    lines.append(f"AdamW {o['params'] / 1e9:.2f}e9 bf16 params: {o['wall_s'] * 1e3:.1f} ms ({o['host_s'] * 1e3:.1f} ms host)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="measure on this machine's first GPU and write the measurements here")
    parser.add_argument("--fit", type=Path, help="fit and print the constants of an earlier --json")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                        help="measure these parts only, keeping the others of an existing --json (default: all)")
    args = parser.parse_args()
    if args.json:
        from autotp.runtime.processes.launcher import spawn_ranks

        spawn_ranks(_worker, 1, str(args.json), tuple(args.parts), backend="nccl", timeout_s=900)
        print(report(json.loads(args.json.read_text())))
    elif args.fit:
        print(report(json.loads(args.fit.read_text())))
    else:
        parser.error("give --json (measure) or --fit (fit a measurement)")


if __name__ == "__main__":
    main()
