"""``ParallelModel``: the nn.Module of one rank, its signature cache and its training step."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from autotp.analysis.trace import structure_copy
from autotp.compiler import lower_signature, with_param_waits
from autotp.ir import schedules
from autotp.ir.plan import ParallelPlan
from autotp.ir.program import BucketLayout, ChunkProgram, RankProgram
from autotp.runtime import checkpoint_dcp, collectives, cudagraphs, export_hf, grad_norm, grad_sync, guards
from autotp.runtime.grad_buffers import GradBuffers, ParamUse
from autotp.runtime.groups import Coords
from autotp.runtime.parameters import ParamChunks, Parameters, graph_param_chunks, graph_trained_params
from autotp.runtime.pipeline import ChunkGraph, PipelineRunner
from autotp.ir.errors import UserInputError
from autotp.runtime.shard_map import ShardedLocal

log = logging.getLogger(__name__)
REPLICA_CHECK_EVERY = 100


@dataclass
class _Compiled:
    """One input signature, compiled: its rank program, the graph ``graph_for`` shows (the
    whole rank graph with a pipeline, else the one that runs) and this rank's chunks."""

    program: RankProgram
    graph: GraphModule
    chunks: dict[int, ChunkGraph]  # with a pipeline
    param_chunks: ParamChunks
    run: Callable[..., Any]  # without a pipeline: ``graph``, its torch.compile'd form, or its CUDA-graph capture

    def running(self) -> list[ChunkProgram]:
        """The chunk programs this rank runs."""
        return [cg.program for cg in self.chunks.values()] or [self.program.chunks[0]]

    def captures(self) -> list[cudagraphs.CapturedGraph]:
        runs = [self.run, *(cg.captured for cg in self.chunks.values())]
        return [r for r in runs if isinstance(r, cudagraphs.CapturedGraph)]

    def graphs(self) -> list[GraphModule]:
        """Every graph module of the signature: the program's and the captures'."""
        program = [m for m in self.program.graph.modules() if isinstance(m, GraphModule)]
        return program + [g for c in self.captures() for g in c.graphs()]


class _StructureOnly:
    """Holds the meta copy used for retracing without registering it as a submodule."""

    def __init__(self, model: nn.Module) -> None:
        self.model = structure_copy(model)


ZBH1_REFUSED = ("schedule 'zbh1' adds the linear weight gradients outside autograd, where the DistributedOptimizer's "
                "bucket hooks cannot see them; train with schedule='1f1b' (or 'interleaved') to use it, or step a torch "
                "optimizer on pm.parameters() with zbh1")


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
        first: RankProgram,
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
        # Shared parameters that some stage trains: a stage that only reads one without grad
        # (detached) adds a zero gradient to the sum, so that every holder steps it alike.
        trained = graph_trained_params(compiled.graph)
        self._trained_shared = [n for n in self._shared_param_groups if any(a in trained for a in self._params.aliases[n])]
        self._owners = owners
        self._grad_buffers: GradBuffers | None = None  # set by a DistributedOptimizer
        self._dp_mean: grad_sync.OverlappedDpMean | None = None  # made by the first train_step with dp > 1, pp = 1
        self._clip_calls = 0
        self._warned_plain = False
        self._attach(compiled)
        self.train(model.training)
        self._graphs[guards.signature_key(first_kwargs, model.training)] = compiled

    def __del__(self) -> None:
        """``del pm`` frees the parameters at once: the graphs (each in a reference cycle with its
        fx ``Graph``, which only the garbage collector breaks) let go of them, and the gradient
        hooks and parameter waits that reach them are removed."""
        compiled = self.__dict__.get("_graphs", {}).values()
        for c in compiled:
            for chunk in c.running():
                if chunk.waits is not None:
                    chunk.waits.callback = None
            Parameters.release(c.graphs())
            for capture in c.captures():
                capture.release()
        if self.__dict__.get("_grad_buffers") is not None:
            self._grad_buffers.remove_hooks()
        if self.__dict__.get("_dp_mean") is not None:
            self._dp_mean.close()

    @property
    def my_chunks(self) -> list[int]:
        return [c for c in range(self.plan.num_chunks) if self.plan.pp_rank_of_chunk(c) == self._coords.pp_rank]

    # ---- compilation ---------------------------------------------------------------

    def _prepare(self, program: RankProgram) -> _Compiled:
        """This rank's chunks of a rank program, and how to run them."""
        param_chunks = graph_param_chunks(program.graph)
        for k, v in program.pass_s.items():
            self.pass_timings[k] = self.pass_timings.get(k, 0.0) + v
        chunks = {c: ChunkGraph(program.chunks[c]) for c in self.my_chunks} if self.plan.num_chunks > 1 else {}
        whole = program.chunks[0]
        graph = program.graph if chunks else whole.graph
        run: Callable[..., Any] = graph
        if self._compile_graphs:
            run = torch.compile(graph)
            for cg in chunks.values():
                cg.run = torch.compile(cg.graph)
        if self.plan.cudagraphs:
            run = cudagraphs.CapturedGraph(whole.captured, self.plan.cudagraph_impl)
            for cg in chunks.values():
                cg.captured = cudagraphs.CapturedGraph(cg.program.captured, self.plan.cudagraph_impl)
        return _Compiled(program, graph, chunks, param_chunks, run)

    def _attach(self, compiled: _Compiled) -> None:
        self._params.attach([g for chunk in compiled.running() for g in chunk.graphs()])

    def _param_buckets(self) -> BucketLayout | None:
        """The DistributedOptimizer's bucket layout, if it overlaps its all-gather with the forward."""
        buffers = self._grad_buffers
        if buffers is None or not buffers.overlap or buffers.dp == 1:
            return None
        return buffers.bucket_layout(self._params.aliases)

    def _install_param_waits(self, compiled: _Compiled) -> None:
        """With a DistributedOptimizer that overlaps its all-gather: each graph waits for a bucket before reading it."""
        layout = self._param_buckets()
        if layout is None:
            return
        if any(chunk.waits is None for chunk in compiled.running()):
            backend = dist.get_backend() if dist.is_initialized() else "nccl"
            with_param_waits(compiled.program, layout, tp_rank=self._coords.tp_rank, device=self._device, backend=backend)
        for chunk in compiled.running():
            waits = chunk.waits
            assert waits is not None
            waits.callback = self._grad_buffers.wait_bucket

    def _finish_param_gather(self) -> None:
        """Wait for the DistributedOptimizer's all-gather in flight, before reading or writing parameters."""
        if self._grad_buffers is not None:
            self._grad_buffers.wait_params()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s (``parameters()`` too), after the DistributedOptimizer's all-gather in flight."""
        self._finish_param_gather()
        return super().named_parameters(*args, **kwargs)

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
                program = lower_signature(self._source.model, call, self.plan, tp_rank=self._coords.tp_rank,
                                          device=self._device, backend=backend, param_buckets=self._param_buckets())  # fmt: skip
            except ValueError as e:
                guards.explain_retrace_failure(call, list(self._graphs), e)
                raise
            compiled = self._prepare(program)
            self._attach(compiled)
            self._install_param_waits(compiled)
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
        leaves = self._runner(compiled).run_forward(call)
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
        ``gpipe``, ``interleaved`` or ``zbh1``) default to the plan's ``microbatches`` and
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
        if self._grad_buffers is not None:
            self._grad_buffers.begin(m)
        else:
            if self.plan.distributed_optimizer and dp > 1 and not self._warned_plain:
                self._warned_plain = True
                log.warning("the plan assumed autotp.DistributedOptimizer (its memory estimate shards the optimizer "
                            "state over dp=%d); this model trains with a plain optimizer", dp)
            if dp > 1 and self.plan.num_chunks == 1:
                self._arm_dp_mean(m)
        # Grads of stage-shared parameters already summed by an earlier step, when the caller accumulates.
        shared = self._params.local_grads(list(self._shared_param_groups)) if self._grad_buffers is None else {}
        carried = {n: g.clone() for n, g in shared.items() if g is not None}
        step = size // (dp * m)
        first = self._coords.dp_rank * step * m
        micro = [
            {k: (v[first + i * step : first + (i + 1) * step] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            for i in range(m)
        ]
        loss_of = loss_fn if loss_fn is not None else (lambda out: out["loss"])  # a dict or a ModelOutput
        if self.plan.num_chunks == 1:
            total = torch.zeros((), device=self._device)
            for mb in micro:
                loss = loss_of(self(**mb))
                (loss / m).backward()
                total += loss.detach().float()
        else:
            total = self._pipeline_step(micro, loss_of, schedule or self.plan.schedule_name)
        self._sync_grads(carried)
        return grad_sync.mean_loss(self.plan, self._coords, total / m)

    def _pipeline_step(self, micro: list[dict[str, Any]], loss_of: Callable[[Any], torch.Tensor], name: str) -> torch.Tensor:
        pp, vpp = self.plan.pp, self.plan.vpp
        if name == "zbh1" and self._grad_buffers is not None:
            raise UserInputError(ZBH1_REFUSED)
        calls = [self._as_kwargs((), mb) for mb in micro]
        compiled = self._compiled_for(calls[0])
        runner = self._runner(compiled)
        runner.measure_busy = self.measure_busy
        total = runner.run_step(lambda rank: schedules.schedule(name, pp, vpp, len(micro), rank), calls, loss_of,
                                compiled.graph._out_spec)  # fmt: skip
        self.last_busy_s = runner.busy_s
        return total

    def _arm_dp_mean(self, backwards: int) -> None:
        params = list(self.parameters())
        if self._dp_mean is None or not self._dp_mean.serves(params):
            if self._dp_mean is not None:
                self._dp_mean.close()
            self._dp_mean = grad_sync.OverlappedDpMean(params, self._coords.dp_group, self.plan.dp, self.plan.dp_bucket_bytes)
        self._dp_mean.begin(backwards)

    def _sync_grads(self, carried: dict[str, torch.Tensor]) -> None:
        if self._grad_buffers is not None:
            self._grad_buffers.finish()
            return
        for name, grad in self._params.local_grads(self._trained_shared).items():
            if grad is None:
                param = self.get_parameter(name)
                param.grad = torch.zeros_like(param)
        shared = self._params.local_grads(list(self._shared_param_groups))
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self._dp_mean is not None and self._dp_mean.armed:
            self._dp_mean.finish()
            grads = []  # averaged over dp already, as the backward ran
        grad_sync.sync_grads(self.plan, self._coords, shared, self._shared_param_groups, grads, carried)

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

    def unshard_state_dict(self, to_rank: int | None = None) -> dict[str, torch.Tensor]:
        """Full tensors under exactly the keys of the original ``model.state_dict()``.

        Collective. With ``to_rank``, only that global rank keeps the result (the others
        return ``{}`` and hold one gathered tensor at a time)."""
        keep = to_rank is None or (dist.get_rank() if dist.is_initialized() else 0) == to_rank
        self._finish_param_gather()
        return self._params.unshard_state_dict(self._first_compiled().param_chunks, keep)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards, each carrying its global offsets, so that
        ``torch.distributed.checkpoint`` saves and reloads every shard (``save_checkpoint``
        adds the optimizer and atomic writes)."""
        self._finish_param_gather()
        out = super().state_dict(*args, **kwargs)
        if kwargs.get("keep_vars"):
            return out
        prefix = kwargs.get("prefix", "")
        specs = self._params.specs
        return {k: ShardedLocal.wrap(v, specs[k[len(prefix) :]]) if k[len(prefix) :] in specs else v for k, v in out.items()}

    def materialize(self, model: nn.Module, checkpoint: str | Path | None, seed: int) -> None:
        """Fill the shards of a model built on meta (``parallelize`` calls this): this rank's
        slices of the HF ``checkpoint``, then the model's own init for the rest."""
        from autotp.runtime.materialize import materialize

        start = time.perf_counter()
        self.checkpoint_bytes_read = materialize(self, self._params, model, checkpoint, seed)
        self.materialize_s = time.perf_counter() - start

    def save_checkpoint(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None,
                        step: int | None = None) -> None:  # fmt: skip
        """Write a DCP checkpoint (collective), loadable at any (tp, pp, dp); atomic."""
        self._finish_param_gather()
        checkpoint_dcp.save(self, self._params, self.plan, self._source.model, directory, optimizer, step)

    def load_checkpoint(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> int | None:
        """Load a checkpoint of ``save_checkpoint`` (collective); returns its step."""
        self._finish_param_gather()
        persistent = set(self._source.model.state_dict(keep_vars=True))
        return checkpoint_dcp.load(self, self._params, persistent, directory, optimizer)

    def save_pretrained(self, directory: str | Path, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """Write HF safetensors (sharded, with the index) and config.json (collective);
        ``transformers`` loads the folder with ``from_pretrained``."""
        self._finish_param_gather()
        export_hf.save_pretrained(self, self._params, self._first_compiled().param_chunks, self._source.model,
                                  directory, max_shard_size, dtype)  # fmt: skip

    def unshard_grads(self) -> dict[str, torch.Tensor | None]:
        """Full gradients under every original parameter name (None where no grad)."""
        if self._grad_buffers is not None and self._grad_buffers.reduced:
            raise UserInputError(
                "the gradients were reduce-scattered over dp by the DistributedOptimizer (each dp rank holds the mean "
                "of its 1/dp slice only), so no rank has them whole; read them before the step ends (pm(...) and "
                "backward, without train_step), or train with a plain optimizer to inspect them"
            )
        return self._params.unshard_grads(self._first_compiled().param_chunks)

    # ---- gradients -----------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; with a DistributedOptimizer, zero its buffers (``.grad`` stays a view of them)."""
        if self._grad_buffers is not None:
            self._grad_buffers.zero_grad()
            return
        super().zero_grad(set_to_none)

    def _param_uses(self, names: list[str]) -> list[ParamUse]:
        """How the gradient buffers lay out ``names``: their chunk, backward passes per microbatch, first use."""
        compiled = self._first_compiled()
        graphs = {c: cg.graph for c, cg in compiled.chunks.items()} or {0: compiled.graph}
        order: dict[tuple[str, int], int] = {}
        for c, gm in graphs.items():
            for i, node in enumerate(gm.graph.nodes):
                for a in node.all_input_nodes:
                    if a.op == "get_attr":
                        order.setdefault((self._params.canonical(str(a.target)), c), i)
        mine = set(self.my_chunks)
        uses = []
        for name in names:
            chunks = self._params.chunks_of(compiled.param_chunks, name) & mine or {min(mine)}
            chunk = min(chunks)
            param = self.get_parameter(name)
            uses.append(ParamUse(name, param, chunk, len(chunks), order.get((name, chunk), -1), name in self._shared_param_groups))
        return uses

    def _norm_counting(self, dp_rank: int | None) -> grad_norm.NormCounting:
        c = self._coords
        return grad_norm.NormCounting(self.plan, c.tp_rank, c.pp_rank, dp_rank, self._params.layouts, self._owners)

    def clip_grad_norm_(self, max_norm: float, error_if_nonfinite: bool = False, check_replicas_every: int = REPLICA_CHECK_EVERY) -> torch.Tensor:
        """Clip this rank's gradients by the global L2 norm, each parameter counted once across tp
        shards and replicas, pipeline stages and dp ranks, as ``torch.nn.utils.clip_grad_norm_`` on
        the unmodified model; returns that norm (the same on every rank). Call it after
        ``train_step``. Every ``check_replicas_every`` calls (the first included) it also runs
        ``check_replicas``."""
        if self._grad_buffers is not None:
            raise UserInputError("this model trains with a DistributedOptimizer, which holds the gradients: call opt.clip_grad_norm_")
        counting = self._norm_counting(self._coords.dp_rank)
        grads = [(n, self.get_parameter(n).grad) for n in self._params.local_names]
        present = [(n, g) for n, g in grads if g is not None]
        squares = grad_norm.sum_of_squares((part for n, g in present for part in counting.counted(n, g)), self._device)
        norm = grad_norm.global_norm(squares, error_if_nonfinite)
        grad_norm.clip_([g for _, g in present], norm, max_norm)
        if check_replicas_every and self._clip_calls % check_replicas_every == 0:
            self.check_replicas()
        self._clip_calls += 1
        return norm

    @torch.no_grad()
    def check_replicas(self) -> list[str]:
        """Compare the parameters that several tp ranks hold (norm weights, shared KV heads) across
        those ranks by checksum; log a warning naming those that differ, and return them."""
        tp = self.plan.tp
        if tp == 1:
            return []
        self._finish_param_gather()
        named, holders = [], []
        for name in self._params.local_names:
            layout = self._params.layouts[name]
            if layout is None:
                replicas = tp
            else:
                counts = {r for _, r in grad_norm.segment_replicas(layout, tp)}
                if len(counts) != 1 or counts == {1}:
                    continue
                replicas = counts.pop()
            base = self._coords.tp_rank // replicas * replicas
            named.append((name, self.get_parameter(name).detach()))
            holders.append(list(range(base, base + replicas)))
        diverged = grad_norm.replicas_diverged(named, collectives.get_group(self._coords.tp_key), holders)
        if diverged:
            log.warning(
                "parameters replicated over the tp ranks differ between ranks: %s. Every rank must apply the same "
                "update: clip with pm.clip_grad_norm_ (not torch.nn.utils.clip_grad_norm_, which sees one rank), "
                "and pass the same batch and seed on every rank", ", ".join(diverged[:5]))
        return diverged
