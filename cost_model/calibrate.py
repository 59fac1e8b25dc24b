"""Fitting a ``HardwareProfile`` to ``autotp calibrate``'s measurements.

The measuring harness is ``autotp.cli.measure``, the command ``autotp.cli.calibrate``; ``benchmarks/measure_constants.py``
(the built-in H100 profile's measurement) runs the same GEMM, attention and layer measurements on more shapes and
fits them with the same functions. One process per GPU (NCCL; on a machine without GPUs, ranks on the CPU with
gloo) measures, each time as the median of repeated calls between device syncs unless said otherwise:

* with 2 ranks or more: all-reduce of 64 KB .. 256 MB (4 KB .. 16 MB on CPU) over the first 2 ranks and over
  all of them, fitted jointly to ``time = alpha + 2(t-1)/t · n / B``
  (``fit_alpha_beta``): ``intra_node``;
  point-to-point send/receive between ranks 0 and 1 (half a round trip), fitted to
  ``alpha + n / B``: ``p2p``. One GPU measures no link: those, and the tp collective's host cost, stay the
  built-in profile's (the profile's ``source`` says so);
* on rank 0: GEMMs of transformer shapes as a linear runs them (forward, input and weight gradient;
  ``autotp.cli.measure.gemm_row``), as GPU time (``gpu_time_s``: calls captured in a CUDA graph and replayed
  between CUDA events; the queue model adds the host's issue cost, and timing eager calls counted it in the
  kernel: a 1024³ GEMM read 73 TFLOP/s eager against 352 replayed on an H100), binned into ``matmul_curve``
  (``gemm_curve``) and fitted to ``matmul_latency + FLOPs / rate``; causal attention
  (``is_causal=True``, what the ``causal_attention`` pass runs) over a few shapes, fitted to
  ``attention_latency_s + F / attention_flops_per_s`` with F the FLOPs ``cost_model.flops`` counts for the node
  (``fit_attention``; one rate alone ran 112..289 TFLOP/s across shapes on an H100); an
  elementwise add of large tensors (3 bytes moved per element byte) for the memory
  bandwidth; an HF-style RMSNorm and SwiGLU product, forward and backward, for the
  backward/forward ratio of eager memory-bound ops;
* on every rank at once (ranks share the host, as in training): host costs of eager
  execution, from a host-bound Llama (on GPUs ``HOST_MODEL``, width 1024 on one 1024-token sequence: tensors
  of the sizes training runs; on CPU ranks ``llama-tiny`` on 16 tokens) parallelized by autotp with L1 = 2
  and L2 = 6 layers, at tp 1 and tp = all ranks, forward and forward + backward (wall time: the host's). Differences between
  the two layer counts cancel the fixed costs of a call (embedding, loss, output
  structures, starting the autograd engine) and leave what a layer's nodes cost
  (``fit_host``): with ΔT the time difference and ΔN the node-count difference,
  ``op_overhead_s = ΔT_fwd / ΔN_calls`` and ``backward_op_overhead_s =
  (ΔT_both - ΔT_fwd) / ΔN_grad`` at tp 1; at tp t the layers also hold ΔN_g forward
  and ΔN_f backward collectives, and ``collective_host_s = (ΔT_both - (ΔN_calls -
  ΔN_g)·op_overhead_s - (ΔN_grad - ΔN_f)·backward_op_overhead_s) / (ΔN_g + ΔN_f)``.
  What the nodes do not explain is the fixed cost of a call: ``call_host_s = T_both -
  N_calls·op_overhead_s - N_grad·backward_op_overhead_s`` of the smaller model at tp 1.
  These are this machine's seconds: the host costs move between machines of one kind (an H100's per-node
  forward cost read 10 and 28 µs on two leases), so plans of many small microbatches are predicted
  from the machine at hand only after calibrating it;
* on every GPU at once (not on CPU ranks, where it stays 1): ``compute_time_scale``,
  from a GPU-bound Llama of a shape no benchmark uses (``SCALE_MODEL``: h=2560, 8 x 2048
  tokens, HF's random initialization), at tp 1 with 2 and 4 layers, one ``train_step`` each
  (``autotp.cli.measure.layer_runs``). The time difference over the layer difference is what one decoder layer takes;
  ``fit_compute_time_scale`` finds the scale of the roofline GPU times at which
  ``compute.segment_time`` of that traced layer, host queue included, predicts it
  (bisection: the prediction grows with the scale).

The peak FLOP/s (for MFU) and the inter-node link cannot be measured on one node: they
come from the built-in profile of the same GPU, and the profile's ``source`` says so.
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import replace

import numpy as np
import torch
from transformers import LlamaConfig

from autotp.cost_model.communication import p2p_s, ring_all_reduce_s
from autotp.cost_model.compute import Segment, segment_time
from autotp.cost_model.flops import attention_flops
from autotp.cost_model.hardware import CPU, H100, HardwareProfile, Link, fit_alpha_beta, profile_for_gpu
from autotp.ir.errors import UserInputError
from autotp.ir.op_facts import Collective

SCALE_MODEL = {"hidden": 2560, "ffn": 6912, "heads": 20, "kv_heads": 4, "vocab": 8192, "batch": 8, "seq": 2048}
SCALE_LAYERS = (2, 4)
HOST_MODEL = {"hidden": 1024, "ffn": 2816, "heads": 16, "kv_heads": 8, "vocab": 32000, "batch": 1, "seq": 1024}
"""The host probe on GPUs: tensors of the sizes training runs, still host-bound at 1024 tokens."""


def gemm_curve(rows: list[dict]) -> tuple[tuple[float, float], ...]:
    """(FLOPs, seconds) of GEMM rows (``autotp.cli.measure.gemm_row``): per shape the mean of forward and both
    gradients, as GPU time where it was captured; shapes merged into bins of a factor sqrt(2) in FLOPs
    (geometric means), which keeps the curve increasing."""
    def seconds(r: dict) -> float:
        gpu = r.get("gpu_s") or [None]
        return sum(gpu) / 3 if None not in gpu else (r["forward_s"] + r["input_grad_s"] + r["weight_grad_s"]) / 3

    bins: dict[int, list[tuple[float, float]]] = {}
    for flops, t in sorted((r["flops"], seconds(r)) for r in rows):
        bins.setdefault(math.floor(2 * math.log2(flops)), []).append((flops, t))
    return tuple((float(np.exp(np.mean(np.log([f for f, _ in b])))), float(np.exp(np.mean(np.log([t for _, t in b])))))
                 for _, b in sorted(bins.items()))  # fmt: skip


def fit_attention(rows: list[dict]) -> dict[str, float]:
    """``attention_latency_s``, ``attention_flops_per_s`` and ``attention_backward_factor`` of causal attention rows
    (``autotp.cli.measure.attention_row``): F = ``flops.attention_flops`` (what the cost model counts for the node),
    forward time = latency + F / rate (``fit_alpha_beta``), the median backward/forward ratio; GPU time where captured."""
    points = [(attention_flops(*(tuple(r["shape"]),) * 3, causal=True), r.get("gpu_forward_s") or r["forward_s"],
               r.get("gpu_both_s") or r["both_s"]) for r in rows]  # fmt: skip
    latency, rate = fit_alpha_beta([f for f, _, _ in points], [forward for _, forward, _ in points])
    backward = statistics.median((both - forward) / forward for _, forward, both in points)
    return {"attention_latency_s": latency, "attention_flops_per_s": rate, "attention_backward_factor": backward}


def fit_host(runs: list[dict[str, float]]) -> dict[str, float]:
    """Host seconds per forward node, per backward node and per tp collective, from the
    differences between the host runs' layer counts (module docstring)."""
    def delta(tp: int) -> dict[str, float]:
        small, large = sorted((r for r in runs if r["tp"] == tp), key=lambda r: r["layers"])
        return {k: large[k] - small[k] for k in large if k not in ("tp", "layers")}

    d = delta(1)
    forward = d["forward_s"] / d["calls"]
    backward = max(d["both_s"] - d["forward_s"], 0.0) / d["grad_calls"]
    small = min((r for r in runs if r["tp"] == 1), key=lambda r: r["layers"])
    call = max(small["both_s"] - small["calls"] * forward - small["grad_calls"] * backward, 0.0)
    host = {"op_overhead_s": forward, "backward_op_overhead_s": backward, "call_host_s": call}
    t = delta(max(r["tp"] for r in runs))
    collectives_ = t["forward_collectives"] + t["backward_collectives"]
    if collectives_:  # one rank measures no tp collective: the base profile's cost stays
        ordinary = (t["calls"] - t["forward_collectives"]) * forward + (t["grad_calls"] - t["backward_collectives"]) * backward
        host["collective_host_s"] = max(t["both_s"] - ordinary, 0.0) / collectives_
    return host


def scale_config(layers: int) -> LlamaConfig:
    return llama_config(SCALE_MODEL, layers)


def llama_config(m: dict[str, int], layers: int) -> LlamaConfig:
    """A Llama of the widths in ``m`` (``SCALE_MODEL``, ``HOST_MODEL``) with ``layers`` layers."""
    return LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=layers,
                       num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], max_position_embeddings=m["seq"])  # fmt: skip


def fit_compute_time_scale(profile: HardwareProfile, runs: list[dict[str, float]], layer: Segment,
                           batch: int = SCALE_MODEL["batch"]) -> float:  # fmt: skip
    """The ``compute_time_scale`` at which the cost model predicts the measured time per
    layer of ``runs`` (module docstring); kept within [1/4, 4]. ``layer``: the costs of
    one traced ``scale_config`` layer at tp 1 (or of another model's, run at ``batch`` samples)."""
    small, large = sorted(runs, key=lambda r: r["layers"])
    per_layer = (large["both_s"] - small["both_s"]) / (large["layers"] - small["layers"])

    def predicted(scale: float) -> float:
        return segment_time(layer, batch, replace(profile, compute_time_scale=scale), 1).total_s

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


def base_profile(device_name: str) -> HardwareProfile:
    """The built-in profile that supplies what one node cannot measure (H100's for an unknown GPU)."""
    if device_name == "CPU":
        return CPU
    return profile_for_gpu(device_name) or H100


def fit_profile(measured: dict[str, object], ranks: int, scale_layer: Segment | None = None) -> HardwareProfile:
    """The profile of ``autotp calibrate``'s measurements (see the module docstring);
    ``scale_layer`` (see ``fit_compute_time_scale``) is needed when they hold GPU layer runs."""
    name = str(measured["device_name"])
    base = base_profile(name)
    stamp = datetime.date.today().isoformat()
    fields: dict[str, object] = {}
    if Collective.ALL_REDUCE in measured:  # one rank measures no link: the base profile's stay
        reduces = measured[Collective.ALL_REDUCE]
        alpha, bus = fit_alpha_beta([2 * (t - 1) / t * n for t, n, _ in reduces], [s for _, _, s in reduces])
        p2p_alpha, p2p_bw = fit_alpha_beta([n for n, _ in measured[Collective.P2P]], [s for _, s in measured[Collective.P2P]])
        fields.update(allreduce_bus_bytes_per_s=bus, collective_latency_s=alpha, p2p=Link(p2p_alpha, p2p_bw))
    gemm = measured["gemm"]
    curve = gemm_curve(gemm) if gemm and isinstance(gemm[0], dict) else tuple((float(f), float(t)) for f, t in gemm)
    gemm_latency, gemm_rate = fit_alpha_beta([f for f, _ in curve], [t for _, t in curve])
    if "attention" in measured:
        fields.update(fit_attention(measured["attention"]))
    else:  # measured before the attention rows: one shape's rate stands for the whole time
        fields.update(attention_flops_per_s=float(measured["attention_flops_per_s"]), attention_latency_s=0.0,
                      attention_backward_factor=float(measured["attention_backward_factor"]))  # fmt: skip
    links = "" if Collective.ALL_REDUCE in measured else ", the links (one rank measures none)"
    profile = replace(
        base,
        name=f"{name} (calibrated)",
        matmul_flops_per_s=gemm_rate,
        matmul_latency_s=gemm_latency,
        memory_bytes_per_s=float(measured["memory_bytes_per_s"]),
        elementwise_backward_factor=float(measured["elementwise_backward_factor"]),
        matmul_curve=curve,
        **fields,
        **_host_fields(measured),
        memory_capacity_bytes=float(measured["memory_capacity_bytes"]),
        source=f"autotp calibrate on {ranks} x {name}, torch {torch.__version__}, {stamp}; peak FLOP/s, reserved "
        f"memory{links} and the inter-node link from the built-in {base.name} profile",
    )
    if "layers" in measured:
        if scale_layer is None:
            raise UserInputError("the measurements hold GPU layer runs; pass scale_layer= (autotp.cli.measure.scale_layer())")
        profile = replace(profile, compute_time_scale=fit_compute_time_scale(profile, measured["layers"], scale_layer))
    return profile


def fit_errors(profile: HardwareProfile, measured: dict[str, object]) -> dict[str, float]:
    """Largest relative error of the fitted alpha-beta models against the measurements (the links where measured)."""
    def worst(pairs: list[tuple[float, float]]) -> float:
        return max(abs(model / real - 1) for model, real in pairs)

    errors = {"gemm": worst([(profile.matmul_latency_s + f / profile.matmul_flops_per_s, s) for f, s in profile.matmul_curve])}
    if Collective.ALL_REDUCE in measured:
        errors[Collective.ALL_REDUCE] = worst([(ring_all_reduce_s(n, t, profile.intra_node), s) for t, n, s in measured[Collective.ALL_REDUCE]])
        errors[Collective.P2P] = worst([(p2p_s(n, profile.p2p_link), s) for n, s in measured[Collective.P2P]])
    return errors


def describe(profile: HardwareProfile, measured: dict[str, object]) -> str:
    errors = fit_errors(profile, measured)
    links = [
        f"  all-reduce  alpha {profile.collective_latency_s * 1e6:.1f} us, bus {profile.allreduce_bus_bytes_per_s / 1e9:.0f} GB/s (worst fit error {errors[Collective.ALL_REDUCE]:.0%})",
        f"  p2p         alpha {profile.p2p_link.latency_s * 1e6:.1f} us, {profile.p2p_link.bus_bytes_per_s / 1e9:.0f} GB/s (worst fit error {errors[Collective.P2P]:.0%})",
    ] if Collective.ALL_REDUCE in errors else ["  links       not measured (one rank): the built-in profile's"]  # fmt: skip
    return "\n".join(
        [
            f"{profile.name}",
            *links,
            (
                f"  GEMM        {profile.matmul_flops_per_s / 1e12:.3g} TFLOP/s + {profile.matmul_latency_s * 1e6:.1f} us "
                f"(worst fit error {errors['gemm']:.0%}; estimates interpolate the {len(profile.matmul_curve)} measured GEMMs)"
            ),
            f"  attention   {profile.attention_latency_s * 1e6:.1f} us + FLOPs at {profile.attention_flops_per_s / 1e12:.3g} TFLOP/s "
            f"forward, backward {profile.attention_backward_factor:.2f}x",
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
