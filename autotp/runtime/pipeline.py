"""Pipeline chunks and their execution.

``split_stages`` marks every value that crosses from chunk c-1 to chunk c with a
``stage_boundary(x, c)`` node (``autotp.ir.ops.STAGE_BOUNDARY``). ``extract_chunks`` cuts the marked graph into one
``GraphModule`` per chunk: the boundary nodes of chunk c become its inputs, the values
that feed chunk c+1's boundaries become its outputs, and the last chunk returns the
model's outputs. ``PipelineRunner`` runs a rank's chunks in schedule order, sending
activations forward and gradients backward between neighbouring pipeline ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

from autotp.analysis.local_shapes import local_shape
from autotp.ir import meta_keys, ops
from autotp.runtime.cudagraphs import CapturedGraph


@dataclass
class ChunkGraph:
    """One pipeline chunk: its graph, what it receives, what it sends."""

    chunk: int
    graph: GraphModule
    input_names: list[str]  # model inputs (placeholders of the traced graph) it reads
    recv_shapes: list[tuple[tuple[int, ...], torch.dtype]]  # per-rank shapes, in order
    num_sends: int
    is_last: bool
    run: Callable[..., Any] | None = None  # torch.compile'd ``graph``, if asked for
    captured: CapturedGraph | None = None  # ``graph`` with CUDA-graph regions, if asked for

    def __call__(self, *args: Any, slot: int = 0) -> Any:
        """``slot``: the CUDA-graph static buffers this microbatch uses (``schedules.buffer_slots``)."""
        if self.captured is not None:
            return self.captured(*args, slot=slot)
        return (self.run or self.graph)(*args)


def extract_chunks(gm: GraphModule, num_chunks: int, tp: int, only: Sequence[int] | None = None) -> dict[int, ChunkGraph]:
    """Per-chunk graphs of a graph marked by ``split_stages`` (``only``: these chunks)."""
    nodes = list(gm.graph.nodes)
    boundaries = {c: [n for n in nodes if n.target is ops.STAGE_BOUNDARY and n.args[1] == c] for c in range(num_chunks)}
    out: dict[int, ChunkGraph] = {}
    for c in only if only is not None else range(num_chunks):
        is_last = c == num_chunks - 1
        sends = [b.args[0] for b in boundaries[c + 1]] if not is_last else []
        own = {n for n in nodes if n.meta.get(meta_keys.CHUNK) == c and n.op != "placeholder"}
        needed: set[Node] = set()
        stack = list(own) + sends
        while stack:
            n = stack.pop()
            if n in needed:
                continue
            needed.add(n)
            if n.target is ops.STAGE_BOUNDARY and n.args[1] == c:
                continue  # received, not computed
            stack.extend(a for a in n.all_input_nodes if a.meta.get(meta_keys.CHUNK) is None or a in own)
        graph = Graph()
        env: dict[Node, Node] = {}
        inputs = [n for n in nodes if n.op == "placeholder" and n in needed]
        for p in inputs:
            env[p] = graph.placeholder(p.name)
            env[p].meta.update(p.meta)
        for b in boundaries[c]:
            env[b] = graph.placeholder(f"recv_{b.args[0].name}")
            env[b].meta.update(b.meta)
        for n in nodes:
            if n in needed and n not in env and n.op != "output":
                env[n] = graph.node_copy(n, lambda a: env[a])
        if is_last:
            output = next(n for n in nodes if n.op == "output")
            graph.output(torch.fx.node.map_arg(output.args[0], lambda a: env[a]))
        else:
            graph.output(tuple(env[s] for s in sends))
        out[c] = ChunkGraph(
            chunk=c,
            graph=GraphModule(gm, graph),
            input_names=[p.name for p in inputs],
            recv_shapes=[(local_shape(b, tp), b.meta["val"].dtype) for b in boundaries[c]],
            num_sends=len(sends),
            is_last=is_last,
        )
    return out


@dataclass
class PipelineGroups:
    """Process groups a pipeline rank talks through (one per direction, so that
    activations and gradients never wait behind each other)."""

    pp_rank: int
    pp: int
    forward: dist.ProcessGroup | None
    backward: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    pp_ranks: list[int]  # world rank of each pipeline stage, for this rank's tp/dp slot


@dataclass
class _InFlight:
    inputs: list[Tensor]
    outputs: Any
    sends: list[Tensor] = field(default_factory=list)


class PipelineRunner:
    """Runs one rank's chunks through a schedule of (kind, chunk, microbatch) actions."""

    def __init__(self, chunks: dict[int, ChunkGraph], groups: PipelineGroups, device: torch.device) -> None:
        self.chunks = chunks
        self.groups = groups
        self.device = device
        self._pending: list[dist.Work] = []
        # With ``measure_busy``, each chunk's compute is timed between device syncs
        # (waits for peers excluded), so a step's idle share can be measured.
        self.measure_busy = False
        self.busy_s = 0.0

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _peer(self, chunk: int) -> int:
        return self.groups.pp_ranks[chunk % self.groups.pp]

    def _tag(self, chunk: int, microbatch: int) -> int:
        return chunk * 100_000 + microbatch

    def _recv(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], src_chunk: int, microbatch: int, group: Any, grad: bool) -> list[Tensor]:
        tensors = []
        for shape, dtype in shapes:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src=self._peer(src_chunk), group=group, tag=self._tag(src_chunk, microbatch))
            tensors.append(t.requires_grad_(grad and dtype.is_floating_point))
        return tensors

    def _send(self, tensors: list[Tensor], dst_chunk: int, src_chunk: int, microbatch: int, group: Any) -> None:
        for t in tensors:
            work = dist.isend(t.detach().contiguous(), dst=self._peer(dst_chunk), group=group, tag=self._tag(src_chunk, microbatch))
            self._pending.append(work)

    def forward(self, chunk: int, microbatch: int, inputs: dict[str, Any], grad: bool, slot: int = 0) -> _InFlight:
        cg = self.chunks[chunk]
        received = self._recv(cg.recv_shapes, chunk - 1, microbatch, self.groups.forward, grad) if chunk > 0 else []
        args = [inputs[name] for name in cg.input_names] + received
        start = self._sync() if self.measure_busy else 0.0
        with torch.set_grad_enabled(grad):
            outputs = cg(*args, slot=slot)
        if self.measure_busy:
            self.busy_s += self._sync() - start
        flight = _InFlight(received, outputs)
        if not cg.is_last:
            flight.sends = list(outputs)
            self._send(flight.sends, chunk + 1, chunk, microbatch, self.groups.forward)
        return flight

    def backward(self, chunk: int, microbatch: int, flight: _InFlight, loss: Tensor | None) -> None:
        cg = self.chunks[chunk]
        if cg.is_last:
            assert loss is not None
            start = self._sync() if self.measure_busy else 0.0
            loss.backward()
        else:
            shapes = [(tuple(t.shape), t.dtype) for t in flight.sends]
            grads = self._recv(shapes, chunk + 1, microbatch, self.groups.backward, grad=False)
            pairs = [(t, g) for t, g in zip(flight.sends, grads) if t.requires_grad]
            start = self._sync() if self.measure_busy else 0.0
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.measure_busy:
            self.busy_s += self._sync() - start
        if chunk > 0:
            # A copy: the gradient may be a CUDA graph's static buffer, which a later replay
            # would overwrite while the send is still in flight.
            in_grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in flight.inputs]
            self._send(in_grads, chunk - 1, chunk, microbatch, self.groups.backward)

    def finish(self) -> None:
        """Wait for every send of the step (a peer that never receives times out here)."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
