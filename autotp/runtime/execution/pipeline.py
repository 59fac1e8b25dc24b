"""Pipeline execution of a rank's chunks.

The compiler cut the rank graph into one graph per chunk (``autotp.ir.program``,
``passes/extract_chunks``): chunk c receives the values crossing from chunk c-1, sends those
crossing into chunk c+1, and the last chunk returns the model's outputs. ``PipelineRunner``
runs a rank's chunks in schedule order, sending activations forward and gradients backward
between neighbouring pipeline ranks.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.fx import GraphModule
from torch.fx._pytree import tree_flatten_spec

from autotp.ir.errors import UserInputError
from autotp.ir import schedules
from autotp.ir.program import Boundary, ChunkProgram
from autotp.runtime.execution.cudagraphs import CapturedGraph
from autotp.runtime.execution.weight_grads import WeightGradStore


@dataclass
class ChunkGraph:
    """One pipeline chunk of this rank as it runs: its program (``autotp.ir.program``), its
    compiled or captured form, and its receive buffers."""

    program: ChunkProgram
    run: Callable[..., Any] | None = None  # torch.compile'd ``graph``, if asked for
    captured: CapturedGraph | None = None  # the program's region-split graph, captured, if asked for
    # Receive buffers by (gradients?, slot), allocated once and reused by every step.
    _buffers: dict[tuple[bool, int], list[Tensor]] = field(default_factory=dict)

    @property
    def chunk(self) -> int:
        return self.program.spec.chunk

    @property
    def graph(self) -> GraphModule:
        return self.program.graph

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.program.spec.input_names

    @property
    def recv(self) -> tuple[Boundary, ...]:
        return self.program.spec.recv

    @property
    def send(self) -> tuple[Boundary, ...]:
        return self.program.spec.send

    @property
    def is_last(self) -> bool:
        return self.program.spec.is_last

    def __call__(self, *args: Any, slot: int = 0, split_backward: bool = False) -> Any:
        """``slot``: the CUDA-graph static buffers this microbatch uses (``schedules.buffer_slots``);
        ``split_backward``: record the linear weights' gradients for a later ``W`` (``weight_grads``)."""
        if split_backward:
            assert self.run is None and self.captured is None, "checked by PipelineRunner.run_step"
            deferred = self.program.deferred
            assert deferred is not None, "split_weight_grads gives every pipeline chunk its deferred copy"
            return deferred(*args)
        if self.captured is not None:
            return self.captured(*args, slot=slot)
        return (self.run if self.run is not None else self.graph)(*args)

    def buffers(self, grads: bool, slot: int, device: torch.device) -> list[Tensor]:
        """Receive buffers of ``slot``: the inputs, or the gradients of the outputs that need one.
        Gradients for an uncaptured chunk are fresh tensors: autograd may keep one as a
        parameter's ``.grad`` (a parameter the chunk sends on, or expands from a dim of size
        1), and the next microbatch's receive into a reused buffer would overwrite it."""
        if grads and self.captured is None:
            return [torch.empty(b.shape, dtype=b.dtype, device=device) for b in self.send if b.needs_grad]
        key = (grads, slot)
        if key not in self._buffers:
            values = [b for b in self.send if b.needs_grad] if grads else self.recv
            self._buffers[key] = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in values]
        return self._buffers[key]


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
    connected: bool = False  # whether every rank of each group has joined a collective on it


@dataclass(frozen=True)
class Transfer:
    """One point-to-point send or receive of one tensor."""

    send: bool
    tensor: Tensor
    peer: int  # world rank
    group: dist.ProcessGroup | None
    tag: int


def post(transfers: Sequence[Transfer]) -> list[list[dist.Work]]:
    """Start ``transfers`` without waiting: one ``batch_isend_irecv`` per process group.
    Returns, for each transfer, the works to wait for before its tensor may be read or reused.

    Every point-to-point operation of the pipeline goes through here. NCCL matches the
    sends and receives between two ranks of a group in the order they are posted, so
    each rank posts them in the order of its schedule; gloo matches them by tag.
    """
    by_group: dict[int, list[int]] = {}
    for i, t in enumerate(transfers):
        by_group.setdefault(id(t.group), []).append(i)
    waits: list[list[dist.Work]] = [[] for _ in transfers]
    for indices in by_group.values():
        ops_ = [transfers[i] for i in indices]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, t.peer, t.group, t.tag) for t in ops_])
        per_op = len(works) == len(indices)  # gloo: one work per operation; NCCL: one for the batch
        for k, i in enumerate(indices):
            waits[i] = [works[k]] if per_op else works
    return waits


@dataclass
class _InFlight:
    """What one (chunk, microbatch) keeps between its forward and its backward (and ``W``)."""

    inputs: list[Tensor]  # received activations, as autograd leaves
    roots: list[Tensor]  # outputs sent on, whose gradients come back
    loss: Tensor | None = None  # on the last chunk: this microbatch's share of the step's loss
    weights: WeightGradStore | None = None  # the deferred weight gradients, between B and W


@dataclass
class _Receive:
    buffers: list[Tensor]
    transfers: list[Transfer]
    works: list[dist.Work] | None = None  # None until posted


@dataclass
class _Batch:
    """The sends and receives a rank posts together in one time step."""

    sends: list[Transfer] = field(default_factory=list)
    receives: list[_Receive] = field(default_factory=list)


class PipelineRunner:
    """Runs one rank's chunks through a schedule of (kind, chunk, microbatch) actions.

    Communication is planned from the schedule before the step (``schedules.timeline``,
    ``schedules.messages``): every rank posts, in time-step order, one batch per step
    with the sends of its previous action and the receives of what its neighbours sent
    in that step, and makes the compute wait for a receive only when the action that
    reads it starts (on NCCL a stream wait: the host never blocks). Shapes come from
    the trace, so nothing is exchanged per microbatch but the tensors. Receives land in
    each chunk's buffers (``schedules.receive_slots``), allocated once and reused by
    every step, as many as microbatches in flight. A microbatch's activations, outputs
    and autograd graph are dropped by its backward (``B``); with the backward split,
    all but the linears' inputs and output gradients by ``B`` and those by ``W``.
    """

    def __init__(self, chunks: dict[int, ChunkGraph], groups: PipelineGroups, device: torch.device, graph: GraphModule) -> None:
        self.chunks = chunks
        self._placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        self._in_spec = graph._in_spec
        outputs = [n.meta.get("val") for n in graph.graph.find_nodes(op="output")[0].all_input_nodes]
        # the step's loss is summed in float32, or wider where the model computes wider (every rank alike)
        floats = [v.dtype for v in outputs if isinstance(v, Tensor) and v.is_floating_point()]
        self._loss_dtype = functools.reduce(torch.promote_types, floats, torch.float32)
        self.groups = groups
        self.device = device
        self._sends: list[tuple[list[dist.Work], list[Tensor]]] = []
        self._receives: dict[tuple[str, int, int], _Receive] = {}
        # With ``measure_busy``, each chunk's compute is timed between device syncs
        # (waits for peers excluded), so a step's idle share can be measured.
        self.measure_busy = False
        self.busy_s = 0.0

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _tag(self, stage: int, microbatch: int) -> int:
        return stage * 100_000 + microbatch

    def _connect(self) -> None:
        """Join each group once with every rank (NCCL creates a group's communicator on
        its first collective, which a batch of point-to-point operations must not be)."""
        if not self.groups.connected:
            for group in (self.groups.forward, self.groups.backward):
                dist.barrier(group=group)
            self.groups.connected = True

    # ---- point-to-point ----------------------------------------------------------------

    def _transfers(self, send: bool, kind: str, stage: int, peer_stage: int, microbatch: int, tensors: list[Tensor]) -> list[Transfer]:
        """Transfers of ``tensors`` between virtual stages (``kind`` F: activations, B: gradients)."""
        group = self.groups.forward if kind == "F" else self.groups.backward
        peer = self.groups.pp_ranks[peer_stage % self.groups.pp]
        tag = self._tag(stage if send else peer_stage, microbatch)
        return [Transfer(send, t, peer, group, tag) for t in tensors]

    def _expect(self, kind: str, chunk: int, microbatch: int, slot: int) -> _Receive:
        """Register the receive that action ``kind`` of ``chunk`` reads (F: inputs, B: output gradients)."""
        buffers = self.chunks[chunk].buffers(kind == "B", slot, self.device)
        src = chunk - 1 if kind == "F" else chunk + 1
        recv = _Receive(buffers, self._transfers(False, kind, chunk, src, microbatch, buffers), None if buffers else [])
        self._receives[kind, chunk, microbatch] = recv
        return recv

    def _post(self, batch: _Batch) -> None:
        self._sends = [(works, kept) for works, kept in self._sends if not all(w.is_completed() for w in works)]
        transfers = batch.sends + [t for r in batch.receives for t in r.transfers]
        if not transfers:
            return
        waits = post(transfers)
        if batch.sends:
            self._sends.append(([w for ws in waits[: len(batch.sends)] for w in ws], [t.tensor for t in batch.sends]))
        at = len(batch.sends)
        for recv in batch.receives:
            recv.works = [w for ws in waits[at : at + len(recv.transfers)] for w in ws]
            at += len(recv.transfers)

    def _received(self, kind: str, chunk: int, microbatch: int) -> list[Tensor]:
        """The tensors this action receives, once they have arrived (posted now if no plan did)."""
        recv = self._receives.pop((kind, chunk, microbatch), None)
        if recv is None:
            cg = self.chunks[chunk]
            if (kind == "F" and chunk == 0) or (kind == "B" and cg.is_last):
                return []
            recv = self._expect(kind, chunk, microbatch, 0)
            self._receives.pop((kind, chunk, microbatch))
            self._post(_Batch(receives=[recv]))
        assert recv.works is not None, f"the receive of {kind}{chunk}.{microbatch} was planned but never posted"
        for work in recv.works:
            work.wait()
        return recv.buffers

    # ---- actions -------------------------------------------------------------------------

    def forward(self, chunk: int, microbatch: int, inputs: dict[str, Any], grad: bool, slot: int = 0,
                split_backward: bool = False) -> tuple[_InFlight, Any, list[Transfer]]:  # fmt: skip
        """Run a forward: (what its backward needs, the chunk's outputs, the sends to post)."""
        cg = self.chunks[chunk]
        received = self._received("F", chunk, microbatch)
        leaves = [t.detach().requires_grad_(grad and b.needs_grad) for t, b in zip(received, cg.recv)]
        args = [inputs[name] for name in cg.input_names] + leaves
        start = self._sync() if self.measure_busy else 0.0
        with torch.set_grad_enabled(grad):
            outputs = cg(*args, slot=slot, split_backward=split_backward)
        if self.measure_busy:
            self.busy_s += self._sync() - start
        flight = _InFlight(leaves if grad else [], [])
        if cg.is_last:
            return flight, outputs, []
        outputs = list(outputs)
        for t, b in zip(outputs, cg.send):
            if t.requires_grad and not b.needs_grad and grad:
                raise RuntimeError(f"chunk {chunk} sends a value that requires grad but was traced without: {b}")
        if grad:
            flight.roots = [t for t, b in zip(outputs, cg.send) if b.needs_grad]
        return flight, outputs, self._transfers(True, "F", chunk, chunk + 1, microbatch, [t.detach().contiguous() for t in outputs])

    def backward(self, chunk: int, microbatch: int, flight: _InFlight) -> list[Transfer]:
        """Run a backward (only the input gradients if ``flight.weights``): the sends to post."""
        cg = self.chunks[chunk]
        grads = self._received("B", chunk, microbatch)
        start = self._sync() if self.measure_busy else 0.0
        if cg.is_last:
            assert flight.loss is not None
            roots, grads = [flight.loss], [None]
        else:
            roots = flight.roots
        pairs = [(t, g) for t, g in zip(roots, grads) if t.requires_grad]
        if pairs:
            with flight.weights.collecting() if flight.weights is not None else contextlib.nullcontext():
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.measure_busy:
            self.busy_s += self._sync() - start
        flight.roots, flight.loss = [], None
        if chunk == 0:
            flight.inputs = []
            return []
        # A copy of a CUDA graph's static gradient buffer, which a later replay would overwrite.
        copy = cg.captured is not None
        in_grads = [
            (t.grad.clone() if copy else t.grad) if t.grad is not None else torch.zeros_like(t)
            for t, b in zip(flight.inputs, cg.recv)
            if b.needs_grad
        ]
        flight.inputs = []
        return self._transfers(True, "B", chunk, chunk - 1, microbatch, in_grads)

    def weights(self, flight: _InFlight) -> None:
        """Run a ``W``: the weight gradients ``backward`` deferred."""
        assert flight.weights is not None
        start = self._sync() if self.measure_busy else 0.0
        flight.weights.apply()
        if self.measure_busy:
            self.busy_s += self._sync() - start
        flight.weights = None

    # ---- steps ---------------------------------------------------------------------------

    def _by_placeholder(self, call: dict[str, Any]) -> dict[str, Any]:
        """``call``'s tensors under the names the chunks read them by (``batch["ids"]`` -> ``batch_ids``)."""
        return dict(zip(self._placeholders, tree_flatten_spec(((), call), self._in_spec)))

    def run_forward(self, call: dict[str, Any]) -> list[Tensor] | None:
        """Forward only, one microbatch through this rank's chunks: the last chunk's outputs (if here)."""
        call = self._by_placeholder(call)
        self._connect()
        leaves = None
        with torch.no_grad():
            for chunk in sorted(self.chunks):
                _, outputs, sends = self.forward(chunk, 0, call, grad=False)
                self._post(_Batch(sends=sends))
                if self.chunks[chunk].is_last:
                    leaves = list(outputs)
        self.finish()
        return leaves

    def _plan(self, times: list[dict[schedules.Action, int]]) -> dict[int, _Batch]:
        """This rank's batch of receives per time step (``schedules.messages``)."""
        pp, rank = self.groups.pp, self.groups.pp_rank
        received = [m for m in schedules.messages(pp, len(self.chunks), times) if m.dst == rank]
        slots = schedules.receive_slots(pp, times, received, rank)
        batches: dict[int, _Batch] = {}
        for m in received:
            chunk = m.stage + 1 if m.kind == "F" else m.stage - 1
            batches.setdefault(m.step, _Batch()).receives.append(self._expect(m.kind, chunk, m.microbatch, slots[m]))
        return batches

    def run_step(self, order_of: Callable[[int], Sequence[schedules.Action]], calls: list[dict[str, Any]],
                 loss_of: Callable[[Any], Tensor], out_spec: Any) -> Tensor:  # fmt: skip
        """Forward and backward of every microbatch, each pipeline rank ``r`` in the order
        ``order_of(r)``; returns the sum of the losses computed here (zero off the last
        stage). Gradients accumulate into ``.grad``, each loss scaled by 1/microbatches."""
        pp, rank = self.groups.pp, self.groups.pp_rank
        calls = [self._by_placeholder(c) for c in calls]
        times = schedules.timeline(pp, len(self.chunks), len(calls), order_of)
        actions = order_of(rank)
        slots = schedules.buffer_slots(actions)
        split = schedules.splits_backward(actions)
        if split and any(cg.run is not None or cg.captured is not None for cg in self.chunks.values()):
            raise UserInputError(
                "zero-bubble schedules split each chunk's backward into input and weight gradients, but "
                "torch.compile and CUDA graphs run a chunk's backward as one piece: parallelize without "
                "compile=True / cuda_graphs=True for this schedule, or use 1f1b, interleaved or gpipe"
            )
        self._connect()
        batches = self._plan(times)
        posted = -1
        total = torch.zeros((), device=self.device, dtype=self._loss_dtype)
        flights: dict[tuple[int, int], _InFlight] = {}
        for action in actions:
            step, chunk, mb = times[rank][action], action.chunk * pp + rank, action.microbatch
            for t in range(posted + 1, step + 1):
                self._post(batches.pop(t, _Batch()))
            posted = step
            sends: list[Transfer] = []
            if action.kind == "F":
                flight, outputs, sends = self.forward(chunk, mb, calls[mb], True, slots[action.chunk, mb], split)
                if self.chunks[chunk].is_last:
                    loss = loss_of(torch.utils._pytree.tree_unflatten(list(outputs), out_spec))
                    flight.loss = loss / len(calls)
                    total += loss.detach().to(self._loss_dtype)
                del outputs
                flight.weights = WeightGradStore() if split else None
                flights[chunk, mb] = flight
            elif action.kind == "B":
                sends = self.backward(chunk, mb, flights[chunk, mb] if split else flights.pop((chunk, mb)))
            else:
                self.weights(flights.pop((chunk, mb)))
            if sends:
                batches.setdefault(step + 1, _Batch()).sends.extend(sends)
        for t in sorted(batches):
            self._post(batches[t])
        self.finish()
        return total

    def finish(self) -> None:
        """Wait for every send of the step (a peer that never receives times out here)."""
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends.clear()
        assert not self._receives, f"receives planned but never read: {sorted(self._receives)}"
