"""``autotp.parallelize`` and the ``ParallelModel`` it returns."""

from __future__ import annotations

import datetime
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from autotp import collectives, rng
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.passes import TENSOR_PARALLEL_PASSES
from autotp.passes.insert_collectives import replica_group_key
from autotp.passes.runner import PassContext, run_passes
from autotp.plan import ParallelPlan, ParamLayout
from autotp.sharding import shard_tensor, unshard_tensor
from autotp.trace import structure_copy, trace

_DEFAULT_BATCH, _DEFAULT_SEQ = 2, 16


def _set_nested(root: nn.Module, dotted: str, value: torch.Tensor, *, buffer: bool) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        child = getattr(mod, part, None) if part in mod._modules else None
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


def _signature_key(kwargs: dict[str, Any], training: bool) -> tuple:
    items = []
    for k in sorted(kwargs):
        v = kwargs[k]
        if isinstance(v, torch.Tensor):
            items.append((k, tuple(v.shape), v.dtype))
        else:
            items.append((k, repr(v)))
    return (training, tuple(items))


class ParallelModel(nn.Module):
    """This rank's part of a tensor-parallel model.

    Its parameters are this rank's shards, registered under the original names, so
    ``torch.optim.AdamW(pm.parameters())`` trains it. Calling it like the original model
    returns the same output type; the loss is the same on every tp rank, and sharded
    outputs (logits) are gathered unless the plan says otherwise. Each new input
    signature (names, shapes, dtypes, train/eval) is traced and compiled once.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        first_graph: GraphModule,
        first_kwargs: dict[str, Any],
        *,
        tp_rank: int,
        group_key: str,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.plan = plan
        self._tp_rank = tp_rank
        self._group_key = group_key
        self._device = device
        self._source = _StructureOnly(model)
        self._forward_params = list(inspect.signature(model.forward).parameters)
        self._inject = {"use_cache": False} if "use_cache" in self._forward_params else {}
        self._aliases: dict[str, list[str]] = {}
        self._layouts: dict[str, ParamLayout | None] = {}
        self._local_names: list[str] = []
        self._buffer_names: list[str] = []
        self._graphs: dict[tuple, GraphModule] = {}
        self.pass_timings: dict[str, float] = {}
        self._bind_parameters(model)
        self.train(model.training)
        self._graphs[_signature_key(first_kwargs, model.training)] = self._compile(first_graph)

    # ---- parameters ----------------------------------------------------------------

    def _bind_parameters(self, model: nn.Module) -> None:
        by_id: dict[int, str] = {}
        tensors: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical = by_id.setdefault(id(p), name)
            self._aliases.setdefault(canonical, []).append(name)
            tensors.setdefault(canonical, p)
        for name, p in tensors.items():
            layouts = [self.plan.layout_of(alias) for alias in self._aliases[name]]
            layout = self._layouts[name] = next((l for l in layouts if l is not None), None)
            data = p.detach()
            local = shard_tensor(data, layout, self._tp_rank, self.plan.tp) if layout else data.clone()
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

    def _canonical(self, name: str) -> str:
        for canonical, names in self._aliases.items():
            if name in names:
                return canonical
        return name

    # ---- compilation ---------------------------------------------------------------

    def _compile(self, traced: GraphModule) -> GraphModule:
        ctx = PassContext(plan=self.plan, tp_rank=self._tp_rank, device=self._device, group=self._group_key)
        gm = run_passes(traced, ctx, TENSOR_PARALLEL_PASSES)
        for k, v in ctx.timings.items():
            self.pass_timings[k] = self.pass_timings.get(k, 0.0) + v
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            target = str(node.target)
            source = self._canonical(target)
            if source in self._local_names or source in self._buffer_names:
                _set_nested_attr(gm, target, _get_nested(self, source))
        return gm

    def graph_for(self, *args: Any, **kwargs: Any) -> GraphModule:
        """The compiled per-rank graph that a call with these inputs runs."""
        call = self._as_kwargs(args, kwargs)
        key = _signature_key(call, self.training)
        gm = self._graphs.get(key)
        if gm is None:
            self._source.model.train(self.training)
            gm = self._compile(trace(self._source.model, call, self._device))
            self._graphs[key] = gm
        return gm

    def _as_kwargs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        call = dict(zip(self._forward_params, args))
        call.update(kwargs)
        for k, v in self._inject.items():
            call.setdefault(k, v)
        return {k: v for k, v in call.items() if v is not None}

    # ---- running -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = self._as_kwargs(args, kwargs)
        gm = self.graph_for(**call)
        try:
            return gm(**call)
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise RuntimeError(
                    f"a tensor-parallel collective timed out on tp rank {self._tp_rank}: another rank did not "
                    f"reach the same collective (it crashed, or was called with other input shapes). {e}"
                ) from e
            raise

    def train_step(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_microbatches: int = 1,
        loss_fn: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward over ``num_microbatches`` slices of the batch.

        Returns the mean loss (detached), identical on every rank. Without ``labels``,
        ``loss_fn(outputs) -> scalar`` supplies the loss. Gradients accumulate into
        ``.grad``; the caller steps and zeroes the optimizer.
        """
        if labels is None and loss_fn is None:
            raise ValueError("train_step needs labels= or loss_fn=")
        batch = {k: v for k, v in dict(kwargs, input_ids=input_ids, labels=labels).items() if v is not None}
        size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
        if size % num_microbatches:
            raise ValueError(
                f"batch size {size} is not divisible by num_microbatches={num_microbatches}; "
                f"use a divisor of {size}"
            )
        step = size // num_microbatches
        total = torch.zeros((), device=self._device)
        for i in range(num_microbatches):
            micro = {k: (v[i * step : (i + 1) * step] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            out = self(**micro)
            loss = loss_fn(out) if loss_fn is not None else out.loss
            (loss / num_microbatches).backward()
            total += loss.detach().float()
        return total / num_microbatches

    # ---- checking and checkpoints --------------------------------------------------

    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        layout = self._layouts[name]
        if layout is None or self.plan.tp == 1:
            return local.detach().clone()
        group = collectives.get_group(self._group_key)
        parts = [torch.empty_like(local) for _ in range(self.plan.tp)]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        return unshard_tensor(parts, layout, self.plan.tp)

    def unshard_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers under every original name (tied names included)."""
        out: dict[str, torch.Tensor] = {}
        for name in self._local_names:
            full = self._gather(name, _get_nested(self, name))
            for alias in self._aliases[name]:
                out[alias] = full
        for name in self._buffer_names:
            out[name] = _get_nested(self, name).detach().clone()
        return out

    def unshard_grads(self) -> dict[str, torch.Tensor | None]:
        """Full gradients under every original parameter name (None where no grad)."""
        out: dict[str, torch.Tensor | None] = {}
        for name in self._local_names:
            grad = _get_nested(self, name).grad
            full = None if grad is None else self._gather(name, grad)
            for alias in self._aliases[name]:
                out[alias] = full
        return out


class _StructureOnly:
    """Holds the meta copy used for retracing without registering it as a submodule."""

    def __init__(self, model: nn.Module) -> None:
        self.model = structure_copy(model)


def _set_nested_attr(root: nn.Module, dotted: str, value: Any) -> None:
    *path, leaf = dotted.split(".")
    mod: Any = root
    for part in path:
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod._parameters[leaf] = value
    else:
        mod._buffers[leaf] = value


def _default_inputs(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    if vocab is None:
        raise ValueError(
            f"{type(model).__name__} has no config.vocab_size to make example inputs from; "
            "pass example_inputs={'input_ids': ...} (or whatever its forward takes)"
        )
    return {"input_ids": torch.randint(0, vocab, (_DEFAULT_BATCH, _DEFAULT_SEQ))}


def _tp_groups(tp: int, world: int, rank: int, group_key: str, replica_sizes: set[int], timeout_s: float) -> None:
    """Create the tp group (consecutive ranks, Megatron's innermost dim) and replica subgroups."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            collectives.register_group(group_key, group)
        for size in sorted(replica_sizes):
            for sub in range(start, start + tp, size):
                sub_ranks = list(range(sub, sub + size))
                sub_group = dist.new_group(sub_ranks, timeout=timeout)
                if rank in sub_ranks:
                    collectives.register_group(replica_group_key(group_key, size), sub_group)


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


def _choose_plan(traced: GraphModule, tp: int, plan: ParallelPlan | str | None) -> ParallelPlan:
    if isinstance(plan, ParallelPlan):
        if plan.tp != tp:
            raise ValueError(f"the plan is for tp={plan.tp} but tp={tp} was asked; pass matching degrees")
        return plan
    if plan in (None, "auto"):
        return plan_tensor_parallel(traced, tp)
    raise ValueError(f"plan must be a ParallelPlan, 'auto' or None, got {plan!r}")


def compile_rank(
    model: nn.Module,
    *,
    tp: int,
    rank: int = 0,
    example_inputs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | None = None,
    device: torch.device | str = "meta",
    dump_dir: Path | None = None,
) -> CompiledRank:
    """Trace, plan and rewrite the graph of tp rank ``rank`` without any process group.

    For inspection, dumps and compile-time benchmarks; a model on ``meta`` never
    allocates its weights.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp={tp}; pick 0..{tp - 1}")
    kwargs = _example_kwargs(model, example_inputs)
    start = time.perf_counter()
    traced = trace(model, kwargs, device)
    traced_at = time.perf_counter()
    chosen = _choose_plan(traced, tp, plan)
    planned_at = time.perf_counter()
    ctx = PassContext(plan=chosen, tp_rank=rank, device=torch.device(device), group=f"tp{tp}", dump_dir=dump_dir)
    gm = run_passes(traced, ctx, TENSOR_PARALLEL_PASSES)
    return CompiledRank(gm, chosen, traced_at - start, planned_at - traced_at, dict(ctx.timings))


def parallelize(
    model: nn.Module,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    example_inputs: dict[str, Any] | None = None,
    plan: ParallelPlan | str | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    gather_outputs: bool = True,
    timeout_s: float = 300.0,
) -> ParallelModel:
    """Compile ``model`` into this rank's tensor-parallel ``ParallelModel``.

    ``example_inputs`` (keyword arguments of ``model.forward``) fix the first traced
    signature; HF models default to random ``input_ids`` of shape [2, 16]. ``plan`` is
    a ``ParallelPlan`` to follow, or None / ``"auto"`` to let the cost model decide.
    ``device`` defaults to the rank's CUDA device under NCCL, else the CPU. A collective
    that waits longer than ``timeout_s`` (a rank crashed or diverged) raises instead of
    hanging.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
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
    if pp != 1 or dp != 1:
        raise ValueError(
            f"pipeline and data parallelism (pp={pp}, dp={dp}) are not available yet; use tp equal to the world size"
        )
    if device is None:
        on_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else torch.device("cpu")
    device = torch.device(device)
    kwargs = _example_kwargs(model, example_inputs)
    traced = trace(model, kwargs, device)
    chosen = _choose_plan(traced, tp, plan)
    if not gather_outputs:
        chosen = ParallelPlan(**{**chosen.__dict__, "gather_outputs": False})
    group_key = f"tp{tp}"
    if tp > 1:
        replica_sizes = {p.sharding.replicas(tp) for p in chosen.params} - {1}
        _tp_groups(tp, world, rank, group_key, replica_sizes, timeout_s)
    tp_rank = rank % tp
    rng.seed_tp_rng(seed, tp_rank)
    return ParallelModel(
        model, chosen, traced, kwargs, tp_rank=tp_rank, group_key=group_key, device=device
    )
