"""Run passes in order, checking the graph after each one.

A pass is a plain function ``pass_fn(gm, ctx) -> gm``. After each pass the runner lints
the graph and every graph module inside it (the chunk graphs of ``autotp.ir.program``),
checks the invariants of ``autotp.passes.invariants`` on each, logs the change in op counts
over all of them (``logging`` at DEBUG) and, with ``ctx.dump_dir``, recompiles them and
writes ``NN_<pass>.py``: the graph's code, then each inner graph's. The code is otherwise
generated once, after the last pass (passes read and rewrite graphs, never their code). A
failure names the pass that broke the graph and the ones that ran before it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import time
from pathlib import Path

import torch
from torch.fx import GraphModule

from autotp.ir.axes import Axis, group_key
from autotp.ir.plan import ParallelPlan
from autotp.ir.program import BucketLayout
from autotp.passes.invariants import INVARIANTS

log = logging.getLogger(__name__)

Pass = Callable[[GraphModule, "PassContext"], GraphModule]


class PassInvariantError(AssertionError):
    """A pass left the graph in a state the later passes and the runtime cannot trust."""


@dataclass
class PassContext:
    """What the passes read: the plan, which rank they compile for, and where to dump.

    ``group`` is the key of the tp process group the collectives name; left empty, it is
    ``group_key(Axis.TP, plan.tp)``, the key the runtime registers. ``backend`` is the
    process-group backend the graph's collectives will run on (``nccl``, ``gloo``...);
    offline compiles assume ``nccl``. ``plan`` is replaced by the compiler's decision steps
    between passes (``autotp.cost_model.cudagraphs.choose_cudagraph_regions``); the passes
    after one read the decision from it. ``param_buckets`` is a DistributedOptimizer's
    bucket layout, whose all-gathers ``insert_param_waits`` makes the graphs wait for.
    ``outputs_read`` names the output keys the caller reads (``train_step``: ``("loss",)``);
    empty: all of them (``passes/drop_unread_outputs``). ``ep_rank`` is the rank's place in
    its expert-parallel group (which experts of a loop over expert modules it computes).
    """

    plan: ParallelPlan
    tp_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: str = ""
    dump_dir: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)
    backend: str = "nccl"
    param_buckets: BucketLayout | None = None
    outputs_read: tuple[str, ...] = ()
    ep_rank: int = 0

    def __post_init__(self) -> None:
        self.group = self.group or group_key(Axis.TP, self.plan.tp)


def _graphs(gm: GraphModule) -> list[tuple[str, GraphModule]]:
    """``gm`` and every graph module inside it, by qualified name (``""`` for ``gm``)."""
    return [(name, m) for name, m in gm.named_modules() if isinstance(m, GraphModule)]


def _op_counts(gm: GraphModule) -> Counter[str]:
    return Counter(_op_name(n.target) for _, g in _graphs(gm) for n in g.graph.nodes if n.op == "call_function")


def _code(gm: GraphModule) -> str:
    return "".join(g.code if not name else f"\n# ---- {name} ----\n{g.code}" for name, g in _graphs(gm))


def _op_name(target: object) -> str:
    name = getattr(target, "__name__", str(target))
    return name.removesuffix(".default")


def _diff(before: Counter[str], after: Counter[str]) -> str:
    changes = [(op, after[op] - before[op]) for op in sorted(before | after) if after[op] != before[op]]
    return ", ".join(f"{n:+d} {op}" for op, n in changes) or "no op-count change"


def run_passes(gm: GraphModule, ctx: PassContext, passes: Sequence[Pass]) -> GraphModule:
    """Run ``passes`` in order on ``gm``, which the caller hands over: passes may rewrite
    it in place. After each pass: lint, check ``INVARIANTS``, log the op-count change; a
    failure names the pass and the passes that ran before it. Recompiled once at the end."""
    done: list[str] = []
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / "00_traced.py").write_text(_code(gm))
    debug = log.isEnabledFor(logging.DEBUG)
    counts = _op_counts(gm) if debug else Counter()
    for i, p in enumerate(passes, start=1):
        name = p.__name__
        start = time.perf_counter()
        try:
            gm = p(gm, ctx)
            graphs = _graphs(gm)
            for _, g in graphs:
                g.graph.lint()
                if ctx.dump_dir is not None:
                    g.recompile()
            problems = [f"{name + ': ' if name else ''}{problem}" for name, g in graphs for check in INVARIANTS for problem in check(g)]
            if problems:
                shown = "\n  ".join(problems[:10])
                more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
                raise PassInvariantError(f"the graph breaks {len(problems)} invariant(s):\n  {shown}{more}")
        except Exception as e:
            e.add_note(f"in autotp pass '{name}' (passes run before it: {', '.join(done) or 'none'})")
            raise
        elapsed = time.perf_counter() - start
        ctx.timings[name] = ctx.timings.get(name, 0.0) + elapsed
        done.append(name)
        if debug:
            after = _op_counts(gm)
            log.debug("pass %s (%.3f s): %s", name, elapsed, _diff(counts, after))
            counts = after
        if ctx.dump_dir is not None:
            (ctx.dump_dir / f"{i:02d}_{name}.py").write_text(_code(gm))
    for _, g in _graphs(gm):
        g.recompile()
    return gm
