"""A profile, not a benchmark: host time of autotp's ``train_step`` under ``cuda_graphs=True``,
measured on the CPU, split by phase. The comparison against ``torch.compile(mode="reduce-overhead")``
on the unmodified model, in the same run, is ``bench_single_gpu.py --shapes moe`` on a GPU.

A launch-bound step (``bench_single_gpu.py --shapes moe``) leaves the GPU idle until the host
reaches its first graph replay; the host's work after a replay overlaps the GPU's. Here
``make_graphed_callables`` is emulated on the CPU: each region runs the host code that torch's
version runs per call (an autograd function over the region's inputs and parameters, inputs
copied into static buffers, outputs detached; its backward returns every parameter's gradient
to autograd), while a replay only records the time. The model is the MoE shape's structure
(8 layers, 8 experts top-2, bf16: one region, as on the GPU) at small widths. It prints the
median over ``--steps`` steps, in microseconds: call to forward replay, forward to backward
replay, backward replay to return::

    OMP_NUM_THREADS=1 python benchmarks/profile_host_step.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from bench_single_gpu import Shape, build

REPLAYS: list[float] = []


class _Replay:
    def replay(self) -> None:
        REPLAYS.append(time.perf_counter())


def _graphed(module: nn.Module, sample: tuple[Tensor, ...]) -> None:
    """``module.forward`` replaced as ``make_graphed_callables`` replaces it (torch/cuda/graphs.py),
    its outputs and gradients those of one eager run."""
    params = tuple(p for p in module.parameters() if p.requires_grad)
    surface = tuple(t.detach().clone() for t in sample) + params
    outputs, spec = torch.utils._pytree.tree_flatten(module(*sample))
    wanted = [t for t in (*sample, *params) if t.requires_grad]
    grads = iter(torch.autograd.grad([o for o in outputs if o.requires_grad], wanted, allow_unused=True,
                                     grad_outputs=[torch.ones_like(o) for o in outputs if o.requires_grad]))  # fmt: skip
    grad_inputs = tuple(next(grads) if t.requires_grad else None for t in (*sample, *params))
    grad_outputs = tuple(torch.zeros_like(o) if o.requires_grad else None for o in outputs)
    static_outputs = tuple(o.detach() for o in outputs)
    graph = _Replay()

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: Tensor) -> tuple[Tensor, ...]:
            for i in range(len(sample)):
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            graph.replay()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *incoming: Tensor) -> tuple[Tensor | None, ...]:
            for buffer, g in zip(grad_outputs, incoming):
                if buffer is not None and buffer.data_ptr() != g.data_ptr():
                    buffer.copy_(g)
            graph.replay()
            return tuple(g.detach() if g is not None else None for g in grad_inputs)

    def functionalized(*args: Any) -> Any:
        flat = torch.utils._pytree.arg_tree_leaves(*args)
        return torch.utils._pytree.tree_unflatten(Graphed.apply(*flat, *params), spec)

    training, original = module.training, module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return functionalized(*args, **kwargs) if module.training == training else original(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _emulated_make_graphed_callables(modules: tuple[nn.Module, ...], samples: tuple[tuple[Tensor, ...], ...],
                                     **kwargs: Any) -> tuple[nn.Module, ...]:  # fmt: skip
    with torch.enable_grad():
        for module, sample in zip(modules, samples):
            _graphed(module, sample)
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    import autotp
    import autotp.api
    from autotp.runtime.execution import cudagraphs

    torch.cuda.make_graphed_callables = _emulated_make_graphed_callables  # type: ignore[assignment]
    torch.cuda.graph_pool_handle = lambda: None  # type: ignore[assignment]
    cudagraphs._pool_ranges = lambda pool: [(0, 1)]  # no gradient lies there: the caller sets them to None
    autotp.api._check_cuda_graphs = lambda device: None  # type: ignore[assignment]
    shape = Shape("mixtral", 8, 64, 128, 4, 2, 500, 1, 16, experts=8)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build(shape, "cpu").to(torch.bfloat16)
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids}, compile="eager", cuda_graphs=True)
    rows = []
    for step in range(args.steps + 3):
        REPLAYS.clear()
        start = time.perf_counter()
        pm.train_step(input_ids=ids, labels=ids)
        end = time.perf_counter()
        for p in pm.parameters():
            p.grad = None
        if step >= 3:
            forward, backward = REPLAYS
            rows.append(((forward - start) * 1e6, (backward - forward) * 1e6, (end - backward) * 1e6, (end - start) * 1e6))
    names = ("to forward replay", "to backward replay", "to return", "step")
    print(", ".join(f"{n} {statistics.median(c):.1f} us" for n, c in zip(names, zip(*rows))))


if __name__ == "__main__":
    main()
