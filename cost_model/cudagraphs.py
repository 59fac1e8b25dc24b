"""Is a CUDA-graph region worth capturing? Host time saved against static memory.

Eager PyTorch spends host time on every op of a per-rank graph: the generated Python,
the dispatcher, autograd bookkeeping and the kernel launch, ``launch_s`` per forward
op and again per backward op. The GPU runs asynchronously, so a region costs about
max(host time, GPU time): when the ops are small the GPU waits for the host
(launch-bound). A captured region replays with one graph launch forward and one
backward (``replay_s`` each, the Python of the graphed autograd function included)
and first copies its non-parameter inputs into static buffers (and, backward, the
incoming gradients).

For a region (``region_stats``), with this rank's local shapes:

* ``launches`` = Σ over kernel nodes of 1 + ``BACKWARD_LAUNCHES`` if the node needs
  grad (training is assumed). Kernel nodes launch GPU work: ``flops.node_cost`` gives
  them FLOPs or bytes, or they are collectives; views, ``getitem``, Megatron's *f*
  forward and stage boundaries launch nothing.
* ``gpu_s`` = Σ roofline time (``flops.compute_time_s``) forward, times
  (1 + ``BACKWARD_GPU_FACTOR``) for nodes that need grad, plus the alpha-beta time of
  the all-reduces and all-gathers (``communication.group_collective_s``, inside a node).
* ``copy_bytes`` = the region's non-parameter inputs (copied before the forward replay)
  + its outputs that need grad (their gradients are copied before the backward replay).
* ``static_bytes`` = inputs + every tensor made by a kernel node (outputs and
  intermediates): what the graph pins, an upper bound since intermediates of regions
  captured in order share one memory pool.
* ``slots``: with pp > 1 a stage holds several microbatches in flight, each in its own
  capture (``autotp.runtime.execution.cudagraphs``): ``schedules.slots_per_chunk`` under the default
  schedule, ``pp - stage`` for 1F1B. The region pins ``slots · static_bytes``.

``saved_s`` (``estimate``) = max(launches · launch_s, gpu_s)
                              − max(replays · replay_s, gpu_s + 2 · copy_bytes / memory bandwidth)
with replays = 2 when the region needs grad, else 1.

``decide`` captures, in order of ``saved_s`` per pinned byte, every region with
``saved_s > policy.min_saved_s`` whose pinned bytes still fit ``policy.max_static_bytes``
(a budget per GPU: ``choose_regions`` calls it once per pipeline stage).
Compute-bound regions save nothing (GPU time dominates both sides) and are declined.
Times are for ``plan.hardware``, the GPU kind the plan runs on.

``choose_cudagraph_regions`` is the compiler's decision step between the passes
``find_cudagraph_candidates`` and ``mark_cudagraph_regions``: it writes the chosen candidate
ids into ``plan.cudagraph_regions``, which the later passes and the runtime read.

Constants (``autotp.ir.plan.CudaGraphPolicy`` defaults). ``launch_s`` = 26 µs is measured: on an H200
host (torch 2.11, ``benchmarks/bench_cudagraphs.py``, launch case: Llama 24 layers,
h=512, batch 1, seq 128, bf16) an eager autotp training step takes 74.4 ms for the cost
model's 2,796 launches at tp=1 (26.6 µs each; 29.9 µs at tp=2), while the captured step
takes 9.0 ms. It covers the generated Python, dispatch, autograd
and the launch of an op of a per-rank graph, forward or backward. ``replay_s`` = 20 µs
(a ``cudaGraphLaunch`` plus the graphed autograd function's Python) is an estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from torch.fx import GraphModule, Node

from autotp.ir import meta_keys
from autotp.ir.plan import DEFAULT_HARDWARE, CudaGraphPolicy, ParallelPlan
from autotp.cost_model.communication import group_collective_s
from autotp.cost_model.flops import TensorInfo, compute_time_s, node_cost
from autotp.cost_model.hardware import PROFILES
from autotp.passes.find_cudagraph_candidates import candidate_regions, region_slots
from autotp.passes.runner import PassContext
from autotp.ir.op_facts import TAG_COMMUNICATION
from autotp.analysis.local_shapes import local_tensors

BACKWARD_LAUNCHES = 2
BACKWARD_GPU_FACTOR = 2.0


ALWAYS = CudaGraphPolicy(min_saved_s=-1.0, max_static_bytes=2**62)
"""Captures every capturable region (benchmarks that measure capture itself)."""


@dataclass(frozen=True)
class RegionStats:
    """One candidate region's sizes, for ``estimate`` and the report."""

    nodes: int
    launches: int
    gpu_s: float
    needs_grad: bool
    copy_bytes: int
    static_bytes: int
    slots: int = 1

    @property
    def pinned_bytes(self) -> int:
        return self.slots * self.static_bytes


@dataclass(frozen=True)
class Estimate:
    eager_s: float
    graph_s: float

    @property
    def saved_s(self) -> float:
        return self.eager_s - self.graph_s


Tensors = Callable[[Node], list[TensorInfo]]


def _bytes(node: Node, tensors: Tensors) -> int:
    return sum(t.nbytes for t in tensors(node))


def _is_parameter(node: Node) -> bool:
    return node.op == "get_attr"


def region_stats(nodes: Sequence[Node], tensors: Tensors, tp: int, hardware: str, slots: int = 1) -> RegionStats:
    """Sizes of the region made of ``nodes`` (``tensors``: this rank's tensors of a node),
    captured ``slots`` times."""
    hw = PROFILES[hardware]
    inside = set(nodes)
    launches = 0
    gpu_s = 0.0
    static = 0
    needs_grad = False
    inputs: set[Node] = set()
    grad_out = 0
    for n in nodes:
        grad = bool(n.meta.get(meta_keys.NEEDS_GRAD))
        needs_grad |= grad
        inputs.update(a for a in n.all_input_nodes if a not in inside and not _is_parameter(a))
        cost = node_cost(n, tensors)
        tag = n.meta.get(meta_keys.COLLECTIVE)
        comm = TAG_COMMUNICATION[tag][0] if tag is not None else None
        kind = comm.collective if comm is not None and not comm.overlapped else None  # overlapped: costed as its GEMM
        if kind is not None:
            gpu_s += group_collective_s(kind, _bytes(n, tensors), tp, tp, hw)
        elif cost.flops or cost.bytes:
            gpu_s += compute_time_s(cost, hw) * (1 + (BACKWARD_GPU_FACTOR if grad else 0))
        if kind is not None or cost.flops or cost.bytes:
            launches += 1 + (BACKWARD_LAUNCHES if grad else 0)
            static += _bytes(n, tensors)
        if grad and any(u not in inside for u in n.users):
            grad_out += _bytes(n, tensors)
    in_bytes = sum(_bytes(a, tensors) for a in inputs)
    return RegionStats(
        nodes=len(nodes),
        launches=launches,
        gpu_s=gpu_s,
        needs_grad=needs_grad,
        copy_bytes=in_bytes + grad_out,
        static_bytes=in_bytes + static,
        slots=slots,
    )


def estimate(stats: RegionStats, policy: CudaGraphPolicy, hardware: str) -> Estimate:
    """Eager and captured time of one region on ``hardware`` (formula in the module docstring)."""
    memory_bytes_per_s = PROFILES[hardware].memory_bytes_per_s
    replays = 2 if stats.needs_grad else 1
    eager = max(stats.launches * policy.launch_s, stats.gpu_s)
    graph = max(replays * policy.replay_s, stats.gpu_s + 2 * stats.copy_bytes / memory_bytes_per_s)
    return Estimate(eager, graph)


def decide(candidates: Sequence[RegionStats], policy: CudaGraphPolicy, hardware: str = DEFAULT_HARDWARE) -> list[str | None]:
    """Per candidate: None to capture it, else why not (the rule in the module docstring)."""
    estimates = [estimate(s, policy, hardware) for s in candidates]
    verdicts: list[str | None] = [None] * len(candidates)
    order = sorted(range(len(candidates)), key=lambda i: -estimates[i].saved_s / max(candidates[i].pinned_bytes, 1))
    budget = policy.max_static_bytes
    for i in order:
        saved = estimates[i].saved_s
        if saved <= policy.min_saved_s:
            verdicts[i] = (
                f"saves {saved * 1e6:.1f} µs, not more than {policy.min_saved_s * 1e6:.1f} µs "
                f"(eager {estimates[i].eager_s * 1e6:.1f} µs, graph {estimates[i].graph_s * 1e6:.1f} µs)"
            )
        elif candidates[i].pinned_bytes > budget:
            verdicts[i] = (
                f"needs {candidates[i].pinned_bytes} static bytes ({candidates[i].slots} slot(s) of "
                f"{candidates[i].static_bytes}), {budget} left of the budget"
            )
        else:
            budget -= candidates[i].pinned_bytes
    return verdicts


def choose_regions(runs: Sequence[Sequence[Node]], plan: ParallelPlan) -> list[str | None]:
    """The verdict on every candidate run (this rank's nodes, in graph order): None
    (capture) or why not, under ``plan.cudagraph_policy`` on ``plan.hardware``. Each
    pipeline stage has its own memory budget."""
    stages: dict[int, list[int]] = {}
    for i, run in enumerate(runs):
        stages.setdefault(plan.pp_rank_of_chunk(run[0].meta.get(meta_keys.CHUNK) or 0), []).append(i)
    verdicts: list[str | None] = [None] * len(runs)
    for indices in stages.values():
        stats = [region_stats(runs[i], lambda n: local_tensors(n, plan.tp), plan.tp, plan.hardware,
                              region_slots(list(runs[i]), plan)) for i in indices]  # fmt: skip
        for i, verdict in zip(indices, decide(stats, plan.cudagraph_policy, plan.hardware)):
            verdicts[i] = verdict
    return verdicts


def choose_cudagraph_regions(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """The compiler's decision step (module docstring): ``ctx.plan.cudagraph_regions`` becomes
    the candidates of ``gm`` worth capturing. The graph is left as it is."""
    if ctx.plan.cudagraphs:
        verdicts = choose_regions(candidate_regions(gm), ctx.plan)
        ctx.plan = replace(ctx.plan, cudagraph_regions=tuple(i for i, v in enumerate(verdicts) if v is None))
    return gm
