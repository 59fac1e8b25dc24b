"""This rank's parameters: binding shards, tied names, pointing graphs at them, unsharding.

A ``ParallelModel`` registers the shard of every parameter its pipeline chunks read
under the parameter's original (canonical) name; the other names of a tied parameter
are aliases of it. ``param_chunks`` (every parameter name the compiled graph reads ->
the pipeline chunks whose graphs read it) comes from the compiled chunk graphs.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule

from autotp.ir import fp8_delayed, meta_keys
from autotp.ir.axes import Axis
from autotp.ir.plan import ParallelPlan, ParamLayout
from autotp.ir.program import ChunkProgram
from autotp.runtime.processes import collectives
from autotp.runtime.state.expert_parallel import ExpertShards
from autotp.runtime.processes.groups import Coords
from autotp.runtime.state.shard_map import ShardSpec, shard_spec
from autotp.runtime.state.sharding import shard_tensor, unshard_tensor

ParamChunks = dict[str, set[int]]


def set_nested(root: nn.Module, dotted: str, value: torch.Tensor, *, buffer: bool) -> None:
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


def get_nested(root: nn.Module, dotted: str) -> Any:
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


def program_param_chunks(chunks: Mapping[int, ChunkProgram]) -> ParamChunks:
    """Every parameter name that the graphs of ``chunks`` read -> the chunks whose graphs read it
    (a chunk repeats the parameter reads of the cheap values it needs, and of the writes into them:
    a rotary table cached into a buffer by the first layer, read by every layer)."""
    out: ParamChunks = {}
    for c, chunk in chunks.items():
        for gm in chunk.graphs():
            params = dict(gm.named_parameters(remove_duplicate=False))
            for node in gm.graph.nodes:
                if node.op == "get_attr" and str(node.target) in params:
                    out.setdefault(str(node.target), set()).add(c)
    return out


def graph_trained_params(gm: GraphModule) -> set[str]:
    """The parameter names that ``gm`` reads with a gradient somewhere (by any chunk)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    return {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr" and str(n.target) in params and any(u.meta.get(meta_keys.NEEDS_GRAD) for u in n.users)
    }


class Parameters:
    """The parameters and buffers that ``module`` (the ``ParallelModel``) holds for this rank."""

    def __init__(self, module: nn.Module, plan: ParallelPlan, coords: Coords, device: torch.device, source: nn.Module) -> None:
        self._module = weakref.proxy(module)  # the module holds this object: no cycle that keeps it alive
        self._plan = plan
        self._coords = coords
        self.device = device
        self._source = source  # the model's meta structure copy: full shapes and dtypes
        self.aliases: dict[str, list[str]] = {}  # canonical name -> every name of the tensor
        self.layouts: dict[str, ParamLayout | None] = {}
        self.local_names: list[str] = []
        self.buffer_names: list[str] = []
        self.buffer_aliases: dict[str, str] = {}  # every name of a buffer (one module shared by several parents) -> its canonical name
        self.specs: dict[str, ShardSpec] = {}  # every local parameter and buffer
        self.histories: list[str] = []  # FP8 amax histories the graphs made (``autotp.ir.fp8_delayed``), whole on every rank
        self.holders: dict[str, list[int]] = {}  # canonical name -> the pipeline ranks that hold it (sorted)
        self.unfilled: set[str] = set()  # allocated for a model on meta; to be loaded or initialized
        self.experts = ExpertShards(plan, coords.experts)
        self._unread_chunk = {u.name: u.chunk for u in plan.unread}
        self._requires_grad_set = dict(plan.requires_grad_set)

    def bind(self, model: nn.Module, param_chunks: ParamChunks, mine: set[int]) -> None:
        """Register the shard of every parameter that the chunks in ``mine`` read, and every buffer."""
        tensors: dict[str, nn.Parameter] = {}
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical = by_id.setdefault(id(p), name)
            self.aliases.setdefault(canonical, []).append(name)
            tensors.setdefault(canonical, p)
        self.holders = {name: self.owners(param_chunks, name) for name in tensors}
        for name, p in tensors.items():
            layouts = [self._plan.layout_of(alias) for alias in self.aliases[name]]
            layout = self.layouts[name] = next((l for l in layouts if l is not None), None)
            every_stage = layout is not None and layout.axis == Axis.PP  # split over the stages (``plan.unread`` at tp=1)
            if not (every_stage or self.chunks_of(param_chunks, name) & mine) or not self.experts.held(name):
                continue
            spec = self.specs[name] = self.experts.spec(name, tuple(p.shape)) or shard_spec(name, tuple(p.shape), layout, *self._place(layout))
            local = self._local(name, p.detach(), spec, layout)
            requires_grad = next((flag for alias in self.aliases[name] if (flag := self._requires_grad_set.get(alias)) is not None), p.requires_grad)
            set_nested(self._module, name, nn.Parameter(local, requires_grad=requires_grad), buffer=False)
            self.local_names.append(name)
        first_name: dict[int, str] = {}
        for name, b in model.named_buffers(remove_duplicate=False):
            canonical = self.buffer_aliases[name] = first_name.setdefault(id(b), name)
            if canonical != name:
                continue
            spec = self.specs[name] = shard_spec(name, tuple(b.shape), None, 0, 1)
            set_nested(self._module, name, self._local(name, b.detach(), spec, None), buffer=True)
            self.buffer_names.append(name)

    def _place(self, layout: ParamLayout | None) -> tuple[int, int]:
        """This rank's index on the axis ``layout`` splits over, and that axis's degree."""
        axis = Axis.TP if layout is None else layout.axis
        return self._coords.rank(axis), self._plan.degree(axis)

    def _local(self, name: str, full: torch.Tensor, spec: ShardSpec, layout: ParamLayout | None) -> torch.Tensor:
        """This rank's copy of ``full``; for a tensor on meta, its shard allocated on the device
        (padding rows zero, the rest filled later by a checkpoint or the model's init)."""
        if full.device.type == "meta":
            self.unfilled.add(name)
            covered = sum(piece.length for piece in spec.pieces)
            make = torch.empty if covered == spec.local_len else torch.zeros
            return make(spec.local_shape, dtype=full.dtype, device=self.device)
        local = shard_tensor(full, layout, *self._place(layout)) if layout else self.experts.local(name, full).clone()
        return local.to(self.device)

    def chunks_of(self, param_chunks: ParamChunks, canonical: str) -> set[int]:
        """The chunks that read ``canonical``; one that no chunk reads is kept by its ``plan.unread``
        chunk (chunk 0 without one)."""
        chunks: set[int] = set()
        for alias in self.aliases[canonical]:
            chunks |= param_chunks.get(alias, set())
        return chunks or {self._unread_chunk.get(canonical, 0)}

    def owners(self, param_chunks: ParamChunks, canonical: str) -> list[int]:
        """The pipeline ranks that hold ``canonical`` (sorted)."""
        return sorted({self._plan.pp_rank_of_chunk(c) for c in self.chunks_of(param_chunks, canonical)})

    def writes_state(self, canonical: str) -> bool:
        """Whether this rank is the first pipeline rank holding ``canonical``: pipeline stages that
        share a parameter (tied embeddings) lay out its dp ranges differently, so only the first of
        them writes its sharded optimizer state."""
        holders = self.holders.get(canonical)
        return not holders or holders[0] == self._coords.pp_rank

    def canonical(self, name: str) -> str:
        """The name under which the module holds the parameter or buffer ``name``."""
        for canonical, names in self.aliases.items():
            if name in names:
                return canonical
        return self.buffer_aliases.get(name, name)

    def local_grads(self, names: list[str]) -> dict[str, torch.Tensor | None]:
        """The grads of those of ``names`` that this rank holds."""
        return {n: get_nested(self._module, n).grad for n in names if n in self.local_names}

    def attach(self, graphs: list[GraphModule]) -> None:
        """Point the graphs' parameters and buffers at the module's tensors. A graph's FP8 amax
        history (``autotp.ir.fp8_delayed``) becomes the module's buffer, if it has none of that name yet."""
        for gm in graphs:
            for node in gm.graph.nodes:
                if node.op != "get_attr":
                    continue
                if str(node.target).startswith(fp8_delayed.HISTORY_PREFIX):
                    self._adopt_history(gm, str(node.target))
                    continue
                source = self.canonical(str(node.target))
                if source in self.local_names or source in self.buffer_names:
                    _set_graph_attr(gm, str(node.target), get_nested(self._module, source))
                elif isinstance(get_nested(gm, str(node.target)), FakeTensor):  # the trace's copy: this rank does not hold it
                    raise AssertionError(f"rank graph {type(gm).__name__} reads {node.target!r} (node '{node.name}'), which this rank "
                                         "does not hold; please report this autotp bug with the model")  # fmt: skip

    def _adopt_history(self, gm: GraphModule, name: str) -> None:
        held = self._module._buffers.get(name)
        if held is None:
            history = getattr(gm, name)
            self._module.register_buffer(name, history)
            self.histories.append(name)
            self.specs[name] = shard_spec(name, tuple(history.shape), None, 0, 1)
        else:
            assert held.shape == getattr(gm, name).shape, f"{name}: another signature made it {tuple(held.shape)}"
            _set_graph_attr(gm, name, held)

    @staticmethod
    def release(graphs: list[GraphModule]) -> None:
        """Make ``graphs`` let go of the tensors ``attach`` gave them. A graph module and its fx
        ``Graph`` refer to each other, so only the garbage collector frees them: without this, they
        would hold the parameters until it runs."""
        for gm in graphs:
            for module in gm.modules():
                for name in [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]:
                    delattr(module, name)

    def gather(self, name: str, local: torch.Tensor | None, param_chunks: ParamChunks) -> torch.Tensor | None:
        """The full tensor of parameter ``name`` (or its grad) on every rank."""
        plan = self._plan
        layout = self.layouts[name]
        full = None
        if local is not None:
            full = local.detach().clone()
            degree = self._place(layout)[1]
            if layout is not None and degree > 1:
                parts = [torch.empty_like(local) for _ in range(degree)]
                pipe = self._coords.pipeline
                group = pipe.pp_group if layout.axis == Axis.PP and pipe else collectives.get_group(self._coords.keys[layout.axis])
                dist.all_gather(parts, local.detach().contiguous(), group=group)
                full = unshard_tensor(parts, layout, degree)
        if self.experts.is_expert(name) and self._coords.pp_rank in self.owners(param_chunks, name):
            full = self.experts.gather(name, full, get_nested(self._source, name), self.device)
        if plan.pp == 1:
            return full
        pipe = self._coords.pipeline
        assert pipe is not None
        owner = self.owners(param_chunks, name)[0]
        has = torch.tensor([1 if full is not None else 0], device=self.device)
        dist.broadcast(has, src=pipe.pp_ranks[owner], group=pipe.pp_group)
        if not has.item():
            return None
        if full is None:
            source = get_nested(self._source, name)
            full = torch.empty(tuple(source.shape), dtype=source.dtype, device=self.device)
        dist.broadcast(full, src=pipe.pp_ranks[owner], group=pipe.pp_group)
        return full

    def unshard_state_dict(self, param_chunks: ParamChunks, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full tensors under the keys of the original model's ``state_dict()`` (tied names
        included, non-persistent buffers not); ``{}`` unless ``keep`` (the gathers still run)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.aliases:
            local = get_nested(self._module, name).detach() if name in self.local_names else None
            full = self.gather(name, local, param_chunks)
            assert full is not None
            if keep:
                out.update(dict.fromkeys(self.aliases[name], full))
        if not keep:
            return {}
        for alias, name in self.buffer_aliases.items():
            out[alias] = get_nested(self._module, name).detach().clone()
        return {k: out[k] for k in self._source.state_dict(keep_vars=True)}

    def unshard_grads(self, param_chunks: ParamChunks) -> dict[str, torch.Tensor | None]:
        """Full gradients under every original parameter name (None where no grad), dense (an
        ``nn.Embedding(sparse=True)``'s too: the ranks of other stages receive it so)."""
        out: dict[str, torch.Tensor | None] = {}
        for name in self.aliases:
            grad = get_nested(self._module, name).grad if name in self.local_names else None
            full = self.gather(name, grad.to_dense() if grad is not None and grad.is_sparse else grad, param_chunks)
            for alias in self.aliases[name]:
                out[alias] = full
        return out
