"""``autotp calibrate``: measure this machine and write a ``HardwareProfile`` as JSON.

One process per GPU (NCCL; on a machine without GPUs, ranks on the CPU with gloo)
measures, each time as the median of repeated calls between device syncs:

* all-reduce of 64 KB .. 256 MB (4 KB .. 16 MB on CPU) over the first 2 ranks and over
  all of them, fitted jointly to ``time = alpha + 2(t-1)/t · n / B``
  (``fit_alpha_beta``): ``intra_node``;
* point-to-point send/receive between ranks 0 and 1 (half a round trip), fitted to
  ``alpha + n / B``: ``p2p``;
* on rank 0: GEMMs of transformer shapes (tokens x k @ k x n; bf16 on GPU, fp32 on CPU),
  kept as ``matmul_curve`` and fitted to ``matmul_latency + FLOPs / rate``; an
  elementwise add of large tensors (3 bytes moved per element byte) for the memory
  bandwidth; an HF-style RMSNorm and SwiGLU product, forward and backward, for the
  backward/forward ratio of eager memory-bound ops; ``scaled_dot_product_attention``
  with an explicit mask, as HF calls it, forward and backward, for the attention rate
  and backward factor;
* on every rank at once (ranks share the host, as in training): host costs of eager
  execution, from ``llama-tiny`` parallelized by autotp with L1 = 2 and L2 = 6 layers,
  at tp 1 and tp = all ranks, forward and forward + backward on one 16-token sequence
  (its GPU work is negligible, so the wall time is the host's). Differences between
  the two layer counts cancel the fixed costs of a call (embedding, loss, output
  structures, starting the autograd engine) and leave what a layer's nodes cost
  (``fit_host``): with ΔT the time difference and ΔN the node-count difference,
  ``op_overhead_s = ΔT_fwd / ΔN_calls`` and ``backward_op_overhead_s =
  (ΔT_both - ΔT_fwd) / ΔN_grad`` at tp 1; at tp t the layers also hold ΔN_g forward
  and ΔN_f backward collectives, and ``collective_host_s = (ΔT_both - (ΔN_calls -
  ΔN_g)·op_overhead_s - (ΔN_grad - ΔN_f)·backward_op_overhead_s) / (ΔN_g + ΔN_f)``.
  What the nodes do not explain is the fixed cost of a call: ``call_host_s = T_both -
  N_calls·op_overhead_s - N_grad·backward_op_overhead_s`` of the smaller model at tp 1.
* on every GPU at once (not on CPU ranks, where it stays 1): ``compute_time_scale``,
  from a GPU-bound Llama of a shape no benchmark uses (``SCALE_MODEL``: h=2560, 8 x 2048
  tokens), parallelized by autotp at tp 1 with 2 and 4 layers, forward + backward. The
  time difference over the layer difference is what one decoder layer takes;
  ``fit_compute_time_scale`` finds the scale of the roofline GPU times at which
  ``compute.segment_time`` of that traced layer, host queue included, predicts it
  (bisection: the prediction grows with the scale).

The peak FLOP/s (for MFU) and the inter-node link cannot be measured on one node: they
come from the built-in profile of the same GPU, and the profile's ``source`` says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from autotp.cost_model.communication import p2p_s, ring_all_reduce_s
from autotp.cost_model.compute import needs_grad, segment_time
from autotp.cost_model.hardware import (
    CPU,
    H100,
    HardwareProfile,
    Link,
    fit_alpha_beta,
    profile_for_gpu,
    save_profile,
)
from autotp.cost_model.planner import trace_for_planning
from transformers import LlamaConfig

from autotp import presets
from autotp.ir import ops
from autotp.api import parallelize
from autotp.runtime.launcher import spawn_ranks

MESSAGE_BYTES = {"cuda": tuple(2**k for k in range(16, 29, 2)), "cpu": tuple(2**k for k in range(12, 25, 2))}
GEMM_SHAPES = {  # (tokens, k, n)
    "cuda": tuple((m, k, n) for m in (1024, 4096, 16384) for k, n in ((1024, 1024), (2048, 2048), (4096, 4096), (2048, 8192), (8192, 2048))),
    "cpu": tuple((m, k, n) for m in (64, 256) for k, n in ((64, 64), (256, 256), (256, 1024))),
}
ELEMENTWISE_SHAPE = {"cuda": (16384, 4096), "cpu": (1024, 256)}
HOST_LAYERS, HOST_TOKENS = (2, 6), 16
SCALE_MODEL = {"hidden": 2560, "ffn": 6912, "heads": 20, "kv_heads": 4, "vocab": 8192, "batch": 8, "seq": 2048}
SCALE_LAYERS = (2, 4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: torch.device, repeats: int = 5, inner: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls (after one warm-up)."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _collectives(rank: int, world: int, device: torch.device, dtype: torch.dtype) -> dict[str, list]:
    out: dict[str, list] = {"all_reduce": [], "p2p": []}
    for ranks in sorted({2, world}):
        group = dist.new_group(list(range(ranks)))
        for nbytes in MESSAGE_BYTES[device.type]:
            x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
            dist.barrier()
            if rank < ranks:
                t = _median_s(lambda x=x, group=group: dist.all_reduce(x, group=group), device)
                out["all_reduce"].append((ranks, nbytes, t))
    for nbytes in MESSAGE_BYTES[device.type]:
        x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
        dist.barrier()
        if rank == 0:
            out["p2p"].append((nbytes, _median_s(lambda x=x: (dist.send(x, 1), dist.recv(x, 1)), device) / 2))
        elif rank == 1:
            _median_s(lambda x=x: (dist.recv(x, 0), dist.send(x, 0)), device)
    return out


def _gemm_curve(device: torch.device, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of GEMMs, sorted by FLOPs; shapes with equal FLOPs averaged."""
    times: dict[float, list[float]] = {}
    for m, k, n in GEMM_SHAPES[device.type]:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        times.setdefault(2.0 * m * k * n, []).append(_median_s(lambda a=a, b=b: a @ b, device))
    return [(flops, statistics.mean(ts)) for flops, ts in sorted(times.items())]


def _elementwise_backward_factor(device: torch.device, dtype: torch.dtype) -> float:
    rows, cols = ELEMENTWISE_SHAPE[device.type]
    x = torch.randn(rows, cols, dtype=dtype, device=device, requires_grad=True)
    w = torch.ones(cols, dtype=dtype, device=device, requires_grad=True)
    up = torch.randn(rows, cols, dtype=dtype, device=device, requires_grad=True)
    grad = torch.ones(rows, cols, dtype=dtype, device=device)

    def norm_and_swiglu() -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = w * h.to(dtype)
        return torch.nn.functional.silu(y) * up

    forward_s = _median_s(norm_and_swiglu, device)
    both_s = _median_s(lambda: torch.autograd.grad(norm_and_swiglu(), (x, w, up), grad), device)
    return (both_s - forward_s) / forward_s


def _tiny_llama(layers: int, tp: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Host-bound timings of ``llama-tiny`` with ``layers`` layers, parallelized at ``tp``.

    Seconds of a forward and of a forward + backward (grads reset to None first, as a
    step of one microbatch finds them), and the counts of the compiled rank graph's call
    nodes, of those that need a gradient, and of its forward (*g*, all-gather) and
    backward (*f*) tp collectives.
    """
    config = presets.model_config("llama-tiny")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = presets.build_from_config(config, device=device, dtype=dtype)
    ids = torch.zeros((1, HOST_TOKENS), dtype=torch.long, device=device)
    pm = parallelize(model, tp=tp, example_inputs={"input_ids": ids, "labels": ids})
    params = list(pm.parameters())

    def both() -> None:
        for p in params:
            p.grad = None
        pm(input_ids=ids, labels=ids).loss.backward()

    gm = pm.graph_for(input_ids=ids, labels=ids)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    grads = needs_grad(gm)
    dist.barrier()
    forward_s = _median_s(lambda: pm(input_ids=ids, labels=ids).loss, device, repeats=7)
    dist.barrier()
    both_s = _median_s(both, device, repeats=7)
    return {
        "forward_s": forward_s,
        "both_s": both_s,
        "calls": len(calls),
        "grad_calls": sum(n in grads for n in calls),
        "forward_collectives": sum(n.target in (ops.REDUCE_FROM_TP, ops.GATHER_FROM_TP) for n in calls),
        "backward_collectives": sum(n.target is ops.COPY_TO_TP for n in calls),
    }


def _host_runs(world: int, device: torch.device, dtype: torch.dtype) -> list[dict[str, float]]:
    """``_tiny_llama`` at each of ``HOST_LAYERS`` layer counts, at tp 1 and tp ``world``,
    every rank running at once (as in training, ranks share the host)."""
    return [{"tp": tp, "layers": layers, **_tiny_llama(layers, tp, device, dtype)} for tp in (1, world) for layers in HOST_LAYERS]


def fit_host(runs: list[dict[str, float]]) -> dict[str, float]:
    """Host seconds per forward node, per backward node and per tp collective, from the
    differences between ``_host_runs``' layer counts (module docstring)."""
    def delta(tp: int) -> dict[str, float]:
        small, large = sorted((r for r in runs if r["tp"] == tp), key=lambda r: r["layers"])
        return {k: large[k] - small[k] for k in large if k not in ("tp", "layers")}

    d = delta(1)
    forward = d["forward_s"] / d["calls"]
    backward = max(d["both_s"] - d["forward_s"], 0.0) / d["grad_calls"]
    small = min((r for r in runs if r["tp"] == 1), key=lambda r: r["layers"])
    call = max(small["both_s"] - small["calls"] * forward - small["grad_calls"] * backward, 0.0)
    t = delta(max(r["tp"] for r in runs))
    ordinary = (t["calls"] - t["forward_collectives"]) * forward + (t["grad_calls"] - t["backward_collectives"]) * backward
    collectives_ = t["forward_collectives"] + t["backward_collectives"]
    collective = max(t["both_s"] - ordinary, 0.0) / collectives_ if collectives_ else 0.0
    return {"op_overhead_s": forward, "backward_op_overhead_s": backward, "collective_host_s": collective, "call_host_s": call}


def _scale_config(layers: int) -> LlamaConfig:
    m = SCALE_MODEL
    return LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=layers,
                       num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], max_position_embeddings=m["seq"])  # fmt: skip


def _layer_runs(device: torch.device, dtype: torch.dtype) -> list[dict[str, float]]:
    """Seconds of forward + backward of ``SCALE_MODEL`` at each of ``SCALE_LAYERS`` layer counts (tp 1)."""
    runs = []
    for layers in SCALE_LAYERS:
        torch.manual_seed(0)
        model = presets.build_from_config(_scale_config(layers), device=device, dtype=dtype)
        ids = torch.zeros((SCALE_MODEL["batch"], SCALE_MODEL["seq"]), dtype=torch.long, device=device)
        pm = parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids})
        params = list(pm.parameters())

        def both(pm: torch.nn.Module = pm, params: list[torch.Tensor] = params) -> None:
            for p in params:
                p.grad = None
            pm(input_ids=ids, labels=ids).loss.backward()

        dist.barrier()
        runs.append({"layers": layers, "both_s": _median_s(both, device, repeats=5, inner=3)})
        del pm, model, params
        torch.cuda.empty_cache()
    return runs


def fit_compute_time_scale(profile: HardwareProfile, runs: list[dict[str, float]]) -> float:
    """The ``compute_time_scale`` at which the cost model predicts ``_layer_runs``' time
    per layer (module docstring); kept within [1/4, 4]."""
    small, large = sorted(runs, key=lambda r: r["layers"])
    per_layer = (large["both_s"] - small["both_s"]) / (large["layers"] - small["layers"])
    layer = trace_for_planning(_scale_config(1), SCALE_MODEL["seq"]).rank(1).layers[0]

    def predicted(scale: float) -> float:
        return segment_time(layer, SCALE_MODEL["batch"], replace(profile, compute_time_scale=scale), 1).total_s

    low, high = 0.25, 4.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if predicted(mid) < per_layer else (low, mid)
    return (low * high) ** 0.5


def _host_fields(measured: dict[str, object]) -> dict[str, float]:
    """``fit_host`` of the runs; measurements saved before it existed hold the forward and
    backward constants themselves (then ``collective_host_s`` stays the base profile's)."""
    if "host" in measured:
        return fit_host(measured["host"])
    return {k: float(measured[k]) for k in ("op_overhead_s", "backward_op_overhead_s")}


def _compute(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    elements = (256 if device.type == "cuda" else 16) * 2**20 // dtype.itemsize
    x, y, z = (torch.ones(elements, dtype=dtype, device=device) for _ in range(3))
    add_s = _median_s(lambda: torch.add(x, y, out=z), device)
    batch, heads, seq, dim = (4, 16, 2048, 128) if device.type == "cuda" else (1, 4, 256, 64)
    q, k, v = (torch.randn(batch, heads, seq, dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, 1, seq, seq)

    def attention() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    attention_s = _median_s(attention, device)
    grad = torch.ones(batch, heads, seq, dim, dtype=dtype, device=device)
    attention_backward_s = _median_s(lambda: torch.autograd.grad(attention(), (q, k, v), grad), device) - attention_s
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    return {
        "gemm": _gemm_curve(device, dtype),
        "memory_bytes_per_s": 3 * elements * dtype.itemsize / add_s,
        "elementwise_backward_factor": _elementwise_backward_factor(device, dtype),
        "attention_flops_per_s": 4 * batch * heads * seq * seq * dim / attention_s,
        "attention_backward_factor": attention_backward_s / attention_s,
        "memory_capacity_bytes": memory,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
    }


def _worker(rank: int, world: int) -> dict[str, object]:
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    measured: dict[str, object] = dict(_collectives(rank, world, device, dtype))
    measured["host"] = _host_runs(world, device, dtype)
    if on_gpu:
        measured["layers"] = _layer_runs(device, dtype)
    if rank == 0:
        measured.update(_compute(device, dtype))
    dist.barrier()
    return measured


def base_profile(device_name: str) -> HardwareProfile:
    """The built-in profile that supplies what one node cannot measure (H100's for an unknown GPU)."""
    if device_name == "CPU":
        return CPU
    return profile_for_gpu(device_name) or H100


def calibrate(ranks: int | None = None, timeout_s: float = 600) -> tuple[HardwareProfile, dict[str, object]]:
    """Measure ``ranks`` local ranks (default: every GPU, else 2 CPU ranks): the fitted profile and the raw measurements."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = ranks or max(gpus, 2)
    if ranks < 2:
        raise ValueError(f"calibration measures collectives between ranks; use --ranks 2 or more, got {ranks}")
    if gpus and ranks > gpus:
        raise ValueError(f"{ranks} ranks asked but {gpus} GPUs are visible; use --ranks {gpus} or less")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    measured = spawn_ranks(_worker, ranks, backend="nccl" if gpus else "gloo", timeout_s=timeout_s)[0]
    return fit_profile(measured, ranks), measured


def fit_profile(measured: dict[str, object], ranks: int) -> HardwareProfile:
    """The profile of ``calibrate``'s measurements (see the module docstring)."""
    reduces = measured["all_reduce"]
    alpha, bus = fit_alpha_beta([2 * (t - 1) / t * n for t, n, _ in reduces], [s for _, _, s in reduces])
    p2p_alpha, p2p_bw = fit_alpha_beta([n for n, _ in measured["p2p"]], [s for _, s in measured["p2p"]])
    gemm_latency, gemm_rate = fit_alpha_beta([f for f, _ in measured["gemm"]], [s for _, s in measured["gemm"]])
    name = str(measured["device_name"])
    base = base_profile(name)
    stamp = datetime.date.today().isoformat()
    profile = replace(
        base,
        name=f"{name} (calibrated)",
        matmul_flops_per_s=gemm_rate,
        matmul_latency_s=gemm_latency,
        memory_bytes_per_s=float(measured["memory_bytes_per_s"]),
        attention_flops_per_s=float(measured["attention_flops_per_s"]),
        attention_backward_factor=float(measured["attention_backward_factor"]),
        elementwise_backward_factor=float(measured["elementwise_backward_factor"]),
        matmul_curve=tuple((float(f), float(t)) for f, t in measured["gemm"]),
        allreduce_bus_bytes_per_s=bus,
        collective_latency_s=alpha,
        p2p=Link(p2p_alpha, p2p_bw),
        **_host_fields(measured),
        memory_capacity_bytes=float(measured["memory_capacity_bytes"]),
        source=f"autotp calibrate on {ranks} x {name}, torch {torch.__version__}, {stamp}; peak FLOP/s, reserved "
        f"memory and the inter-node link from the built-in {base.name} profile",
    )
    if "layers" in measured:
        profile = replace(profile, compute_time_scale=fit_compute_time_scale(profile, measured["layers"]))
    return profile


def fit_errors(profile: HardwareProfile, measured: dict[str, object]) -> dict[str, float]:
    """Largest relative error of the fitted alpha-beta models against the measurements."""
    def worst(pairs: list[tuple[float, float]]) -> float:
        return max(abs(model / real - 1) for model, real in pairs)

    return {
        "all_reduce": worst([(ring_all_reduce_s(n, t, profile.intra_node), s) for t, n, s in measured["all_reduce"]]),
        "p2p": worst([(p2p_s(n, profile.p2p_link), s) for n, s in measured["p2p"]]),
        "gemm": worst([(profile.matmul_latency_s + f / profile.matmul_flops_per_s, s) for f, s in measured["gemm"]]),
    }


def describe(profile: HardwareProfile, measured: dict[str, object]) -> str:
    errors = fit_errors(profile, measured)
    return "\n".join(
        [
            f"{profile.name}",
            f"  all-reduce  alpha {profile.collective_latency_s * 1e6:.1f} us, bus {profile.allreduce_bus_bytes_per_s / 1e9:.0f} GB/s (worst fit error {errors['all_reduce']:.0%})",
            f"  p2p         alpha {profile.p2p_link.latency_s * 1e6:.1f} us, {profile.p2p_link.bus_bytes_per_s / 1e9:.0f} GB/s (worst fit error {errors['p2p']:.0%})",
            (
                f"  GEMM        {profile.matmul_flops_per_s / 1e12:.3g} TFLOP/s + {profile.matmul_latency_s * 1e6:.1f} us "
                f"(worst fit error {errors['gemm']:.0%}; estimates interpolate the {len(profile.matmul_curve)} measured GEMMs)"
            ),
            f"  attention   {profile.attention_flops_per_s / 1e12:.3g} TFLOP/s forward, backward {profile.attention_backward_factor:.2f}x",
            f"  elementwise backward {profile.elementwise_backward_factor:.2f}x forward",
            f"  memory      {profile.memory_bytes_per_s / 1e12:.2f} TB/s, {profile.memory_capacity_bytes / 2**30:.0f} GiB",
            f"  layer       eager kernels take {profile.compute_time_scale:.3f}x the roofline's time",
            (
                f"  host        {profile.op_overhead_s * 1e6:.1f} us per op forward, {profile.backward_op_overhead_s * 1e6:.1f} us "
                f"backward, {profile.collective_host_s * 1e6:.1f} us per tp collective, "
                f"{profile.call_host_s * 1e3:.2f} ms per call"
            ),
        ]
    )


def _calibrate_command(args: argparse.Namespace) -> int:
    profile, measured = calibrate(args.ranks, args.timeout)
    save_profile(profile, args.out)
    print(describe(profile, measured))
    print(f"wrote {args.out}; use it with autotp plan --hardware {args.out}")
    return 0


def add_calibrate_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``calibrate``; its handler (``args.handler``) measures, writes the profile and returns 0."""
    command = subparsers.add_parser(
        "calibrate",
        help="measure all-reduce, P2P, GEMM, memory and launch costs here and write a hardware profile",
        description="Spawn one rank per GPU (NCCL; gloo ranks on the CPU without GPUs), measure collective "
        "alpha/beta, GEMM throughput, memory bandwidth and eager per-op overheads, and write a JSON profile "
        "that autotp plan --hardware PATH reads.",
    )
    command.add_argument("--ranks", type=int, help="ranks to measure (default: every GPU, or 2 CPU ranks)")
    command.add_argument("--out", type=Path, default=Path("autotp-profile.json"), help="default: autotp-profile.json")
    command.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed (default: 600)")
    command.set_defaults(handler=_calibrate_command)
