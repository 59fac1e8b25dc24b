"""Run passes in order, checking the graph after each one.

A pass is a plain function ``pass_fn(gm, ctx) -> gm``. After each pass the runner lints
the graph, recompiles it, and (with ``ctx.dump_dir``) writes ``NN_<pass>.py``. A failure
names the pass that broke the graph and the ones that ran before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import time
from pathlib import Path

import torch
from torch.fx import GraphModule

from autotp.ir.plan import ParallelPlan

Pass = Callable[[GraphModule, "PassContext"], GraphModule]


@dataclass
class PassContext:
    """What the passes read: the plan, which rank they compile for, and where to dump.

    ``backend`` is the process-group backend the graph's collectives will run on
    (``nccl``, ``gloo``...); offline compiles assume ``nccl``.
    """

    plan: ParallelPlan
    tp_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: str = "tp"
    dump_dir: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)
    backend: str = "nccl"


def run_passes(gm: GraphModule, ctx: PassContext, passes: Sequence[Pass]) -> GraphModule:
    done: list[str] = []
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / "00_traced.py").write_text(gm.code)
    for i, p in enumerate(passes, start=1):
        name = p.__name__
        start = time.perf_counter()
        try:
            gm = p(gm, ctx)
            gm.graph.lint()
            gm.recompile()
        except Exception as e:
            e.add_note(f"in autotp pass '{name}' (passes run before it: {', '.join(done) or 'none'})")
            raise
        ctx.timings[name] = ctx.timings.get(name, 0.0) + time.perf_counter() - start
        done.append(name)
        if ctx.dump_dir is not None:
            (ctx.dump_dir / f"{i:02d}_{name}.py").write_text(gm.code)
    return gm
