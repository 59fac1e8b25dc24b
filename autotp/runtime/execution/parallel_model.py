"""``ParallelModel``: the nn.Module of one rank, its signature cache and its training step."""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from autotp.analysis.shapes import size_int
from autotp.analysis.trace import structure_copy
from autotp.compiler import lower_signature, with_param_waits
from autotp.ir import batch_denominators, meta_keys, schedules
from autotp.ir.axes import Axis
from autotp.ir.plan import ParallelPlan
from autotp.ir.program import RankProgram
from autotp.ir.rank_log import warn_once
from autotp.runtime.state import checkpoint_dcp, expert_parallel, export_hf
from autotp.runtime.processes import collectives
from autotp.runtime.execution import batch_pieces, guards, model_loss
from autotp.runtime.gradients import grad_norm
from autotp.runtime.gradients.grad_sync import GradSync, default_sync, mean_loss, shared_param_groups
from autotp.runtime.gradients.grad_buffers import ParamUse
from autotp.runtime.processes.groups import Coords
from autotp.runtime.state.parameters import Parameters, graph_trained_params
from autotp.runtime.execution.pipeline import ChunkGraph, PipelineRunner
from autotp.runtime.execution.signatures import CompiledSignature, none_arguments
from autotp.ir.errors import UserInputError
from autotp.runtime.state.shard_map import ShardedLocal

log = logging.getLogger(__name__)
REPLICA_CHECK_EVERY = 100


class _StructureOnly:
    """Holds the meta copy used for retracing without registering it as a submodule."""

    def __init__(self, model: nn.Module, branch_buffers: tuple[str, ...]) -> None:
        self.model = structure_copy(model, branch_buffers)


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

    def __init__(self, model: nn.Module, first: RankProgram, first_kwargs: dict[str, Any], coords: Coords,
                 device: torch.device, compile_backend: str | None) -> None:  # fmt: skip
        super().__init__()
        self.plan: ParallelPlan = first.plan
        self._compile_backend = compile_backend
        self._coords = coords
        self._device = device
        self._source = _StructureOnly(model, first.plan.branch_buffers)
        self._forward_params, self._none_kept = list(inspect.signature(model.forward).parameters), none_arguments(model.forward)
        self._inject = {"use_cache": False} if "use_cache" in self._forward_params else {}
        self._graphs: dict[tuple, CompiledSignature] = {}
        self.pass_timings: dict[str, float] = {}
        self.measure_busy = False
        self.last_busy_s = 0.0  # with measure_busy: this rank's compute time in the last pipeline step
        self._params = Parameters(self, self.plan, coords, device, self._source.model)
        many = dist.is_initialized() and dist.get_world_size() > 1
        self._failure_watch = guards.FailureWatch() if many else None
        pp_group = coords.pipeline.pp_group if coords.pipeline is not None else None
        self._input_check = guards.InputCheck([("tp", collectives.get_group(coords.tp_key)), ("pp", pp_group)] if many else [],
                                              coords.dp_group if many else None)
        compiled = self._prepare(first)
        self._params.bind(model, compiled.param_chunks, set(self.my_chunks))
        self.shared_param_groups = shared_param_groups(self.plan, coords, self._params.holders)
        """Per parameter that several pipeline stages hold, the group of its holders in this pipeline."""
        trained = graph_trained_params(compiled.graph)
        trained_shared = [n for n in self.shared_param_groups if any(a in trained for a in self._params.aliases[n])]
        this = weakref.proxy(self)  # the sync is held by this module: no cycle that keeps it alive
        self._grad_sync = default_sync(this, self.plan, coords, self.shared_param_groups, trained_shared, self._params.experts)
        self._steps = 0
        self.check_replicas_every = REPLICA_CHECK_EVERY  # train_step runs check_replicas on its 1st, N+1th, ... call; 0: never
        self._warned_plain = False
        self._attach(compiled)
        self.train(model.training)
        self._graphs[(*guards.signature_key(first_kwargs, model.training), (), False)] = compiled

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (0 without expert parallelism)."""
        return self._coords.rank(Axis.EP)

    def moe_drop_counts(self, reset: bool = False) -> dict[str, tuple[int, int]]:
        """Per MoE layer under sync-free dispatch: (rows its capacity dropped, rows routed) on this rank
        since the last reset (``expert_parallel.drop_counts``; reading syncs with the device)."""
        return expert_parallel.drop_counts(self.plan, reset)

    def __del__(self) -> None:
        """``del pm`` frees the parameters at once: the graphs (each in a reference cycle with its
        fx ``Graph``, which only the garbage collector breaks) let go of them, and the gradient
        hooks and parameter waits that reach them are removed."""
        for compiled in {id(c): c for c in self.__dict__.get("_graphs", {}).values()}.values():
            Parameters.release(compiled.graphs())
            compiled.release()
        if self.__dict__.get("_grad_sync") is not None:
            self._grad_sync.close()

    @property
    def my_chunks(self) -> list[int]:
        return [c for c in range(self.plan.num_chunks) if self.plan.pp_rank_of_chunk(c) == self._coords.pp_rank]

    @property
    def coords(self) -> Coords:
        """This rank's place on every axis, and its process groups."""
        return self._coords

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def compile_graphs(self) -> bool:
        """Whether the graphs run through ``torch.compile``."""
        return self._compile_backend is not None

    @property
    def shard_map(self) -> Parameters:
        """Where each local tensor sits in its global tensor (``ShardSpec`` by name), read by checkpoints, exports, the optimizer."""
        return self._params

    @property
    def grad_sync(self) -> GradSync:
        """How ``train_step``'s gradients become the step's (``autotp.runtime.gradients.grad_sync``)."""
        return self._grad_sync

    def install_grad_sync(self, sync: GradSync) -> None:
        """Make ``sync`` (a DistributedOptimizer's ``GradBuffers``) sum and average the gradients of
        ``train_step`` instead of the default, and the graphs wait for its parameter all-gathers."""
        if self._grad_sync.holds_grads:
            raise UserInputError("this ParallelModel already has a DistributedOptimizer; create one per model")
        self._grad_sync.close()
        self._grad_sync = sync
        for compiled in self._signatures():
            self._install_param_waits(compiled)

    # ---- compilation ---------------------------------------------------------------

    def _prepare(self, program: RankProgram) -> CompiledSignature:
        for k, v in program.pass_s.items():
            self.pass_timings[k] = self.pass_timings.get(k, 0.0) + v
        return CompiledSignature.of(program, self.plan, self.my_chunks, self._compile_backend)

    def _attach(self, compiled: CompiledSignature) -> None:
        self._params.attach([g for chunk in compiled.running() for g in chunk.graphs()])

    def _install_param_waits(self, compiled: CompiledSignature) -> None:
        """With a DistributedOptimizer that overlaps its all-gather: each graph waits for a bucket before reading it."""
        layout = self._grad_sync.param_buckets(self._params.aliases)
        if layout is None:
            return
        if any(chunk.waits is None for chunk in compiled.running()):
            backend = dist.get_backend() if dist.is_initialized() else "nccl"
            with_param_waits(compiled.program, layout, tp_rank=self._coords.tp_rank, device=self._device, backend=backend)
        for chunk in compiled.running():
            waits = chunk.waits
            assert waits is not None
            waits.callback = self._grad_sync.wait_bucket

    def _finish_param_gather(self) -> None:
        """Wait for the DistributedOptimizer's all-gather in flight, before reading or writing parameters."""
        self._grad_sync.wait_params()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s (``parameters()`` too), after the DistributedOptimizer's all-gather in flight."""
        self._finish_param_gather()
        return super().named_parameters(*args, **kwargs)

    def graph_for(self, *args: Any, **kwargs: Any) -> GraphModule:
        """The compiled per-rank graph (all chunks, stage boundaries marked) for these inputs."""
        return self._compiled_for(self._as_kwargs(args, kwargs)).graph

    def chunks_for(self, *args: Any, **kwargs: Any) -> dict[int, ChunkGraph]:
        """This rank's pipeline chunks as they run for these inputs (empty without a pipeline)."""
        return self._compiled_for(self._as_kwargs(args, kwargs)).chunks

    def _compiled_for(self, call: dict[str, Any], outputs_read: tuple[str, ...] = (), split_batch: bool = False) -> CompiledSignature:
        """The graph of ``call``'s signature; ``outputs_read``: the output keys the caller reads (empty: all);
        ``split_batch``: ``call`` is one piece of a split step (``autotp.ir.batch_denominators``)."""
        key = (*guards.signature_key(call, self.training), outputs_read, split_batch)
        compiled = self._graphs.get(key)
        if compiled is None:
            self._source.model.train(self.training)
            backend = dist.get_backend() if dist.is_initialized() else "nccl"
            try:
                program = lower_signature(self._source.model, call, self.plan, tp_rank=self._coords.tp_rank,
                                          device=self._device, backend=backend, ep_rank=self.ep_rank,
                                          outputs_read=outputs_read, split_batch=split_batch,
                                          param_buckets=self._grad_sync.param_buckets(self._params.aliases))  # fmt: skip
            except ValueError as e:
                guards.explain_retrace_failure(call, list(self._graphs), e)
                raise
            unsplit = self._graphs.get((*key[:-1], False))
            if unsplit is not None and not any(program.graph.meta.get(k) for k in (meta_keys.BATCH_DENOMINATORS, meta_keys.BATCH_DRAWS)):
                compiled = unsplit  # the split graph is the same graph
            else:
                compiled = self._prepare(program)
                self._attach(compiled)
                self._install_param_waits(compiled)
            self._graphs[key] = compiled
        guards.refuse_autocast(compiled.graph, self._device)
        return compiled

    def _as_kwargs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        call = dict(zip(self._forward_params, args))
        call.update(kwargs)
        for k, v in self._inject.items():
            call.setdefault(k, v)
        return {k: v for k, v in call.items() if v is not None or k in self._none_kept}

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

    def _pipeline_forward(self, compiled: CompiledSignature, call: dict[str, Any]) -> Any:
        with batch_pieces.step_draws(compiled.program, 1, 0, 1):
            leaves = self._runner(compiled).run_forward(call)
        return self._broadcast_outputs(compiled, leaves)

    def _broadcast_outputs(self, compiled: CompiledSignature, leaves: list[torch.Tensor] | None) -> Any:
        """The last stage's outputs on every pipeline rank."""
        pipe = self._coords.pipeline
        assert pipe is not None
        out_node = next(n for n in compiled.graph.graph.nodes if n.op == "output")
        outs = torch.utils._pytree.tree_leaves(out_node.args[0])  # nodes, and constants the graph returns (None)
        last = pipe.pp_ranks[self.plan.pp_rank_of_chunk(self.plan.num_chunks - 1)]
        if leaves is None:
            vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in outs]
            leaves = [torch.empty([size_int(n) for n in v.shape], dtype=v.dtype, device=self._device) if isinstance(v, torch.Tensor) else v for v in vals]
        else:  # a collective sends a tensor's memory as if it were contiguous (a strided view's rows would be garbled)
            leaves = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in leaves]
        for t in (t for t in leaves if isinstance(t, torch.Tensor)):
            dist.broadcast(t, src=last, group=pipe.pp_group)
        return torch.utils._pytree.tree_unflatten(leaves, compiled.graph._out_spec)

    def _runner(self, compiled: CompiledSignature) -> PipelineRunner:
        assert self._coords.pipeline is not None
        return PipelineRunner(compiled.chunks, self._coords.pipeline, self._device, compiled.graph)

    @guards.guarded(step=True)
    def train_step(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_microbatches: int | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        schedule: str | None = None,
        batch_is_local: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of the global batch, split over dp ranks and microbatches.

        Every rank passes the same global batch, which is split over the dp ranks (checked
        on the first calls: different batches on the dp ranks raise). With
        ``batch_is_local=True`` each dp rank passes its own shard instead, of the same size
        on every dp rank (DDP's convention: a ``DistributedSampler`` over dp ranks); the
        ranks of one replica (tp, pp) pass the same shard. Returns the global batch's loss
        (detached), identical on every rank: the pieces' mean, each piece's own mean over the
        data (labels not ignored) rescaled to the whole batch's (``autotp.ir.batch_denominators``).
        The loss is the one forward returns (``model_loss.returned_loss``: ``outputs["loss"]``,
        else its only scalar output), or ``loss_fn(outputs) -> scalar`` (on the last pipeline
        stage, averaged over pieces as it is). Gradients accumulate into ``.grad``; the caller
        steps and zeroes the optimizer. ``num_microbatches`` and ``schedule`` (``1f1b``,
        ``gpipe``, ``interleaved`` or ``zbh1``) default to the plan's ``microbatches`` and
        ``schedule_name`` (``1f1b``, or ``interleaved`` when vpp > 1, unless planned).
        """
        if self.check_replicas_every and self._steps % self.check_replicas_every == 0:
            self.check_replicas()
        self._steps += 1
        batch = {k: v for k, v in dict(kwargs, input_ids=input_ids, labels=labels).items() if v is not None or k in self._none_kept}
        dp = self.plan.dp
        m = self.plan.microbatches if num_microbatches is None else num_microbatches
        micro = batch_pieces.microbatches(batch, dp, self._coords.dp_rank, m, batch_is_local, dict(self.plan.input_batch_dims))
        guards.refuse_mixed_batch(self.plan, dp * m)
        if self.plan.distributed_optimizer and dp > 1 and not self._grad_sync.holds_grads and not self._warned_plain:
            self._warned_plain = True
            warn_once(log, "the plan assumed autotp.DistributedOptimizer (its memory estimate shards the optimizer "
                      "state over dp=%d); this model trains with a plain optimizer", dp)
        self._grad_sync.begin(m)
        loss_of, outputs_read = model_loss.step_loss(loss_fn, self.plan.output_batch_dims, dp, m)
        calls = [self._as_kwargs((), mb) for mb in micro]
        split = dp * m > 1
        program = (compiled := self._compiled_for(calls[0], outputs_read, split)).program  # the pieces are cut alike: one signature
        with batch_pieces.step_draws(program, dp * m, self._coords.dp_rank * m, m), batch_pieces.own_written_inputs(program, calls):
            denominators = {} if not split else batch_pieces.whole_batch_denominators(
                program, calls, dp * m, self._params, self._device, self._coords.dp_group if dp > 1 else None)
            with batch_denominators.whole_batch(denominators):
                if self.plan.num_chunks == 1:
                    total = None  # fewer launches a step (the host sets the pace of small ones): one copy, no zeros, add or divide for one piece
                    for call in calls:
                        loss = loss_of(compiled.run(**call))
                        (loss / m if m > 1 else loss).backward()
                        part = loss.detach().to(torch.promote_types(loss.dtype, torch.float32), copy=True)  # its own: a static output is overwritten
                        total = part if total is None else total + part
                else:
                    total = self._pipeline_step(compiled, calls, loss_of, schedule or self.plan.schedule_name)
        self._grad_sync.finish()
        return mean_loss(self.plan, self._coords, total / m if m > 1 else total)

    def _pipeline_step(self, compiled: CompiledSignature, calls: list[dict[str, Any]], loss_of: Callable[[Any], torch.Tensor], name: str) -> torch.Tensor:
        pp, vpp = self.plan.pp, self.plan.vpp
        if name == "zbh1" and self._grad_sync.holds_grads:
            raise UserInputError(ZBH1_REFUSED)
        runner = self._runner(compiled)
        runner.measure_busy = self.measure_busy
        total = runner.run_step(lambda rank: schedules.schedule(name, pp, vpp, len(calls), rank), calls, loss_of,
                                compiled.graph._out_spec)  # fmt: skip
        self.last_busy_s = runner.busy_s
        return total

    @property
    def cudagraph_slots(self) -> dict[int, int]:
        """Per chunk of this rank: the CUDA-graph captures made so far, one per microbatch
        the schedule held in flight (``autotp.runtime.execution.cudagraphs``), summed over input signatures."""
        slots: dict[int, int] = {}
        for compiled in self._signatures():
            for chunk, captured in compiled.captures().items():
                slots[chunk] = slots.get(chunk, 0) + captured.slots
        return slots

    # ---- checkpoints ---------------------------------------------------------------

    def _signatures(self) -> list[CompiledSignature]:
        """Each compiled signature once (a split step's graph may be an unsplit one's)."""
        return list({id(c): c for c in self._graphs.values()}.values())

    def _first_compiled(self) -> CompiledSignature:
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
        from autotp.runtime.state.materialize import materialize

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
        if self._grad_sync.reduced:
            raise UserInputError(
                "the gradients were reduce-scattered over dp by the DistributedOptimizer (each dp rank holds the mean "
                "of its 1/dp slice only), so no rank has them whole; read them before the step ends (pm(...) and "
                "backward, without train_step), or train with a plain optimizer to inspect them"
            )
        return self._params.unshard_grads(self._first_compiled().param_chunks)

    # ---- gradients -----------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; with a DistributedOptimizer, zero its buffers (``.grad`` stays a view of them)."""
        if self._grad_sync.holds_grads:
            self._grad_sync.zero_grad()
            return
        super().zero_grad(set_to_none)

    def param_uses(self, names: list[str]) -> list[ParamUse]:
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
            uses.append(ParamUse(name, param, chunk, len(chunks), order.get((name, chunk), -1), name in self.shared_param_groups))
        return uses

    def norm_counting(self, dp_rank: int | None) -> grad_norm.NormCounting:
        """Which gradient elements this rank counts in a global norm (over dp too, unless ``dp_rank`` is None)."""
        c = self._coords
        experts = self._params.experts
        return grad_norm.NormCounting(self.plan, c.tp_rank, c.pp_rank, dp_rank, self._params.layouts, self._params.holders,
                                      lambda n: experts.counts_in_norm(n, dp_rank) if experts.is_expert(n) else None)  # fmt: skip

    def clip_grad_norm_(self, max_norm: float, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip this rank's gradients by the global L2 norm, each parameter counted once across tp
        shards and replicas, pipeline stages and dp ranks, as ``torch.nn.utils.clip_grad_norm_`` on
        the unmodified model; returns that norm (the same on every rank). Call it after
        ``train_step``."""
        if self._grad_sync.holds_grads:
            raise UserInputError("this model trains with a DistributedOptimizer, which holds the gradients: call opt.clip_grad_norm_")
        counting = self.norm_counting(self._coords.dp_rank)
        grads = [(n, self.get_parameter(n).grad) for n in self._params.local_names]
        present = [(n, g) for n, g in grads if g is not None]
        squares = grad_norm.sum_of_squares((part for n, g in present for part in counting.counted(n, g)), self._device)
        norm = grad_norm.global_norm(squares, error_if_nonfinite)
        grad_norm.clip_([g for _, g in present], norm, max_norm)
        return norm

    @torch.no_grad()
    def check_replicas(self) -> list[str]:
        """Compare the parameters that several tp ranks hold (norm weights, shared KV heads) across
        those ranks by checksum; log a warning naming those that differ, and return them.
        ``train_step`` runs it on its first call and every ``check_replicas_every`` calls after."""
        tp = self.plan.tp
        if tp == 1:
            return []
        self._finish_param_gather()
        named, holders = [], []
        for name in self._params.local_names:
            layout = self._params.layouts[name]
            if self._params.experts.is_expert(name):
                continue  # each tp rank may hold other experts
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
