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
from autotp.cost_model.calibrate import HOST_MODEL, SCALE_LAYERS, SCALE_MODEL, fit_profile, llama_config, scale_config
from autotp.cost_model.compute import Segment
from autotp.cost_model.saved_tensors import needs_grad
from autotp.cost_model.hardware import HardwareProfile
from autotp.runtime.processes.launcher import spawn_ranks
from autotp.ir.errors import UserInputError

MESSAGE_BYTES = {"cuda": tuple(2**k for k in range(16, 29, 2)), "cpu": tuple(2**k for k in range(12, 25, 2))}
GEMM_SHAPES = {  # (tokens, k, n)
    "cuda": tuple((m, k, n) for m in (1024, 4096, 16384) for k, n in ((1024, 1024), (2048, 2048), (4096, 4096), (2048, 8192), (8192, 2048))),
    "cpu": tuple((m, k, n) for m in (64, 256) for k, n in ((64, 64), (256, 256), (256, 1024))),
}
ATTENTION_SHAPES = {  # (batch, heads, sequence, head dim) of causal attention: enough spread to fit latency + rate
    "cuda": ((1, 16, 1024, 128), (4, 16, 1024, 128), (2, 16, 2048, 128), (8, 16, 2048, 128), (2, 16, 4096, 128)),
    "cpu": ((1, 4, 128, 64), (2, 4, 256, 64), (1, 4, 512, 64)),
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


def gpu_time_s(fn: Callable[[], object], device: torch.device, inner: int = 10, repeats: int = 5) -> float | None:
    """Seconds of GPU time of one ``fn()``: ``inner`` calls captured in a CUDA graph, replayed ``repeats`` times
    between CUDA events (median), so the host's cost of issuing them is not counted (the cost model adds that
    separately, ``op_overhead_s``); None on CPU or where capture fails."""
    if device.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        del graph
        return statistics.median(samples)
    except RuntimeError as e:  # an op that cannot be captured: the caller keeps the host-timed figure
        print(f"capture failed ({e}); host-timed only", flush=True)
        return None


def gemm_row(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """One GEMM shape as a linear runs it: forward ``x @ W^T``, input gradient ``g @ W``, weight gradient
    ``g^T @ x``, each timed by the host (median of back-to-back calls) and as GPU time (``gpu_time_s``)."""
    x, w = torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device)
    g = torch.randn(m, n, dtype=dtype, device=device)
    calls = (lambda: torch.nn.functional.linear(x, w), lambda: g @ w, lambda: g.t() @ x)
    host = [_median_s(call, device) for call in calls]
    return {"m": m, "k": k, "n": n, "flops": 2.0 * m * k * n, "forward_s": host[0], "input_grad_s": host[1],
            "weight_grad_s": host[2], "gpu_s": [gpu_time_s(call, device) for call in calls]}  # fmt: skip


def attention_row(shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Causal ``scaled_dot_product_attention`` (what the ``causal_attention`` pass runs) on q, k, v of ``shape``:
    forward and forward + backward, host-timed and as GPU time."""
    q, k, v = (torch.randn(*shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.ones(*shape, dtype=dtype, device=device)

    def forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both() -> object:
        return torch.autograd.grad(forward(), (q, k, v), grad)

    return {"shape": list(shape), "forward_s": _median_s(forward, device), "both_s": _median_s(both, device),
            "gpu_forward_s": gpu_time_s(forward, device), "gpu_both_s": gpu_time_s(both, device)}  # fmt: skip


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
    """``_tiny_llama`` at each of ``HOST_LAYERS`` layer counts, at tp 1 and tp ``world``, every rank running at once
    (as in training, ranks share the host): on GPUs of ``HOST_MODEL`` on one sequence of its length (tensors of
    the sizes training runs, still host-bound), on CPU ranks of ``llama-tiny`` on 16 tokens."""
    def run(layers: int, tp: int) -> dict[str, float]:
        if device.type != "cuda":
            return _tiny_llama(layers, tp, device, dtype)
        return _tiny_llama(layers, tp, device, dtype, llama_config(HOST_MODEL, layers), (HOST_MODEL["batch"], HOST_MODEL["seq"]))

    return [{"tp": tp, "layers": layers, **run(layers, tp)} for tp in sorted({1, world}) for layers in HOST_LAYERS]


def layer_runs(config_of: Callable[[int], object], layer_counts: tuple[int, ...], tokens: tuple[int, int],
               device: torch.device, dtype: torch.dtype) -> list[dict[str, float]]:  # fmt: skip
    """Seconds of one ``train_step`` (one microbatch, gradients reset to None first, as a step finds them) of the
    model ``config_of(layers)`` at each layer count, parallelized at tp 1, on ``tokens`` (batch, sequence): the
    path a user trains on (``bench_cost_model --validate`` times it too). Forward + backward through ``pm(...)``
    lowers a graph that also returns the logits and caches, a different program."""
    runs = []
    for layers in layer_counts:
        torch.manual_seed(0)
        model = presets.build_from_config(config_of(layers), device=device, dtype=dtype)
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        pm = parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids})
        params = list(pm.parameters())

        def step(pm: torch.nn.Module = pm, params: list[torch.Tensor] = params) -> None:
            for p in params:
                p.grad = None
            pm.train_step(input_ids=ids, labels=ids, num_microbatches=1)

        if dist.is_initialized():
            dist.barrier()
        runs.append({"layers": layers, "both_s": _median_s(step, device, repeats=5, inner=3)})
        del pm, model, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return runs


def _compute(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    elements = (256 if device.type == "cuda" else 16) * 2**20 // dtype.itemsize
    x, y, z = (torch.ones(elements, dtype=dtype, device=device) for _ in range(3))
    add_s = _median_s(lambda: torch.add(x, y, out=z), device)
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    return {
        "gemm": [gemm_row(m, k, n, device, dtype) for m, k, n in GEMM_SHAPES[device.type]],
        "attention": [attention_row(shape, device, dtype) for shape in ATTENTION_SHAPES[device.type]],
        "memory_bytes_per_s": 3 * elements * dtype.itemsize / add_s,
        "elementwise_backward_factor": _elementwise_backward_factor(device, dtype),
        "memory_capacity_bytes": memory,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
    }


def _worker(rank: int, world: int) -> dict[str, object]:
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    measured: dict[str, object] = dict(_collectives(rank, world, device, dtype)) if world > 1 else {}
    measured["host"] = _host_runs(world, device, dtype)
    if on_gpu:
        measured["layers"] = layer_runs(scale_config, SCALE_LAYERS, (SCALE_MODEL["batch"], SCALE_MODEL["seq"]), device, dtype)
    if rank == 0:
        measured.update(_compute(device, dtype))
    dist.barrier()
    return measured


def calibrate(ranks: int | None = None, timeout_s: float = 600) -> tuple[HardwareProfile, dict[str, object]]:
    """Measure ``ranks`` local ranks (default: every GPU, else 2 CPU ranks): the fitted profile and the raw measurements.
    One GPU measures everything but the links, which stay the built-in profile's."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = ranks or (gpus or 2)
    if ranks < (1 if gpus else 2):
        raise UserInputError(f"calibration on CPU measures collectives between ranks; use --ranks 2 or more, got {ranks}")
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
