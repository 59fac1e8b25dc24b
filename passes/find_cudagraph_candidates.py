"""Find what a CUDA graph can capture and group it into candidate regions.

Runs when ``plan.cudagraphs`` is set. Every op node either gets a ``Blocker`` (node meta
``autotp_cudagraph_blocker``) or is capturable. Blockers:

* **host syncs**: ``.item()`` (``aten.item``, ``aten._local_scalar_dense``), ``nonzero``
  and the other ops whose output size is read back (``masked_select``, ``unique``,
  ``repeat_interleave`` of a tensor without ``output_size``, ``bincount``, one-argument ``where``,
  boolean-mask indexing), ops that return a Python bool (``equal``, ``is_nonzero``),
  copies between the host and the device (``.cpu()``, ``.to("cpu")``), and opaque
  custom ops known to sync (``transformers::grouped_mm_fallback`` reads the expert
  offsets with ``offs.tolist()``; bf16 weights take ``aten._grouped_mm`` instead, which
  does not);
* **data-dependent output shapes**: a value whose shape holds an unbacked symbol;
* **host values**: an op that reads a Python number made by another op (``x * t.item()``),
  and ``batch_denominator``, whose value ``train_step`` sets for each step;
* **CPU tensors** read or made in a graph for another device;
* **RNG not registered for graph-safe replay**: autotp's ``tp_dropout`` in training
  (its masks come from the tp generators of ``autotp.runtime.execution.rng``, which capture does not
  register) and any aten RNG op given an explicit ``generator=``. Aten RNG ops on the
  default CUDA generator (``rand``, ``bernoulli``, ``dropout``...) are capturable:
  capture registers that generator, so each replay draws fresh numbers (not the ones
  eager would draw);
* **collectives on a backend that capture cannot record** (``ctx.backend`` other than
  ``nccl``, e.g. gloo) when tp > 1: *f*, *g*, the all-gather, and the vocab-parallel
  loss, which all-reduces inside;
* **in-place writes** to a tensor made outside the node's region (capture would write
  the region's static copy of it).
* **overlapped collectives** (``all_gather_matmul``, ``matmul_reduce_scatter``,
  ``plan.tp_overlap``) on any backend: their symmetric-memory workspace grows on first use
  and synchronises through barriers, and the ring waits on P2P work objects from the host;
  autotp does not capture either, so they run eagerly between regions. Leave ``tp_overlap``
  off to capture the plain collectives instead.

A *candidate* is a maximal run of capturable op nodes in graph order that stays in one
pipeline chunk: stage boundaries, a change of ``autotp_chunk``, and (with pp > 1) the
input-derived nodes that every chunk repeats end a run. Values crossing a region's edge
must be tensors (capture takes only tensors), so tuple-valued nodes whose ``getitem``\\ s
fall on the other side are left out. Candidates are numbered in graph order
(``autotp_cudagraph_candidate``). The cost model then chooses which become regions
(``plan.cudagraph_regions``, ``autotp.cost_model.cudagraphs.choose_cudagraph_regions``) and
``mark_cudagraph_regions`` tags their nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autotp.ir.batch_denominators import BATCH_DENOMINATOR
from autotp.ir.batch_draws import BATCH_DRAW
from autotp.ir.op_facts import mutated_base
from autotp.ir import meta_keys, moe_ops, ops
from autotp.ir import schedules
from autotp.ir.errors import source_line
from autotp.passes.runner import PassContext
from autotp.ir.plan import ParallelPlan

aten = torch.ops.aten

HOST_SYNC, DATA_DEPENDENT, HOST_VALUE, CPU_TENSOR, RNG, COLLECTIVE, MUTATION, OVERLAP = (
    "host_sync", "data_dependent_shape", "host_value", "cpu_tensor", "rng", "collective", "mutation", "overlap",
)  # fmt: skip
_OVERLAPPED = frozenset({ops.ALL_GATHER_MATMUL, ops.MATMUL_REDUCE_SCATTER})

_SCALAR_READS = {aten.item.default, aten._local_scalar_dense.default}
_SIZE_READS = {
    aten.nonzero.default, aten.argwhere.default, aten.masked_select.default, aten._unique.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
    aten.repeat_interleave.Tensor, aten.nonzero_numpy.default,
}  # fmt: skip
_BOOL_READS = {aten.equal.default, aten.is_nonzero.default}
_COPIES = {aten.to.dtype_layout, aten.to.device, aten.to.prim_Device, aten._to_copy.default, aten.copy_.default, aten.copy.default}
_CAPTURABLE_BACKENDS = {"nccl"}
_DROPLESS_CAPACITY_ARG = {moe_ops.MOE_TO_EXPERTS: 3, moe_ops.MOE_FROM_EXPERTS: 4}  # where their capacity (0: dropless) is


def _opaque_syncs() -> dict[Any, str]:
    """Custom ops that sync inside (registered by libraries that may not be loaded)."""
    known = {
        ("transformers", "grouped_mm_fallback"): "transformers::grouped_mm_fallback reads the expert offsets on the "
        "host (offs.tolist()); bf16 expert weights take aten._grouped_mm instead, which does not sync",
    }
    out: dict[Any, str] = {}
    for (namespace, name), why in known.items():
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            out[packet.default] = why
    return out


@dataclass(frozen=True)
class Blocker:
    """Why a CUDA graph cannot capture a node: ``kind`` (one of the module's constants),
    a readable ``reason``, the node's name and its source line."""

    kind: str
    reason: str
    node: str
    source: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason, "node": self.node, "source": self.source}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_host_number(value: Any) -> bool:
    return isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _rng_reason(node: Node) -> str | None:
    if node.target is ops.TP_DROPOUT:
        p, train = node.args[1], node.args[2]
        if train and p > 0:
            return "tp_dropout draws its mask from autotp's tp generators (autotp.runtime.execution.rng), which capture does not register"
        return None
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags and node.kwargs.get("generator") is not None:
        return "draws from an explicit generator, which capture does not register for graph-safe replay"
    return None


def _host_sync_reason(node: Node, opaque: dict[Any, str]) -> str | None:
    target = node.target
    if target in _SCALAR_READS:
        return ".item() copies a scalar to the host"
    if target in _SIZE_READS and node.kwargs.get("output_size") is None:
        return f"{target.__name__.split('.')[0]} reads its output size on the host"
    if target in _BOOL_READS:
        return f"{target.__name__.split('.')[0]} returns a Python bool"
    if target in _DROPLESS_CAPACITY_ARG and not node.args[_DROPLESS_CAPACITY_ARG[target]]:
        return "dropless expert dispatch reads the rows per expert on the host to size its all-to-all (moe_dispatch='sync_free' does not)"
    if target is aten.where.default:
        return "one-argument where (nonzero) reads its output size on the host"
    if target in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        indices = node.args[1] if len(node.args) > 1 else []
        if any(isinstance(i, Node) and _tensors(i.meta.get("val")) and _tensors(i.meta.get("val"))[0].dtype == torch.bool for i in indices):
            return "boolean-mask indexing computes nonzero on the host"
    if target in _COPIES:
        devices = {t.device.type for a in node.all_input_nodes for t in _tensors(a.meta.get("val"))[:1]}
        devices |= {t.device.type for t in _tensors(node.meta.get("val"))}
        if "cpu" in devices and len(devices) > 1:
            return "copies between the host and the device (.cpu() / .to())"
    return opaque.get(target)


def _blocker(node: Node, ctx: PassContext, opaque: dict[Any, str], blocked: set[Node]) -> Blocker | None:
    def make(kind: str, reason: str) -> Blocker:
        return Blocker(kind, reason, node.name, source_line(node))

    sync = _host_sync_reason(node, opaque)
    if sync is not None:
        return make(HOST_SYNC, sync)
    unbacked = free_unbacked_symbols(node.meta.get("val"))
    if unbacked:
        names = ", ".join(sorted(str(s) for s in unbacked))
        return make(DATA_DEPENDENT, f"output shape or value depends on data ({names})")
    for a in node.all_input_nodes:
        if a in blocked and _is_host_number(a.meta.get("val")):
            return make(HOST_VALUE, f"uses the host value of '{a.name}'")
    if ctx.device.type != "cpu":
        for n in (node, *node.all_input_nodes):
            if any(t.device.type == "cpu" for t in _tensors(n.meta.get("val"))):
                what = "makes" if n is node else f"reads ('{n.name}')"
                return make(CPU_TENSOR, f"{what} a CPU tensor in a {ctx.device.type} graph")
    reason = _rng_reason(node)
    if reason is not None:
        return make(RNG, reason)
    if node.target is BATCH_DENOMINATOR:
        return make(HOST_VALUE, "batch_denominator takes the whole batch's denominator that train_step sets on the host each step")
    if node.target is BATCH_DRAW:
        return make(HOST_VALUE, "batch_draw takes its piece of the step's draw, which the runtime makes on the host before the step")
    if node.target in _OVERLAPPED and ctx.plan.tp > 1:
        return make(OVERLAP, f"{node.target.__name__.removesuffix('.default')} pipelines its collective with its GEMM "
                    "(symmetric-memory barriers, or the ring's P2P waits), which autotp does not capture; it runs eagerly "
                    "between regions (tp_overlap=False captures the plain collective instead)")
    is_collective = node.target in ops.COLLECTIVES or meta_keys.COLLECTIVE in node.meta
    if is_collective and ctx.plan.tp > 1 and ctx.backend not in _CAPTURABLE_BACKENDS:
        return make(COLLECTIVE, f"{getattr(node.target, '__name__', str(node.target)).removesuffix('.default')} runs on {ctx.backend}, which CUDA graphs cannot capture; use NCCL")
    return None


def _inner_blocker(node: Node, gm: GraphModule, ctx: PassContext, opaque: dict[Any, str]) -> Blocker | None:
    """A blocker inside the submodule of a higher-order op (``wrap_with_set_grad_enabled``)."""
    for a in node.args:
        if isinstance(a, Node) and a.op == "get_attr":
            sub = getattr(gm, str(a.target), None)
            if isinstance(sub, GraphModule):
                inner: set[Node] = set()
                for n in sub.graph.nodes:
                    b = _blocker(n, ctx, opaque, inner) if n.op == "call_function" else None
                    if b is not None:
                        return Blocker(b.kind, f"inside '{a.target}': {b.reason}", node.name, source_line(node))
    return None


def _runs(gm: GraphModule, ctx: PassContext) -> list[list[Node]]:
    """Tag blockers and return the maximal runs of capturable nodes.

    With pp > 1, the input-derived nodes that every chunk repeats (``autotp_chunk`` None)
    stay out of runs without ending them: they read no node of a run, so they can run
    eagerly before it.
    """
    opaque = _opaque_syncs()
    blocked: set[Node] = set()
    runs: list[list[Node]] = []
    current: list[Node] = []
    current_set: set[Node] = set()
    current_chunk: int | None = None
    in_runs: set[Node] = set()
    evict: set[Node] = set()

    def block(node: Node, blocker: Blocker) -> None:
        node.meta[meta_keys.CUDAGRAPH_BLOCKER] = blocker
        blocked.add(node)

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        blocker = _blocker(node, ctx, opaque, blocked) or _inner_blocker(node, gm, ctx, opaque)
        base = mutated_base(node)
        if blocker is None and base is not None and base.op != "get_attr" and base not in current_set:
            blocker = Blocker(MUTATION, f"writes in place to '{base.name}', made outside its region", node.name, source_line(node))
            if base in in_runs:
                # The write runs eagerly, so the tensor it writes must not be a region's static output.
                block(base, Blocker(MUTATION, f"written in place by '{node.name}' outside its region", base.name, source_line(base)))
                evict.add(base)
        if blocker is not None:
            block(node, blocker)
        chunk = 0 if ctx.plan.num_chunks == 1 else node.meta.get(meta_keys.CHUNK)
        if chunk is None and blocker is None:
            continue
        joins = blocker is None and node.target is not ops.STAGE_BOUNDARY
        if current and (not joins or chunk != current_chunk):
            runs.append(current)
            current, current_set = [], set()
        if joins:
            current.append(node)
            current_set.add(node)
            in_runs.add(node)
            current_chunk = chunk
    if current:
        runs.append(current)
    return _tensor_edges(runs, evict)


def _breaks_edge(node: Node, inside: set[Node]) -> bool:
    """``node`` would pass a non-tensor across its run's edge (either way), or write in
    place to a tensor made outside the run."""
    if not isinstance(node.meta.get("val"), torch.Tensor) and any(u not in inside for u in node.users):
        return True
    base = mutated_base(node)
    if base is not None and base.op != "get_attr" and base not in inside:
        return True
    return any(a not in inside and a.op == "call_function" and not isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _tensor_edges(runs: list[list[Node]], evict: set[Node]) -> list[list[Node]]:
    """Split runs at ``evict`` and until only tensors cross their edges (nodes left out
    run eagerly)."""
    done: list[list[Node]] = []
    pending = list(reversed(runs))
    while pending:
        run = pending.pop()
        inside = set(run)
        bad = next((i for i, n in enumerate(run) if n in evict or _breaks_edge(n, inside)), None)
        if bad is None:
            done.append(run)
            continue
        for part in (run[bad + 1 :], run[:bad]):
            if part:
                pending.append(part)
    return done


def candidate_regions(gm: GraphModule) -> list[list[Node]]:
    """The candidate runs that ``find_cudagraph_candidates`` tagged, in graph order (index = candidate id)."""
    by_index: dict[int, list[Node]] = {}
    for node in gm.graph.nodes:
        index = node.meta.get(meta_keys.CUDAGRAPH_CANDIDATE)
        if index is not None:
            by_index.setdefault(index, []).append(node)
    return [by_index[i] for i in sorted(by_index)]


def region_slots(run: list[Node], plan: ParallelPlan) -> int:
    """Captures of ``run`` its pipeline stage holds under the plan's schedule (1 without pp)."""
    if plan.pp == 1:
        return 1
    chunk = run[0].meta[meta_keys.CHUNK]
    per_chunk = schedules.slots_per_chunk(plan.schedule_name, plan.pp, plan.vpp, plan.pp_rank_of_chunk(chunk))
    return per_chunk[chunk // plan.pp]


def find_cudagraph_candidates(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Tag blockers and candidate regions (module docstring)."""
    if not ctx.plan.cudagraphs:
        return gm
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    runs = sorted(_runs(gm, ctx), key=lambda run: position[run[0]])
    for index, run in enumerate(runs):
        for node in run:
            node.meta[meta_keys.CUDAGRAPH_CANDIDATE] = index
    return gm
