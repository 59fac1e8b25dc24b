"""The measuring harness of ``autotp calibrate``: the ranks that measure this machine.

The measurements and how they are fitted are described in ``autotp.cost_model.calibrate``,
which holds the fitting; the command is ``autotp.cli.calibrate``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autotp import presets
from autotp.ir import ops
from autotp.ir.op_facts import Collective
from autotp.api import parallelize
from autotp.compiler import trace_for_planning
from autotp.cost_model.calibrate import SCALE_MODEL, SCALE_LAYERS, fit_profile, scale_config
from autotp.cost_model.compute import Segment, needs_grad
from autotp.cost_model.hardware import HardwareProfile
from autotp.runtime.processes.launcher import spawn_ranks
from autotp.ir.errors import UserInputError

MESSAGE_BYTES = {"cuda": tuple(2**k for k in range(16, 29, 2)), "cpu": tuple(2**k for k in range(12, 25, 2))}
GEMM_SHAPES = {  # (tokens, k, n)
    "cuda": tuple((m, k, n) for m in (1024, 4096, 16384) for k, n in ((1024, 1024), (2048, 2048), (4096, 4096), (2048, 8192), (8192, 2048))),
    "cpu": tuple((m, k, n) for m in (64, 256) for k, n in ((64, 64), (256, 256), (256, 1024))),
}
ELEMENTWISE_SHAPE = {"cuda": (16384, 4096), "cpu": (1024, 256)}
HOST_LAYERS, HOST_TOKENS = (2, 6), 16


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
    out: dict[str, list] = {Collective.ALL_REDUCE: [], Collective.P2P: []}
    for ranks in sorted({2, world}):
        group = dist.new_group(list(range(ranks)))
        for nbytes in MESSAGE_BYTES[device.type]:
            x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
            dist.barrier()
            if rank < ranks:
                t = _median_s(lambda x=x, group=group: dist.all_reduce(x, group=group), device)
                out[Collective.ALL_REDUCE].append((ranks, nbytes, t))
    for nbytes in MESSAGE_BYTES[device.type]:
        x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
        dist.barrier()
        if rank == 0:
            out[Collective.P2P].append((nbytes, _median_s(lambda x=x: (dist.send(x, 1), dist.recv(x, 1)), device) / 2))
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


def _tiny_llama(layers: int, tp: int, device: torch.device, dtype: torch.dtype, config: object | None = None,
                tokens: tuple[int, int] = (1, HOST_TOKENS)) -> dict[str, float]:  # fmt: skip
    """Host-bound timings of ``llama-tiny`` (or of ``config``) with ``layers`` layers, parallelized at ``tp``,
    on ``tokens`` (batch, sequence).

    Seconds of a forward and of a forward + backward (grads reset to None first, as a
    step of one microbatch finds them), and the counts of the compiled rank graph's call
    nodes, of those that need a gradient, and of its forward (*g*, all-gather) and
    backward (*f*) tp collectives.
    """
    config = config or presets.model_config("llama-tiny")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = presets.build_from_config(config, device=device, dtype=dtype)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
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


def _layer_runs(device: torch.device, dtype: torch.dtype) -> list[dict[str, float]]:
    """Seconds of forward + backward of ``SCALE_MODEL`` at each of ``SCALE_LAYERS`` layer counts (tp 1)."""
    runs = []
    for layers in SCALE_LAYERS:
        torch.manual_seed(0)
        model = presets.build_from_config(scale_config(layers), device=device, dtype=dtype)
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


def calibrate(ranks: int | None = None, timeout_s: float = 600) -> tuple[HardwareProfile, dict[str, object]]:
    """Measure ``ranks`` local ranks (default: every GPU, else 2 CPU ranks): the fitted profile and the raw measurements."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = ranks or max(gpus, 2)
    if ranks < 2:
        raise UserInputError(f"calibration measures collectives between ranks; use --ranks 2 or more, got {ranks}")
    if gpus and ranks > gpus:
        raise UserInputError(f"{ranks} ranks asked but {gpus} GPUs are visible; use --ranks {gpus} or less")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    measured = spawn_ranks(_worker, ranks, backend="nccl" if gpus else "gloo", timeout_s=timeout_s)[0]
    return fitted_profile(measured, ranks), measured


def scale_layer() -> Segment:
    """The costs of one ``SCALE_MODEL`` decoder layer at tp 1 (``fit_compute_time_scale``'s ``layer``)."""
    return trace_for_planning(scale_config(1), SCALE_MODEL["seq"]).rank(1).layers[0]


def fitted_profile(measured: dict[str, object], ranks: int) -> HardwareProfile:
    """``fit_profile`` of the measurements, with the scale layer traced when they need it."""
    return fit_profile(measured, ranks, scale_layer() if "layers" in measured else None)
