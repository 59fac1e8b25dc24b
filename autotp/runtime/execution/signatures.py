"""One input signature of a ``ParallelModel``, ready to run on this rank: its rank program,
this rank's chunks, and how each runs (eagerly, ``torch.compile``'d or captured as CUDA graphs)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule

from autotp.ir import fp8_delayed
from autotp.ir.errors import UserInputError
from autotp.ir.fp8 import RECIPES
from autotp.ir.plan import ParallelPlan
from autotp.ir.program import ChunkProgram, RankProgram
from autotp.runtime.execution import buffer_history, cudagraphs
from autotp.runtime.state.parameters import ParamChunks, program_param_chunks
from autotp.runtime.execution.pipeline import ChunkGraph


@dataclass
class CompiledSignature:
    """One input signature, compiled: its rank program, the graph ``graph_for`` shows (the
    whole rank graph with a pipeline, else the one that runs) and this rank's chunks."""

    program: RankProgram
    graph: GraphModule
    chunks: dict[int, ChunkGraph]  # with a pipeline
    param_chunks: ParamChunks
    run: Callable[..., Any]  # without a pipeline: ``graph``, its torch.compile'd form, or its CUDA-graph capture

    @staticmethod
    def of(program: RankProgram, plan: ParallelPlan, my_chunks: list[int], compile_backend: str | None) -> CompiledSignature:
        """This rank's chunks of ``program`` (``my_chunks``), and how to run them (through
        ``torch.compile`` with ``compile_backend``, if one is named)."""
        chunks = {c: ChunkGraph(program.chunks[c]) for c in my_chunks} if plan.num_chunks > 1 else {}
        whole = program.chunks[0]
        graph = program.graph if chunks else whole.graph
        run: Callable[..., Any] = graph
        runs = [cg_graph for cg in chunks.values() for cg_graph in (cg.graph, cg.program.deferred)] if chunks else [graph]
        for gm in {id(g): g for g in runs if g is not None}.values():
            buffer_history.cut_history_on_call(gm)
        if compile_backend:
            run = torch.compile(graph, backend=compile_backend)
            for cg in chunks.values():
                cg.run = torch.compile(cg.graph, backend=compile_backend)
        if plan.cudagraphs:
            run = cudagraphs.CapturedGraph(whole.captured, plan.cudagraph_impl, compile_backend)
            for cg in chunks.values():
                cg.captured = cudagraphs.CapturedGraph(cg.program.captured, plan.cudagraph_impl, compile_backend)
        if any(RECIPES[e.recipe].delayed for e in plan.fp8_linears if e.recipe):
            if chunks:  # plan_fp8 refuses it; a plan edited by hand can still ask
                raise UserInputError(f"plan.fp8_linears asks for delayed FP8 scaling with a pipeline (pp={plan.pp}): "
                                     "not supported; plan with another fp8 recipe or pp=1")  # fmt: skip
            if plan.cudagraphs:
                raise UserInputError(fp8_delayed.CUDA_GRAPHS_REFUSAL)
        return CompiledSignature(program, graph, chunks, program_param_chunks(program.chunks), run)

    def running(self) -> list[ChunkProgram]:
        """The chunk programs this rank runs."""
        return [cg.program for cg in self.chunks.values()] or [self.program.chunks[0]]

    def captures(self) -> dict[int, cudagraphs.CapturedGraph]:
        """This rank's CUDA-graph captures, by chunk."""
        runs = {c: cg.captured for c, cg in self.chunks.items()} or {0: self.run}
        return {c: r for c, r in runs.items() if isinstance(r, cudagraphs.CapturedGraph)}

    def graphs(self) -> list[GraphModule]:
        """Every graph module of the signature: the program's and the captures'."""
        program = [m for m in self.program.graph.modules() if isinstance(m, GraphModule)]
        return program + [g for c in self.captures().values() for g in c.graphs()]

    def release(self) -> None:
        """Let go of the callbacks and the captures (``ParallelModel.__del__``)."""
        for chunk in self.running():
            if chunk.waits is not None:
                chunk.waits.callback = None
        for capture in self.captures().values():
            capture.release()


def none_arguments(forward: Callable[..., Any]) -> frozenset[str]:
    """The parameters of ``forward`` for which a None passed is an argument, not an absent input: those whose default is
    not None (MeshGPT's ``*, vertices, faces`` beside ``codes=None``, called with ``vertices=None``). A call keeps them."""
    params = inspect.signature(forward).parameters.items()
    return frozenset(k for k, p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is not None)
