"""The numerics bisector: run the parallel model against the reference on the same
inputs and name the first node that diverges.

``check_numerics`` runs on every rank of a process group (tp·pp ranks, as
``autotp.parallelize``). It parallelizes a copy of the model, then

1. runs the unsharded traced graph (with the model's real weights) and this rank's
   graph node by node (``torch.fx.Interpreter``): with pp = 1 the whole graph, with
   pp > 1 each pipeline chunk this rank holds, inside one forward of the pipeline (one
   microbatch); every node that both graphs hold (same name) is made whole (partial
   values are summed over the tp ranks, sharded ones gathered along their layout's
   ranges) and compared; the pipeline ranks then pool what they found, in the
   reference graph's order;
2. runs one forward and backward of both models and compares the loss and every
   parameter's gradient (unsharded).

The ``Divergence`` it reports names the node, its op, its source line, its layout and
(with pp > 1) its pipeline chunk, and the largest difference; ``CheckReport.ok`` is
whether nothing diverged.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from autotp.api import parallelize
from autotp.compiler import example_kwargs
from autotp.analysis.trace import trace
from autotp.ir import meta_keys
from autotp.ir.layouts import Layout, resolve
from autotp.ir.plan import ParamLayout
from autotp.runtime.processes import collectives
from autotp.runtime.state.sharding import unshard_tensor

RTOL, ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class Divergence:
    """A node (or a parameter's grad) whose parallel value differs from the reference."""

    what: str  # "activation" or "grad"
    name: str  # node name, or parameter name for grads
    op: str
    source: str  # file:line of the model code, or "" when unknown
    layout: str
    max_abs_diff: float
    max_abs_ref: float
    chunk: int | None = None  # the pipeline chunk that computed it (pp > 1)

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        if self.chunk is not None:
            where += f" in pipeline chunk {self.chunk}"
        return (
            f"{self.what} {self.name} ({self.op}){where}, layout {self.layout}: max |diff| "
            f"{self.max_abs_diff:.3g} (max |reference| {self.max_abs_ref:.3g})"
        )


@dataclass
class CheckReport:
    """What ``check_numerics`` compared and the divergences it found, in graph order."""

    tp: int
    pp: int
    activations_compared: int = 0
    uncomparable: list[str] = field(default_factory=list)  # nodes whose whole value could not be rebuilt
    grads_compared: int = 0
    loss_diff: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def summary(self) -> str:
        head = (
            f"tp={self.tp} pp={self.pp}: compared {self.activations_compared} activations and "
            f"{self.grads_compared} grads; |loss diff| {self.loss_diff:.3g}"
        )
        if self.uncomparable:
            head += f"; {len(self.uncomparable)} nodes not comparable ({', '.join(self.uncomparable[:5])})"
        if self.ok:
            return head + "; no node diverges beyond tolerance"
        lines = [head, f"first divergence: {self.first}"]
        lines += [f"  then: {d}" for d in self.divergences[1:6]]
        return "\n".join(lines)


class _Recorder(Interpreter):
    """Runs a graph and keeps every tensor-valued node's output."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and n.op != "placeholder":
            self.values[n.name] = out.detach()
        return out


def _source_line(node: Node) -> str:
    trace_text = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace_text)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


def _flat_inputs(gm: GraphModule, kwargs: dict[str, Any]) -> list[Any]:
    spec = gm.graph._codegen.pytree_info.in_spec  # type: ignore[attr-defined]
    return list(torch.fx._pytree.tree_flatten_spec(((), kwargs), spec))


def _with_weights(gm: GraphModule, model: nn.Module) -> GraphModule:
    """``gm`` (a fresh trace, with fake weights) made to read ``model``'s real tensors."""
    real = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op != "get_attr" or str(node.target) not in real:
            continue
        *path, leaf = str(node.target).split(".")
        mod: Any = gm
        for part in path:
            mod = getattr(mod, part)
        value = real[str(node.target)].detach()
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            mod._buffers[leaf] = value
    return gm


def _whole(local: torch.Tensor, layout: Any, tp: int, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The full value of a node from this rank's part (None: a layout this check cannot undo)."""
    if not isinstance(layout, Layout) or layout.replicated or group is None:
        return local
    if layout.partial:
        full = local.clone()
        dist.all_reduce(full, group=group)
        return full
    if len(layout.dims) != 1:
        return None
    dim, var = layout.dims[0]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard_tensor(parts, ParamLayout("", "value", dim, resolve(var, tp)), tp)


def _parallel_values(pm: Any, kwargs: dict[str, Any]) -> dict[str, tuple[torch.Tensor, Node, int | None]]:
    """Every tensor this rank's graph computes in one forward: node name -> (value, node,
    pipeline chunk); with pp > 1, of the chunks this rank runs, through the pipeline."""
    if pm.plan.num_chunks == 1:
        recorder = _Recorder(pm.graph_for(**kwargs))
        with torch.no_grad():
            recorder.run(*_flat_inputs(recorder.module, kwargs))
        nodes = {n.name: n for n in recorder.module.graph.nodes}
        return {name: (v, nodes[name], None) for name, v in recorder.values.items()}
    chunks = pm.chunks_for(**kwargs)
    recorders = {c: _Recorder(cg.graph) for c, cg in chunks.items()}
    runs = {c: cg.run for c, cg in chunks.items()}
    for c, cg in chunks.items():
        cg.run = recorders[c].run
    try:
        with torch.no_grad():
            pm(**kwargs)
    finally:
        for c, cg in chunks.items():
            cg.run = runs[c]
    out: dict[str, tuple[torch.Tensor, Node, int | None]] = {}
    for c, recorder in sorted(recorders.items()):
        nodes = {n.name: n for n in recorder.module.graph.nodes}
        for name, v in recorder.values.items():
            out.setdefault(name, (v, nodes[name], c))
    return out


def _differs(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float, float]:
    if got.shape != ref.shape:
        return True, float("inf"), float(ref.abs().max()) if ref.numel() and ref.is_floating_point() else 0.0
    if not ref.is_floating_point():
        return bool((got != ref).any()), float((got != ref).sum()), 0.0
    diff = (got.double() - ref.double()).abs()
    bad = bool((diff > atol + rtol * ref.double().abs()).any()) if diff.numel() else False
    return bad, float(diff.max()) if diff.numel() else 0.0, float(ref.abs().max()) if ref.numel() else 0.0


def _loss(out: Any) -> torch.Tensor:
    return out["loss"]


def check_numerics(
    model: nn.Module,
    *,
    tp: int,
    pp: int = 1,
    example_inputs: dict[str, Any] | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    microbatches: int | None = None,
) -> CheckReport:
    """Compare the parallel model with ``model`` on ``example_inputs`` (which must yield a
    ``loss``: pass ``labels``); call on every rank of a tp·pp world. ``model`` is not modified.
    With pp > 1 the grads come from ``train_step`` over ``microbatches`` (default: pp, the
    fewest that 1F1B takes); the activations from one forward of the whole batch."""
    kwargs = example_kwargs(model, example_inputs)
    reference = copy.deepcopy(model)
    pm = parallelize(copy.deepcopy(model), tp=tp, pp=pp, example_inputs=kwargs)
    report = CheckReport(tp, pp)
    ref_graph = _with_weights(trace(model, kwargs, "cpu"), reference)
    rec_ref = _Recorder(ref_graph)
    with torch.no_grad():
        rec_ref.run(*_flat_inputs(ref_graph, kwargs))
    values = _parallel_values(pm, kwargs)
    group = collectives.get_group(pm.coords.tp_key) if tp > 1 else None
    compared: set[str] = set()
    found: list[tuple[int, Divergence]] = []
    for index, node in enumerate(ref_graph.graph.nodes):
        if node.op == "get_attr" or node.name not in rec_ref.values or node.name not in values:
            continue  # parameters are compared through their grads
        value, par_node, chunk = values[node.name]
        layout = par_node.meta.get(meta_keys.LAYOUT)
        full = _whole(value, layout, tp, group)
        if full is None or full.shape != rec_ref.values[node.name].shape:
            report.uncomparable.append(node.name)
            continue
        compared.add(node.name)
        bad, diff, scale = _differs(full, rec_ref.values[node.name], rtol, atol)
        if bad:
            lay = layout.describe(tp) if isinstance(layout, Layout) else "replicated"
            divergence = Divergence("activation", node.name, str(node.target), _source_line(node), lay, diff, scale, chunk)
            found.append((index, divergence))
    if pp > 1:  # every pipeline rank compared its own chunks: pool them in graph order
        pooled: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pooled, (compared, report.uncomparable, found))
        compared = set().union(*(c for c, _, _ in pooled))
        report.uncomparable = sorted({n for _, u, _ in pooled for n in u} - compared)
        found = sorted({(i, d.name): (i, d) for _, _, f in pooled for i, d in f}.values(), key=lambda x: x[0])
    report.activations_compared = len(compared)
    report.divergences = [d for _, d in found]
    ref_loss = _loss(reference(**kwargs))
    ref_loss.backward()
    if pp == 1:
        loss = _loss(pm(**kwargs))
        loss.backward()
    else:
        loss = pm.train_step(**kwargs, num_microbatches=microbatches or pp)
    report.loss_diff = float((loss.detach().double() - ref_loss.detach().double()).abs())
    grads = pm.unshard_grads()
    layouts = {p.name: p for p in pm.plan.params}
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        got = grads.get(name)
        report.grads_compared += 1
        if got is None:
            report.divergences.append(Divergence("grad", name, "missing", "", "-", float("inf"), float(p.grad.abs().max())))
            continue
        bad, diff, scale = _differs(got, p.grad, rtol, atol)
        if bad:
            lay = f"{layouts[name].kind} dim {layouts[name].dim}" if name in layouts else "replicated"
            report.divergences.append(Divergence("grad", name, "parameter", "", lay, diff, scale))
    return report
