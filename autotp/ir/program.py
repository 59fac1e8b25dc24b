"""What the compiler hands the runtime: one rank's program.

``autotp.compiler.lower`` returns a ``RankProgram``: the plan it was lowered under (with the
decisions made on the way), the whole rank graph (flat, stage boundaries marked: what
reports and ``graph_for`` read) and one ``ChunkProgram`` per pipeline chunk (one for the
whole graph without a pipeline). The passes after ``split_stages`` build the chunks as
submodules of the rank graph (``CHUNK_PREFIX``):

* ``extract_chunks``: each chunk's graph; its ``meta[CHUNK_SPEC]`` says which model inputs it
  reads, what it receives and what it sends (``ChunkSpec``);
* ``split_cudagraph_regions``: with CUDA graphs, a copy of the chunk's graph whose regions
  are submodules (``CAPTURED``, regions ``REGION_PREFIX<id>``), which the runtime captures;
* ``insert_param_waits``: with a DistributedOptimizer that overlaps its parameter all-gather,
  a ``WAIT_MODULE`` call before the first read of each parameter (``ParamWaits``);
* ``split_weight_grads``: with a pipeline, a copy of the chunk's graph whose linear weight
  gradients wait for the schedule's ``W`` (``DEFERRED``; ``ops.DEFERRED_LINEAR``).

The runtime runs these graphs as they are: it points their parameters at its shards and
installs the waits' callback, and never rewrites a graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.fx import GraphModule

from autotp.ir.plan import ParallelPlan

CHUNK_PREFIX = "chunk_"
"""Submodule ``chunk_<c>`` of the rank graph: pipeline chunk c (``chunk_0``, the whole graph, without a pipeline)."""
CHUNK_SPEC = "autotp_chunk_spec"
"""Key of a chunk graph's ``GraphModule.meta``: its ``ChunkSpec``."""
CAPTURED = "cudagraph_split"
"""Submodule of a chunk graph: its copy with the CUDA-graph regions as submodules."""
REGION_PREFIX = "cudagraph_region_"
"""Submodule ``cudagraph_region_<id>`` of a ``CAPTURED`` graph: candidate region ``id``."""
DEFERRED = "weight_grads_split"
"""Submodule of a chunk graph: its copy with the linear weights' gradients deferred."""
WAIT_MODULE = "autotp_param_wait"
"""Submodule of a chunk graph (a ``ParamWaits``) that its wait nodes call."""


@dataclass(frozen=True)
class Boundary:
    """A value crossing between neighbouring chunks: this rank's shape, dtype, and whether
    a gradient goes back for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    needs_grad: bool


@dataclass(frozen=True)
class ChunkSpec:
    """How a chunk's graph is called: the model inputs (placeholders of the traced graph) it
    reads, then the values it receives, in order; the values it sends (none on the last
    chunk, which returns the model's outputs). ``whole``: the graph of the whole model, called
    with the model's keyword arguments."""

    chunk: int
    input_names: tuple[str, ...]
    recv: tuple[Boundary, ...]
    send: tuple[Boundary, ...]
    is_last: bool
    whole: bool = False


@dataclass(frozen=True)
class BucketLayout:
    """Where a DistributedOptimizer keeps the parameters: the bucket of every parameter name
    (each name of a tied parameter) and the buckets of each chunk, which ``insert_param_waits``
    makes the chunk's graph wait for."""

    bucket_of: dict[str, int]
    chunk_buckets: dict[int, tuple[int, ...]]


class ParamWaits(nn.Module):
    """What a chunk graph calls right before it first reads a bucket's parameters. The runtime
    sets ``callback`` (wait for that bucket's all-gather); without one the waits do nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.callback: Callable[[int], None] | None = None

    def forward(self, bucket: int) -> None:
        if self.callback is not None:
            self.callback(bucket)


@dataclass
class ChunkProgram:
    """One chunk's graphs: to run it, to capture its regions, to split its backward."""

    spec: ChunkSpec
    graph: GraphModule

    @property
    def captured(self) -> GraphModule | None:
        return self._submodule(CAPTURED)

    @property
    def deferred(self) -> GraphModule | None:
        return self._submodule(DEFERRED)

    @property
    def waits(self) -> ParamWaits | None:
        waits = getattr(self.graph, WAIT_MODULE, None)
        return waits if isinstance(waits, ParamWaits) else None

    def graphs(self) -> list[GraphModule]:
        """Every graph of the chunk that reads parameters (regions included)."""
        return [m for m in self.graph.modules() if isinstance(m, GraphModule)]

    def _submodule(self, name: str) -> GraphModule | None:
        sub = getattr(self.graph, name, None)
        return sub if isinstance(sub, GraphModule) else None


@dataclass
class RankProgram:
    """One tp rank's program (module docstring): ``chunks`` has every chunk of the plan; a
    pipeline rank runs ``plan.pp_rank_of_chunk(c) == its rank``'s."""

    plan: ParallelPlan
    graph: GraphModule
    chunks: dict[int, ChunkProgram]
    pass_s: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def of(graph: GraphModule, plan: ParallelPlan, pass_s: dict[str, float]) -> RankProgram:
        """The program whose chunks ``extract_chunks`` attached to ``graph``."""
        chunks = {}
        for name, sub in graph.named_children():
            if name.startswith(CHUNK_PREFIX) and isinstance(sub, GraphModule):
                spec = sub.meta[CHUNK_SPEC]
                chunks[spec.chunk] = ChunkProgram(spec, sub)
        return RankProgram(plan, graph, dict(sorted(chunks.items())), pass_s)
