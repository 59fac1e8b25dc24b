"""``ParallelModel``: the nn.Module of one rank, its signature cache and its training step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from autotp.analysis.trace import structure_copy
from autotp.compiler import Lowered, lower_signature
from autotp.ir import schedules
from autotp.ir.plan import ParallelPlan
from autotp.runtime import collectives, cudagraphs, grad_sync, guards
from autotp.runtime.groups import Coords
from autotp.runtime.parameters import ParamChunks, Parameters, graph_param_chunks
from autotp.runtime.pipeline import ChunkGraph, PipelineRunner, extract_chunks
from autotp.ir.errors import UserInputError


@dataclass
class _Compiled:
    """One input signature, compiled: the full per-rank graph and this rank's chunks."""

    graph: GraphModule
    chunks: dict[int, ChunkGraph]
    param_chunks: ParamChunks
    run: Callable[..., Any]  # ``graph``, its torch.compile'd form, or its CUDA-graph capture


class _StructureOnly:
    """Holds the meta copy used for retracing without registering it as a submodule."""

    def __init__(self, model: nn.Module) -> None:
        self.model = structure_copy(model)


class ParallelModel(nn.Module):
    """This rank's part of a tensor-, pipeline- and data-parallel model.

    Its parameters are this rank's shards (only the layers of its pipeline stage),
    registered under the original names, so ``torch.optim.AdamW(pm.parameters())``
    trains it. Calling it like the original model returns the same output type on every
    rank (loss identical on every rank, sharded outputs gathered). Each new input
    signature (names, shapes, dtypes, train/eval) is traced and compiled once.
    ``plan`` is the plan of the first signature, with the CUDA-graph regions it chose.
    """

    def __init__(
        self,
        model: nn.Module,
        first: Lowered,
        first_kwargs: dict[str, Any],
        coords: Coords,
        device: torch.device,
        compile_graphs: bool,
    ) -> None:
        super().__init__()
        self.plan: ParallelPlan = first.plan
        self._compile_graphs = compile_graphs
        self._coords = coords
        self._device = device
        self._source = _StructureOnly(model)
        self._forward_params = list(inspect.signature(model.forward).parameters)
        self._inject = {"use_cache": False} if "use_cache" in self._forward_params else {}
        self._graphs: dict[tuple, _Compiled] = {}
        self.pass_timings: dict[str, float] = {}
        self.measure_busy = False
        self.last_busy_s = 0.0  # with measure_busy: this rank's compute time in the last pipeline step
        self._params = Parameters(self, self.plan, coords, device, self._source.model)
        many = dist.is_initialized() and dist.get_world_size() > 1
        self._failure_watch = guards.FailureWatch() if many else None
        pp_group = coords.pipeline.pp_group if coords.pipeline is not None else None
        self._input_check = guards.InputCheck([("tp", collectives.get_group(coords.tp_key)), ("pp", pp_group)] if many else [])
        compiled = self._prepare(first)
        self._params.bind(model, compiled.param_chunks, set(self.my_chunks))
        owners = {name: self._params.owners(compiled.param_chunks, name) for name in self._params.aliases}
        self._shared_param_groups = grad_sync.shared_param_groups(self.plan, coords, owners)
        self._attach(compiled)
        self.train(model.training)
        self._graphs[guards.signature_key(first_kwargs, model.training)] = compiled

    @property
    def my_chunks(self) -> list[int]:
        return [c for c in range(self.plan.num_chunks) if self.plan.pp_rank_of_chunk(c) == self._coords.pp_rank]

    # ---- compilation ---------------------------------------------------------------

    def _prepare(self, lowered: Lowered) -> _Compiled:
        """This rank's chunks of a lowered graph, and how to run them."""
        gm = lowered.graph
        param_chunks = graph_param_chunks(gm)
        for k, v in lowered.pass_s.items():
            self.pass_timings[k] = self.pass_timings.get(k, 0.0) + v
        chunks = extract_chunks(gm, self.plan.num_chunks, self.plan.tp, only=self.my_chunks) if self.plan.num_chunks > 1 else {}
        run: Callable[..., Any] = gm
        if self._compile_graphs:
            run = torch.compile(gm)
            for cg in chunks.values():
                cg.run = torch.compile(cg.graph)
        if self.plan.cudagraphs:
            run = cudagraphs.CapturedGraph(gm, self.plan.cudagraph_impl)
            for cg in chunks.values():
                cg.captured = cudagraphs.CapturedGraph(cg.graph, self.plan.cudagraph_impl)
        return _Compiled(gm, chunks, param_chunks, run)

    def _attach(self, compiled: _Compiled) -> None:
        self._params.attach([c.graph for c in compiled.chunks.values()] or [compiled.graph])

    def graph_for(self, *args: Any, **kwargs: Any) -> GraphModule:
        """The compiled per-rank graph (all chunks, stage boundaries marked) for these inputs."""
        return self._compiled_for(self._as_kwargs(args, kwargs)).graph

    def _compiled_for(self, call: dict[str, Any]) -> _Compiled:
        key = guards.signature_key(call, self.training)
        compiled = self._graphs.get(key)
        if compiled is None:
            self._source.model.train(self.training)
            backend = dist.get_backend() if dist.is_initialized() else "nccl"
            try:
                lowered = lower_signature(self._source.model, call, self.plan, tp_rank=self._coords.tp_rank,
                                          device=self._device, backend=backend)  # fmt: skip
            except ValueError as e:
                guards.explain_retrace_failure(call, list(self._graphs), e)
                raise
            compiled = self._prepare(lowered)
            self._attach(compiled)
            self._graphs[key] = compiled
        return compiled

    def _as_kwargs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        call = dict(zip(self._forward_params, args))
        call.update(kwargs)
        for k, v in self._inject.items():
            call.setdefault(k, v)
        return {k: v for k, v in call.items() if v is not None}

    # ---- running -------------------------------------------------------------------

    @guards.guarded
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this rank's inputs. With pp > 1 this is forward-only (no
        autograd across stages: use ``train_step``), and every rank gets the outputs."""
        call = self._as_kwargs(args, kwargs)
        compiled = self._compiled_for(call)
        if self.plan.num_chunks == 1:
            return compiled.run(**call)
        return self._pipeline_forward(compiled, call)

    def _pipeline_forward(self, compiled: _Compiled, call: dict[str, Any]) -> Any:
        runner = self._runner(compiled)
        leaves: Any = None
        with torch.no_grad():
            for chunk in sorted(self.my_chunks):
                flight = runner.forward(chunk, 0, call, grad=False)
                if compiled.chunks[chunk].is_last:
                    leaves = list(flight.outputs)
            runner.finish()
        return self._broadcast_outputs(compiled, leaves)

    def _broadcast_outputs(self, compiled: _Compiled, leaves: list[torch.Tensor] | None) -> Any:
        """The last stage's outputs on every pipeline rank."""
        pipe = self._coords.pipeline
        assert pipe is not None
        out_node = next(n for n in compiled.graph.graph.nodes if n.op == "output")
        specs = [a.meta["val"] for a in torch.utils._pytree.tree_leaves(out_node.args[0])]
        last = pipe.pp_ranks[self.plan.pp_rank_of_chunk(self.plan.num_chunks - 1)]
        if leaves is None:
            leaves = [torch.empty(v.shape, dtype=v.dtype, device=self._device) for v in specs]
        for t in leaves:
            dist.broadcast(t, src=last, group=pipe.pp_group)
        return torch.utils._pytree.tree_unflatten(leaves, compiled.graph._out_spec)

    def _runner(self, compiled: _Compiled) -> PipelineRunner:
        assert self._coords.pipeline is not None
        return PipelineRunner(compiled.chunks, self._coords.pipeline, self._device)

    @guards.guarded
    def train_step(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_microbatches: int | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        schedule: str | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of the global batch, split over dp ranks and microbatches.

        Every rank passes the same global batch. Returns the mean loss over the global
        batch (detached), identical on every rank. Without ``labels``,
        ``loss_fn(outputs) -> scalar`` supplies the loss (on the last pipeline stage).
        Gradients are accumulated into ``.grad`` and averaged over dp ranks; the caller
        steps and zeroes the optimizer. ``num_microbatches`` and ``schedule`` (``1f1b``,
        ``gpipe`` or ``interleaved``) default to the plan's ``microbatches`` and
        ``schedule_name`` (``1f1b``, or ``interleaved`` when vpp > 1, unless planned).
        """
        if labels is None and loss_fn is None:
            raise UserInputError("train_step needs labels= or loss_fn=")
        batch = {k: v for k, v in dict(kwargs, input_ids=input_ids, labels=labels).items() if v is not None}
        size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        dp = self.plan.dp
        m = self.plan.microbatches if num_microbatches is None else num_microbatches
        if m < 1 or size % (dp * m):
            raise UserInputError(
                f"the global batch of {size} does not split into dp={dp} x {m} microbatches; "
                f"use a batch size that is a multiple of {dp * max(m, 1)}"
            )
        step = size // (dp * m)
        first = self._coords.dp_rank * step * m
        micro = [
            {k: (v[first + i * step : first + (i + 1) * step] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            for i in range(m)
        ]
        loss_of = loss_fn if loss_fn is not None else (lambda out: out.loss)
        if self.plan.num_chunks == 1:
            total = torch.zeros((), device=self._device)
            for mb in micro:
                loss = loss_of(self(**mb))
                (loss / m).backward()
                total += loss.detach().float()
        else:
            total = self._pipeline_step(micro, loss_of, schedule or self.plan.schedule_name)
        self._sync_grads()
        return grad_sync.mean_loss(self.plan, self._coords, total / m)

    def _pipeline_step(self, micro: list[dict[str, Any]], loss_of: Callable[[Any], torch.Tensor], name: str) -> torch.Tensor:
        pp, vpp = self.plan.pp, self.plan.vpp
        calls = [self._as_kwargs((), mb) for mb in micro]
        compiled = self._compiled_for(calls[0])
        runner = self._runner(compiled)
        runner.measure_busy = self.measure_busy
        total = torch.zeros((), device=self._device)
        flights: dict[tuple[int, int], Any] = {}
        losses: dict[int, torch.Tensor] = {}
        actions = schedules.schedule(name, pp, vpp, len(micro), self._coords.pp_rank)
        slots = schedules.buffer_slots(actions)
        for action in actions:
            chunk = action.chunk * pp + self._coords.pp_rank
            key = (chunk, action.microbatch)
            if action.kind == "F":
                slot = slots[action.chunk, action.microbatch]
                flights[key] = runner.forward(chunk, action.microbatch, calls[action.microbatch], grad=True, slot=slot)
                if compiled.chunks[chunk].is_last:
                    out = torch.utils._pytree.tree_unflatten(list(flights[key].outputs), compiled.graph._out_spec)
                    loss = loss_of(out)
                    losses[action.microbatch] = loss / len(micro)
                    total += loss.detach().float()
            else:
                runner.backward(chunk, action.microbatch, flights.pop(key), losses.pop(action.microbatch, None))
        runner.finish()
        self.last_busy_s = runner.busy_s
        return total

    def _sync_grads(self) -> None:
        shared = self._params.local_grads(list(self._shared_param_groups))
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        grad_sync.sync_grads(self.plan, self._coords, shared, self._shared_param_groups, grads)

    @property
    def cudagraph_slots(self) -> dict[int, int]:
        """Per chunk of this rank: the CUDA-graph captures made so far, one per microbatch
        the schedule held in flight (``autotp.runtime.cudagraphs``), summed over input signatures."""
        slots: dict[int, int] = {}
        for compiled in self._graphs.values():
            captures = {c: cg.captured for c, cg in compiled.chunks.items()} or {0: compiled.run}
            for chunk, captured in captures.items():
                if isinstance(captured, cudagraphs.CapturedGraph):
                    slots[chunk] = slots.get(chunk, 0) + captured.slots
        return slots

    # ---- checkpoints ---------------------------------------------------------------

    def _first_compiled(self) -> _Compiled:
        return next(iter(self._graphs.values()))

    def unshard_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers under every original name (tied names included)."""
        return self._params.unshard_state_dict(self._first_compiled().param_chunks)

    def unshard_grads(self) -> dict[str, torch.Tensor | None]:
        """Full gradients under every original parameter name (None where no grad)."""
        return self._params.unshard_grads(self._first_compiled().param_chunks)
