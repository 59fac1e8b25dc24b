"""Capture a per-rank graph's CUDA-graph regions and replay them (CUDA only).

The compiler gives each chunk a copy of its graph whose regions are submodules
``cudagraph_region_<id>`` (``passes/split_cudagraph_regions``); the nodes between regions
run eagerly (partial capture). ``CapturedGraph`` runs that copy:

* **Capture** happens on a slot's first call, which first runs eagerly without grad to record
  every region's inputs; those values become the regions' static input buffers, every region is
  captured forward and backward by one call of ``make_graphed_callables``, so all of
  them share one memory pool. Transformer Engine's is used when ``transformer_engine``
  imports, else torch's (``implementation()``, recorded as ``plan.cudagraph_impl``).
  Every tp rank makes that call at the same point of the program, so the
  collectives inside the regions line up during warmup and capture. Capture runs with
  grad enabled, so a first call under ``torch.no_grad()`` still captures the backward.
  The call itself then replays the new graphs.
* **Replay** copies each region's inputs into its static buffers and launches the
  forward graph; backward launches the backward graph. Activations live in the pool and
  are overwritten by the slot's next replay, so one forward per slot may be in flight:
  call its backward (``train_step`` does) before the slot's next forward that needs
  grad. Outputs returned to the caller are cloned, so they survive later calls.
* **Gradients.** A graphed region returns its parameter gradients in static buffers of
  its memory pool, and autograd stores the first one as ``.grad`` itself (no copy). A
  later replay would overwrite it (accumulation over microbatches would double the last
  one), so before each replay every captured parameter whose ``.grad`` lies in one of the
  capture's pools gets a copy (``_own_grads``). A step whose grads were set to None since
  (``zero_grad()``, the usual loop) copies nothing: no per-parameter hook or clone runs.
* **Compiled regions** (``compile=True`` with ``cuda_graphs=True``): after the eager run that
  records the inputs, each region is replaced by its ``torch.compile`` form, which
  ``make_graphed_callables`` warms up (compiling forward and backward once) and then captures:
  the graphs replay inductor's fused kernels. The nodes between regions stay eager.
* **Slots** (pipeline parallelism). A stage holds several microbatches between their
  forward and backward, and each needs its own static buffers and activations. Every
  call names a ``slot`` (``autotp.ir.schedules.buffer_slots``: the lowest free one at the
  forward, freed by the backward); each slot is its own capture, made the first time the
  slot is used, with its own memory pool. Inside a slot forwards and backwards
  alternate, which is the order one pool's captures assume; across slots the schedule
  interleaves them, which separate pools allow. Memory grows with the microbatches in
  flight (``pp - stage`` under 1F1B), not with the microbatches per step.
"""

from __future__ import annotations

import gc
import importlib.util
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from autotp.ir import meta_keys
from autotp.ir.errors import UserInputError
from autotp.ir.program import CAPTURED, REGION_PREFIX
from autotp.passes.extract_chunks import whole_copy

TORCH, TRANSFORMER_ENGINE = "torch", "transformer_engine"
_WARMUP_ITERS = 3


def implementation() -> str:
    """Which ``make_graphed_callables`` captures: Transformer Engine's if it imports."""
    return TRANSFORMER_ENGINE if importlib.util.find_spec("transformer_engine") is not None else TORCH


def regions_of(split: GraphModule) -> list[tuple[str, GraphModule]]:
    """The region submodules of a region-split graph, in the order they run."""
    order = [str(n.target) for n in split.graph.nodes if n.op == "call_module" and str(n.target).startswith(REGION_PREFIX)]
    return [(name, getattr(split, name)) for name in order]


def _for_slot(split: GraphModule) -> GraphModule:
    """A copy of ``split`` with region modules of its own (capture replaces their forward),
    sharing parameters and buffers."""
    copy = whole_copy(split, CAPTURED)
    for name, region in regions_of(split):
        setattr(copy, name, whole_copy(region, name))
    return copy


def _static_input(value: Tensor, placeholder: Node) -> Tensor:
    """A static buffer holding ``value``; it requires grad where the graph says the input
    can (autograd state at the first call may differ from later calls')."""
    needs_grad = bool(placeholder.meta.get(meta_keys.NEEDS_GRAD)) and value.is_floating_point()
    return value.detach().clone().requires_grad_(needs_grad)


def _pool_ranges(pool: Any) -> list[tuple[int, int]]:
    """The address ranges ``[start, end)`` of CUDA memory pool ``pool``'s segments."""
    wanted = tuple(pool)
    return [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory._snapshot()["segments"]
            if tuple(s["segment_pool_id"]) == wanted]  # fmt: skip


def _own_grads(params: tuple[Tensor, ...], ranges: list[tuple[int, int]]) -> None:
    """Replace every ``.grad`` of ``params`` that lies in ``ranges`` (a static gradient
    buffer that autograd stored) by a copy, before a replay overwrites it."""
    for p in params:
        grad = p.grad
        if grad is not None and any(start <= grad.data_ptr() < end for start, end in ranges):
            p.grad = grad.clone()


def _make_graphed(impl: str) -> Callable[..., Any]:
    if impl == TRANSFORMER_ENGINE:
        from transformer_engine.pytorch import make_graphed_callables

        return make_graphed_callables
    return torch.cuda.make_graphed_callables


def _own(value: Any) -> Any:
    """``value`` with every tensor copied out of the static buffers it may live in."""
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, value)


class CapturedGraph:
    """Calls a region-split graph with its regions replayed from CUDA graphs (module docstring);
    with ``compile_backend``, each region runs ``torch.compile``'s code (of that backend) in its graphs."""

    def __init__(self, split: GraphModule, impl: str, compile_backend: str | None = None) -> None:
        self._split = split
        self._impl = impl
        self._compile = compile_backend
        self._slots: list[GraphModule] = []  # per slot: the split graph with its regions graphed
        self._params: tuple[Tensor, ...] = ()  # the captured parameters that take gradients
        self._ranges: list[tuple[int, int]] = []  # the memory of every slot's pool
        _LIVE.add(self)

    def release(self) -> None:
        """Drop the captured graphs (and with them their memory pools); the next call captures again."""
        for split in self._slots:
            for _, region in regions_of(split):
                vars(region).pop("forward", None)  # the graphed forward that capture installed, with its static buffers
        self._slots.clear()
        self._params, self._ranges = (), []

    def graphs(self) -> list[GraphModule]:
        """The graph modules of the captures made so far."""
        return [m for split in self._slots for m in split.modules() if isinstance(m, GraphModule)]

    @property
    def slots(self) -> int:
        """Slots captured so far."""
        return len(self._slots)

    def __call__(self, *args: Any, slot: int = 0, **kwargs: Any) -> Any:
        if slot < len(self._slots):
            _own_grads(self._params, self._ranges)
            return _own(self._slots[slot](*args, **kwargs))
        if slot > len(self._slots):
            raise UserInputError(f"slot {slot} used before slot {len(self._slots)}: slots are taken lowest free first")
        return self._capture(args, kwargs)

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        split = _for_slot(self._split)
        regions = regions_of(split)
        samples: dict[str, tuple[Tensor, ...]] = {}
        handles = []
        for name, module in regions:
            placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]

            def record(mod: nn.Module, inputs: tuple[Any, ...], name: str = name, placeholders: list[Node] = placeholders) -> None:
                samples[name] = tuple(_static_input(t, p) for t, p in zip(inputs, placeholders))

            handles.append(module.register_forward_pre_hook(record))
        # Without grad: no autograd node of this run, tied to the default stream, may be
        # alive during capture, where autograd would make that stream wait on the
        # capturing one (an invalid capture; pytorch#180090).
        with torch.no_grad():
            split(*args, **kwargs)
        for handle in handles:
            handle.remove()
        if self._compile:
            for name, module in regions:
                setattr(split, name, torch.compile(module, backend=self._compile))
            regions = regions_of(split)
        if regions:
            modules = tuple(module for _, module in regions)
            pool = torch.cuda.graph_pool_handle()
            with torch.enable_grad():
                _make_graphed(self._impl)(
                    modules,
                    tuple(samples[name] for name, _ in regions),
                    num_warmup_iters=_WARMUP_ITERS,
                    allow_unused_input=True,
                    pool=pool,
                )
            ranges = _pool_ranges(pool)
            assert ranges, "a capture allocates its static buffers in its pool"
            self._ranges = self._ranges + ranges
            trained = {id(p): p for module in modules for p in module.parameters() if p.requires_grad}
            self._params = tuple({**{id(p): p for p in self._params}, **trained}.values())
        self._slots.append(split)
        return _own(split(*args, **kwargs))


_LIVE: weakref.WeakSet[CapturedGraph] = weakref.WeakSet()


def release_all() -> None:
    """Drop every captured graph and memory pool of this process and wait for the device.

    Call it before ``destroy_process_group``: NCCL's teardown can hang while graphs that
    captured its collectives are alive (pytorch#115388). The launcher does.
    """
    for captured in list(_LIVE):
        captured.release()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
