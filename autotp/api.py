"""``autotp.parallelize``, ``autotp.compile_rank`` and the ``ParallelModel``."""

from __future__ import annotations

import datetime
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from autotp.runtime import collectives
from autotp.runtime import cudagraphs
from autotp.runtime import rng
from autotp.ir import schedules
from autotp.cost_model.pipeline import plan_pipeline
from autotp.cost_model.planner import auto_plan
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.analysis.layers import num_layers
from autotp.passes import PASSES
from autotp.ir.ops import replica_group_key, tp_group_key
from autotp.passes.runner import PassContext, run_passes
from autotp.runtime.pipeline import ChunkGraph, PipelineGroups, PipelineRunner, extract_chunks
from autotp.ir.plan import ParallelPlan, ParamLayout
from autotp.ir.rank_groups import groups_of, rank_groups
from autotp.runtime.sharding import shard_tensor, unshard_tensor
from autotp.analysis.trace import structure_copy, trace

_DEFAULT_BATCH, _DEFAULT_SEQ = 2, 16
_DP_BUCKET_BYTES = 25 * 2**20


def _set_nested(root: nn.Module, dotted: str, value: torch.Tensor, *, buffer: bool) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if buffer:
        mod.register_buffer(leaf, value)
    else:
        mod.register_parameter(leaf, value)  # type: ignore[arg-type]


def _get_nested(root: nn.Module, dotted: str) -> Any:
    obj: Any = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _set_graph_attr(gm: GraphModule, dotted: str, value: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    mod: Any = gm
    for part in path:
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod._parameters[leaf] = value
    else:
        mod._buffers[leaf] = value


def _signature_key(kwargs: dict[str, Any], training: bool) -> tuple:
    items = []
    for k in sorted(kwargs):
        v = kwargs[k]
        items.append((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)))
    return (training, tuple(items))


@dataclass(frozen=True)
class _Coords:
    """Where this process sits in the tp x dp x pp grid, and its groups' keys."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_key: str
    dp_group: dist.ProcessGroup | None
    pipeline: PipelineGroups | None


@dataclass
class _Compiled:
    """One input signature, compiled: the full per-rank graph and this rank's chunks."""

    graph: GraphModule
    chunks: dict[int, ChunkGraph]
    param_chunks: dict[str, set[int]]  # every parameter -> chunks that read it
    run: Callable[..., Any]  # ``graph``, its torch.compile'd form, or its CUDA-graph capture


class ParallelModel(nn.Module):
    """This rank's part of a tensor-, pipeline- and data-parallel model.

    Its parameters are this rank's shards (only the layers of its pipeline stage),
    registered under the original names, so ``torch.optim.AdamW(pm.parameters())``
    trains it. Calling it like the original model returns the same output type on every
    rank (loss identical on every rank, sharded outputs gathered). Each new input
    signature (names, shapes, dtypes, train/eval) is traced and compiled once.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        first_graph: GraphModule,
        first_kwargs: dict[str, Any],
        coords: _Coords,
        device: torch.device,
        compile_graphs: bool,
    ) -> None:
        super().__init__()
        self.plan = plan
        self._compile_graphs = compile_graphs
        self._coords = coords
        self._device = device
        self._source = _StructureOnly(model)
        self._forward_params = list(inspect.signature(model.forward).parameters)
        self._inject = {"use_cache": False} if "use_cache" in self._forward_params else {}
        self._aliases: dict[str, list[str]] = {}
        self._layouts: dict[str, ParamLayout | None] = {}
        self._local_names: list[str] = []
        self._buffer_names: list[str] = []
        self._graphs: dict[tuple, _Compiled] = {}
        self._shared_param_groups: dict[str, dist.ProcessGroup] = {}
        self.pass_timings: dict[str, float] = {}
        self.measure_busy = False
        self.last_busy_s = 0.0  # with measure_busy: this rank's compute time in the last pipeline step
        compiled = self._compile(first_graph)
        self._bind_parameters(model, compiled)
        self._make_shared_param_groups(compiled)
        self._attach(compiled)
        self.train(model.training)
        self._graphs[_signature_key(first_kwargs, model.training)] = compiled

    # ---- parameters ----------------------------------------------------------------

    @property
    def my_chunks(self) -> list[int]:
        return [c for c in range(self.plan.num_chunks) if self.plan.pp_rank_of_chunk(c) == self._coords.pp_rank]

    def _bind_parameters(self, model: nn.Module, compiled: _Compiled) -> None:
        """Keep the shard of every parameter that this rank's chunks read."""
        by_id: dict[int, str] = {}
        tensors: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical = by_id.setdefault(id(p), name)
            self._aliases.setdefault(canonical, []).append(name)
            tensors.setdefault(canonical, p)
        mine = set(self.my_chunks)
        for name, p in tensors.items():
            layouts = [self.plan.layout_of(alias) for alias in self._aliases[name]]
            layout = self._layouts[name] = next((l for l in layouts if l is not None), None)
            if not self._param_chunks(compiled, name) & mine:
                continue
            data = p.detach()
            local = shard_tensor(data, layout, self._coords.tp_rank, self.plan.tp) if layout else data.clone()
            if local.device.type != "meta":
                local = local.to(self._device)
            _set_nested(self, name, nn.Parameter(local, requires_grad=p.requires_grad), buffer=False)
            self._local_names.append(name)
        for name, b in model.named_buffers():
            value = b.detach().clone()
            if value.device.type != "meta":
                value = value.to(self._device)
            _set_nested(self, name, value, buffer=True)
            self._buffer_names.append(name)

    def _param_chunks(self, compiled: _Compiled, canonical: str) -> set[int]:
        chunks: set[int] = set()
        for alias in self._aliases[canonical]:
            chunks |= compiled.param_chunks.get(alias, set())
        return chunks

    def _owners(self, compiled: _Compiled, canonical: str) -> list[int]:
        """Pipeline ranks that hold ``canonical`` (sorted)."""
        return sorted({self.plan.pp_rank_of_chunk(c) for c in self._param_chunks(compiled, canonical)})

    def _make_shared_param_groups(self, compiled: _Compiled) -> None:
        """Groups of pipeline stages sharing a parameter (tied embedding and lm_head)."""
        if self.plan.pp == 1:
            return
        assert self._coords.pipeline is not None
        for name in self._aliases:
            owners = self._owners(compiled, name)
            if len(owners) < 2:
                continue
            # new_group is collective: every rank creates every group, in the same order.
            for stage_ranks in self._all_pipelines():
                group = dist.new_group([stage_ranks[o] for o in owners])
                if stage_ranks == self._coords.pipeline.pp_ranks:
                    self._shared_param_groups[name] = group

    def _all_pipelines(self) -> list[list[int]]:
        return rank_groups(dist.get_world_size(), tp=self.plan.tp, pp=self.plan.pp)["pp"]

    def _canonical(self, name: str) -> str:
        for canonical, names in self._aliases.items():
            if name in names:
                return canonical
        return name

    # ---- compilation ---------------------------------------------------------------

    def _compile(self, traced: GraphModule) -> _Compiled:
        backend = dist.get_backend() if dist.is_initialized() else "nccl"
        ctx = PassContext(plan=self.plan, tp_rank=self._coords.tp_rank, device=self._device, group=self._coords.tp_key, backend=backend)
        gm = run_passes(traced, ctx, PASSES)
        for k, v in ctx.timings.items():
            self.pass_timings[k] = self.pass_timings.get(k, 0.0) + v
        param_chunks: dict[str, set[int]] = {}
        params = dict(gm.named_parameters(remove_duplicate=False))
        for node in gm.graph.nodes:
            if node.op == "get_attr" and str(node.target) in params:
                chunks = {u.meta.get("autotp_chunk") or 0 for u in node.users}
                param_chunks.setdefault(str(node.target), set()).update(chunks)
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
        """Point the compiled graphs' parameters and buffers at this model's tensors."""
        graphs = [c.graph for c in compiled.chunks.values()] or [compiled.graph]
        for gm in graphs:
            for node in gm.graph.nodes:
                if node.op != "get_attr":
                    continue
                source = self._canonical(str(node.target))
                if source in self._local_names or source in self._buffer_names:
                    _set_graph_attr(gm, str(node.target), _get_nested(self, source))

    def graph_for(self, *args: Any, **kwargs: Any) -> GraphModule:
        """The compiled per-rank graph (all chunks, stage boundaries marked) for these inputs."""
        return self._compiled_for(self._as_kwargs(args, kwargs)).graph

    def _compiled_for(self, call: dict[str, Any]) -> _Compiled:
        key = _signature_key(call, self.training)
        compiled = self._graphs.get(key)
        if compiled is None:
            self._source.model.train(self.training)
            compiled = self._compile(trace(self._source.model, call, self._device))
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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this rank's inputs. With pp > 1 this is forward-only (no
        autograd across stages: use ``train_step``), and every rank gets the outputs."""
        call = self._as_kwargs(args, kwargs)
        compiled = self._compiled_for(call)
        try:
            if self.plan.num_chunks == 1:
                return compiled.run(**call)
            return self._pipeline_forward(compiled, call)
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise RuntimeError(
                    f"a collective timed out on rank {dist.get_rank()}: another rank did not reach the same "
                    f"collective (it crashed, or was called with other input shapes). {e}"
                ) from e
            raise

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

    def train_step(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_microbatches: int = 1,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        schedule: str | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of the global batch, split over dp ranks and microbatches.

        Every rank passes the same global batch. Returns the mean loss over the global
        batch (detached), identical on every rank. Without ``labels``,
        ``loss_fn(outputs) -> scalar`` supplies the loss (on the last pipeline stage).
        Gradients are accumulated into ``.grad`` and averaged over dp ranks; the caller
        steps and zeroes the optimizer. ``schedule``: ``1f1b`` (default), ``gpipe`` or
        ``interleaved`` (default when vpp > 1).
        """
        if labels is None and loss_fn is None:
            raise ValueError("train_step needs labels= or loss_fn=")
        batch = {k: v for k, v in dict(kwargs, input_ids=input_ids, labels=labels).items() if v is not None}
        size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        dp, m = self.plan.dp, num_microbatches
        if m < 1 or size % (dp * m):
            raise ValueError(
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
            total = self._pipeline_step(micro, loss_of, schedule)
        self._sync_grads()
        return self._mean_loss(total / m)

    def _pipeline_step(self, micro: list[dict[str, Any]], loss_of: Callable[[Any], torch.Tensor], name: str | None) -> torch.Tensor:
        pp, vpp = self.plan.pp, self.plan.vpp
        name = name or schedules.default_schedule(vpp)
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

    def _sync_grads(self) -> None:
        """Sum grads of parameters shared by pipeline stages; average over dp ranks."""
        for name, group in self._shared_param_groups.items():
            if name in self._local_names:
                grad = _get_nested(self, name).grad
                if grad is not None:
                    dist.all_reduce(grad, group=group)
        if self.plan.dp > 1:
            _all_reduce_buckets([p.grad for p in self.parameters() if p.grad is not None], self._coords.dp_group, self.plan.dp)

    def _mean_loss(self, local: torch.Tensor) -> torch.Tensor:
        """This dp rank's loss (known on the last stage) -> the global mean on every rank."""
        pipe = self._coords.pipeline
        if pipe is not None and self.plan.pp > 1:
            is_last = self._coords.pp_rank == self.plan.pp_rank_of_chunk(self.plan.num_chunks - 1)
            local = local if is_last else torch.zeros_like(local)
            dist.all_reduce(local, group=pipe.pp_group)
        if self.plan.dp > 1:
            dist.all_reduce(local, group=self._coords.dp_group)
            local = local / self.plan.dp
        return local

    # ---- checking and checkpoints --------------------------------------------------

    def _gather(self, name: str, local: torch.Tensor | None, compiled: _Compiled) -> torch.Tensor | None:
        """The full tensor of parameter ``name`` (or its grad) on every rank."""
        layout = self._layouts[name]
        full = None
        if local is not None:
            full = local.detach().clone()
            if layout is not None and self.plan.tp > 1:
                parts = [torch.empty_like(local) for _ in range(self.plan.tp)]
                dist.all_gather(parts, local.detach().contiguous(), group=collectives.get_group(self._coords.tp_key))
                full = unshard_tensor(parts, layout, self.plan.tp)
        if self.plan.pp == 1:
            return full
        pipe = self._coords.pipeline
        assert pipe is not None
        owner = self._owners(compiled, name)[0]
        has = torch.tensor([1 if full is not None else 0], device=self._device)
        dist.broadcast(has, src=pipe.pp_ranks[owner], group=pipe.pp_group)
        if not has.item():
            return None
        if full is None:
            shape = self._full_shape(name)
            full = torch.empty(shape, dtype=self._source_dtype(name), device=self._device)
        dist.broadcast(full, src=pipe.pp_ranks[owner], group=pipe.pp_group)
        return full

    def _full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(_get_nested(self._source.model, name).shape)

    def _source_dtype(self, name: str) -> torch.dtype:
        return _get_nested(self._source.model, name).dtype

    def _first_compiled(self) -> _Compiled:
        return next(iter(self._graphs.values()))

    def unshard_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers under every original name (tied names included)."""
        compiled = self._first_compiled()
        out: dict[str, torch.Tensor] = {}
        for name in self._aliases:
            local = _get_nested(self, name).detach() if name in self._local_names else None
            full = self._gather(name, local, compiled)
            assert full is not None
            for alias in self._aliases[name]:
                out[alias] = full
        for name in self._buffer_names:
            out[name] = _get_nested(self, name).detach().clone()
        return out

    def unshard_grads(self) -> dict[str, torch.Tensor | None]:
        """Full gradients under every original parameter name (None where no grad)."""
        compiled = self._first_compiled()
        out: dict[str, torch.Tensor | None] = {}
        for name in self._aliases:
            grad = _get_nested(self, name).grad if name in self._local_names else None
            full = self._gather(name, grad, compiled)
            for alias in self._aliases[name]:
                out[alias] = full
        return out


def _all_reduce_buckets(grads: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int) -> None:
    """Average ``grads`` over the dp group, ~25 MB per all-reduce."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads + [None]:  # type: ignore[list-item]
        if g is not None and (not bucket or (size + g.numel() * g.element_size() <= _DP_BUCKET_BYTES and g.dtype == bucket[0].dtype)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            flat /= dp
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


class _StructureOnly:
    """Holds the meta copy used for retracing without registering it as a submodule."""

    def __init__(self, model: nn.Module) -> None:
        self.model = structure_copy(model)


def _default_inputs(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    if vocab is None:
        raise ValueError(
            f"{type(model).__name__} has no config.vocab_size to make example inputs from; "
            "pass example_inputs={'input_ids': ...} (or whatever its forward takes)"
        )
    return {"input_ids": torch.randint(0, vocab, (_DEFAULT_BATCH, _DEFAULT_SEQ))}


@dataclass(frozen=True)
class CompiledRank:
    """One rank's rewritten graph, compiled offline (no process group, nothing run)."""

    graph: GraphModule
    plan: ParallelPlan
    trace_s: float
    plan_s: float
    pass_s: dict[str, float]


def _example_kwargs(model: nn.Module, example_inputs: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(example_inputs) if example_inputs is not None else _default_inputs(model)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("use_cache", False)
    return kwargs


def _choose_plan(traced: GraphModule, tp: int, pp: int, dp: int, vpp: int, plan: ParallelPlan | str | None) -> ParallelPlan:
    if isinstance(plan, ParallelPlan):
        if (plan.tp, plan.pp, plan.dp, plan.vpp) != (tp, pp, dp, vpp):
            raise ValueError(
                f"the plan is for tp={plan.tp}, pp={plan.pp}, dp={plan.dp}, vpp={plan.vpp} but "
                f"tp={tp}, pp={pp}, dp={dp}, vpp={vpp} was asked; pass matching degrees"
            )
        return plan
    if plan not in (None, "auto"):
        raise ValueError(f"plan must be a ParallelPlan, 'auto' or None, got {plan!r}")
    if plan == "auto":  # the cost model plans what the caller left at 1: all of tp/pp, else vpp
        fixed = tp > 1 or pp > 1
        return auto_plan(traced, tp * pp * dp, tp=tp if fixed else None, pp=pp if fixed else None,
                         vpp=vpp if vpp > 1 else None)
    layers = num_layers(traced)
    if pp * vpp > 1 and pp * vpp > layers:
        raise ValueError(
            f"pp*vpp = {pp}*{vpp} = {pp * vpp} pipeline chunks but the model has {layers} layers; "
            f"use pp*vpp <= {layers}"
        )
    chosen = plan_tensor_parallel(traced, tp)
    layer_chunks, embedding_chunk, head_chunk = plan_pipeline(traced, pp, vpp)
    return replace(chosen, pp=pp, dp=dp, vpp=vpp, layer_chunks=layer_chunks,
                   embedding_chunk=embedding_chunk, head_chunk=head_chunk)


def _with_cudagraphs(plan: ParallelPlan) -> ParallelPlan:
    return replace(plan, cudagraphs=True, cudagraph_impl=plan.cudagraph_impl or cudagraphs.implementation())


def _check_cuda_graphs(device: torch.device, compile: bool) -> None:
    backend = dist.get_backend() if dist.is_initialized() else None
    if device.type != "cuda" or backend not in (None, "nccl"):
        raise ValueError(
            f"cuda_graphs=True captures CUDA graphs, but this rank runs on {device}"
            f"{f' with {backend} collectives' if backend else ''}; run on GPUs with NCCL, or drop cuda_graphs "
            "(autotp.report.cudagraphs shows the regions and blockers without a GPU)"
        )
    if compile:
        raise ValueError(
            "compile=True and cuda_graphs=True both replace how the graph runs; pick one "
            "(torch.compile(mode='reduce-overhead') is torch's own CUDA-graph path)"
        )


def compile_rank(
    model: nn.Module,
    *,
    tp: int,
    rank: int = 0,
    pp: int = 1,
    vpp: int = 1,
    example_inputs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | None = None,
    device: torch.device | str = "meta",
    dump_dir: Path | None = None,
    cuda_graphs: bool = False,
) -> CompiledRank:
    """Trace, plan and rewrite the graph of tp rank ``rank`` without any process group.

    For inspection, dumps and compile-time benchmarks; a model on ``meta`` never
    allocates its weights. With pp > 1 the graph carries the stage boundaries. With
    ``cuda_graphs`` the plan asks for CUDA graphs and the nodes carry their regions and
    blockers, as a GPU rank on NCCL would capture them.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp={tp}; pick 0..{tp - 1}")
    kwargs = _example_kwargs(model, example_inputs)
    start = time.perf_counter()
    traced = trace(model, kwargs, device)
    traced_at = time.perf_counter()
    chosen = _choose_plan(traced, tp, pp, 1, vpp, plan)
    if cuda_graphs:
        chosen = _with_cudagraphs(chosen)
    planned_at = time.perf_counter()
    ctx = PassContext(plan=chosen, tp_rank=rank, device=torch.device(device), group=tp_group_key(tp), dump_dir=dump_dir)
    gm = run_passes(traced, ctx, PASSES)
    return CompiledRank(gm, chosen, traced_at - start, planned_at - traced_at, dict(ctx.timings))


def _make_groups(plan: ParallelPlan, timeout_s: float) -> _Coords:
    """Create every process group (collective: every rank runs this identically)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_key = tp_group_key(plan.tp)
    if world == 1:
        return _Coords(0, 0, 0, tp_key, None, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = rank_groups(world, tp=plan.tp, pp=plan.pp)
    mine = groups_of(rank, groups)
    replica_sizes = sorted({p.sharding.replicas(plan.tp) for p in plan.params} - {1})
    for tp_ranks in groups["tp"]:
        group = dist.new_group(tp_ranks, timeout=timeout)
        if rank in tp_ranks:
            collectives.register_group(tp_key, group)
        for size in replica_sizes:
            for start in range(0, plan.tp, size):
                sub = tp_ranks[start : start + size]
                sub_group = dist.new_group(sub, timeout=timeout)
                if rank in sub:
                    collectives.register_group(replica_group_key(tp_key, size), sub_group)
    dp_group = None
    for dp_ranks in groups["dp"]:
        group = dist.new_group(dp_ranks, timeout=timeout)
        if rank in dp_ranks:
            dp_group = group
    pipeline = None
    for pp_ranks in groups["pp"]:
        made = [dist.new_group(pp_ranks, timeout=timeout) for _ in range(3)]
        if rank in pp_ranks:
            pipeline = PipelineGroups(pp_ranks.index(rank), plan.pp, made[0], made[1], made[2], pp_ranks)
    assert pipeline is not None
    return _Coords(
        tp_rank=mine["tp"].index(rank),
        dp_rank=mine["dp"].index(rank),
        pp_rank=mine["pp"].index(rank),
        tp_key=tp_key,
        dp_group=dp_group,
        pipeline=pipeline,
    )


def parallelize(
    model: nn.Module,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    vpp: int = 1,
    example_inputs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    gather_outputs: bool = True,
    timeout_s: float = 300.0,
    compile: bool = False,
    cuda_graphs: bool = False,
) -> ParallelModel:
    """Compile ``model`` into this rank's ``ParallelModel``; tp·pp·dp must be the world size.

    Ranks are laid out in Megatron's order (tp fastest, then dp, then pp).
    ``example_inputs`` (keyword arguments of ``model.forward``) fix the first traced
    signature; HF models default to random ``input_ids`` of shape [2, 16]. ``plan`` is a
    ``ParallelPlan`` to follow, or None / ``"auto"`` to let the cost model decide; ``vpp``
    model chunks per pipeline rank select the interleaved schedule. ``device`` defaults
    to the rank's CUDA device under NCCL, else the CPU. A collective that waits longer
    than ``timeout_s`` (a rank crashed or diverged) raises instead of hanging. With
    ``compile``, each per-rank graph (or pipeline chunk) also runs through
    ``torch.compile``, which fuses the elementwise work between the collectives. With
    ``cuda_graphs`` (CUDA and NCCL), the regions that the cost model picks are captured
    as CUDA graphs on the first call and replayed after (``autotp.runtime.cudagraphs``); with
    pp > 1, once per microbatch a stage holds in flight.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if tp > world:
        raise ValueError(
            f"tp={tp} is larger than the world size {world}; start {tp} processes (torchrun --nproc-per-node {tp} "
            f"or autotp run --tp {tp}) or lower tp"
        )
    if dp is None:
        dp = world // (tp * pp)
    if tp * pp * dp != world:
        raise ValueError(
            f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not match the world size {world}; "
            f"choose degrees whose product is {world}"
        )
    if device is None:
        on_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else torch.device("cpu")
    device = torch.device(device)
    cuda_graphs = cuda_graphs or (isinstance(plan, ParallelPlan) and plan.cudagraphs)
    if cuda_graphs:
        _check_cuda_graphs(device, compile)
    kwargs = _example_kwargs(model, example_inputs)
    traced = trace(model, kwargs, device)
    chosen = _choose_plan(traced, tp, pp, dp, vpp, plan)
    if cuda_graphs:
        chosen = _with_cudagraphs(chosen)
    if not gather_outputs:
        chosen = replace(chosen, gather_outputs=False)
    coords = _make_groups(chosen, timeout_s)
    rng.seed_tp_rng(seed + 1009 * (coords.dp_rank + chosen.dp * coords.pp_rank), coords.tp_rank)
    return ParallelModel(model, chosen, traced, kwargs, coords, device, compile)
