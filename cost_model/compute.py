"""One rank's compute, tensor-parallel communication and activations, from a traced graph.

``ModelCosts`` holds a graph traced once (``autotp.compiler.trace_for_planning``
traces one decoder layer on the meta device). For each tp it plans the graph
(``plan_tensor_parallel``) and compiles it through its ``compile_fn``, as compiling rank 0 does;
``autotp.cost_model.graph_costs`` then gives every node its local shapes, its layer (``embedding``,
decoder layer i, ``head``) and its collectives. Those are summed into one ``Segment``
per layer. A model with more layers than were traced repeats them: layer i costs what
traced layer i mod k does.

**Microbatch size.** A tensor computed from the inputs (reachable from a placeholder),
or from a broadcast or factory that creates a dim 0 of the traced batch size (HF's
masks), has b times the elements at microbatch size b; weights and rotary tables do not
grow. Scaling dim 0 of the first kind by 2 and evaluating
``autotp.cost_model.flops.node_cost`` again gives every node's FLOPs and bytes as
``const + per_sample·b`` (``Affine``), exactly, since no node is quadratic in b.

**Time of a segment at microbatch size b** (``segment_time``):

* GPU time of a node, forward: matmuls ``max(HardwareProfile.matmul_time_s(F), bytes/mem_bw)``
  (a node running its FLOPs as p equal GEMMs, ``overlap_overheads.gemm_pieces``: p·matmul_time_s(F/p));
  fused attention ``max(attention_latency_s + F/attention_rate, bytes/mem_bw)``; everything else
  ``max(F/matmul_rate, bytes/mem_bw)`` (the roofline of ``flops.compute_time_s``);
  all of it times ``compute_time_scale``, which calibration measures on a whole layer.
* The fused lm_head and loss (``linear_cross_entropy``) runs its three GEMMs and its loss
  passes in its forward, one after another: ``3·matmul_time_s(F) + bytes/mem_bw``
  (``autotp.cost_model.fused_loss``); its backward only scales the two gradients (0).
* FP8 GEMMs (``fp8_linear``, and a fused loss whose lm_head runs in FP8) run their FLOPs at
  ``fp8_matmul_speedup`` times the rate, and
  their casts add ``autotp.cost_model.fp8.cast_bytes`` / mem_bw forward and backward.
* Backward: a GEMM's input and weight gradients are two GEMMs of its size (2×);
  memory-bound ops ``elementwise_backward_factor`` × forward; attention
  ``attention_backward_factor`` × forward (both of the ``HardwareProfile``); a node whose
  output several differentiable nodes read adds the gradient sums' bytes / mem_bw (``gradient_sums``).
* Collectives (forward all-reduce *g*, backward all-reduce *f*, all-gathers) cost
  ``communication.group_collective_s`` at their node, plus one copy of their tensor
  (autotp's collectives clone before an all-reduce and concatenate after an
  all-gather: 2 bytes moved per byte); the next op waits for them. An overlapped one
  (``all_gather_matmul``, ``matmul_reduce_scatter`` and their duals backward) costs only
  what its GEMM leaves exposed, ``communication.overlapped_s`` with M the node's forward
  GEMM time (backward, the dual's GEMM is the grad-input GEMM, as long as the forward one;
  the weight-grad GEMM runs after it, unhidden). On GPUs the fused ops also synchronize per
  call, copy their operands and products into the split dim's order and back (where rows
  precede it) and concatenate several weights' operands along K (``overlap_overheads``).
* Host time: ``op_overhead_s`` to issue each graph node forward and
  ``backward_op_overhead_s`` for each node that needs a gradient (an autograd node)
  backward; a node with a tp collective costs ``collective_host_s`` instead, in the
  direction of its collective (``autograd.Function`` in Python and a c10d call).
* Eager execution is a queue (``queue_s``): the host issues nodes one after another, and
  the GPU starts node i when it is done with node i-1 and the host has issued node i.
  With H_k the host time to issue nodes 1..k and g_j the GPU time of node j, the GPU
  finishes at ``max_k (H_k + Σ_{j>=k} g_j)``: long GEMMs hide the issue of the small ops
  after them, and runs of small ops leave the GPU waiting for the host. The forward runs
  in graph order, the backward in reverse over the autograd nodes, each from an empty
  queue.
* ``compile=True`` (``ModelCosts.rank(compiled=True)``, ``Training.compiled``): a fusible node's time
  is its region's bytes (``fused_kernels``: one kernel per region of memory-bound nodes), the
  fused loss's passes are fused, the gradient sums cost one read per extra gradient, and the host
  issues kernels (``compiled_launch_host_s`` each) instead of nodes.

**Preamble.** Nodes computed from the inputs and buffers alone (masks, positions,
rotary tables: what ``autotp.passes.split_stages`` leaves unassigned) form their own
segment, forward only. The runtime repeats them in every pipeline chunk (each chunk's
graph recomputes what it reads), so the planner counts them once per chunk and
microbatch, not once per model.

**Activations** kept for backward: ``saved_tensors.saved_inputs`` (eager autograd's, per op), or under
``compile=True`` ``fused_kernels.compiled_saves``; ``autotp.cost_model.liveness`` replays the forward and
backward with them (``Segment.memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import functools

import numpy as np
import torch
from autotp.cost_model.affine import Affine, affine_costs
from autotp.cost_model.communication import group_collective_s, overlapped_s
from autotp.cost_model.flops import global_tensors
from autotp.cost_model.fp8 import cast_bytes, has_fp8_gemms, plan_fp8, sites_plan
from autotp.cost_model.fused_kernels import compiled_saves, fused_regions, fusible, region_bytes
from autotp.cost_model.gradient_sums import GRADIENT_SUM_BYTES, gradient_sum_bytes
from autotp.cost_model.hardware import HardwareProfile
from autotp.cost_model.liveness import SegmentMemory, simulate
from autotp.cost_model.overlap_overheads import gemm_pieces, overhead_seconds, overlap_overheads
from autotp.cost_model.pipeline import balanced_cuts, layer_costs
from autotp.cost_model.saved_tensors import needs_grad, saved_inputs
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.passes.split_stages import repeatable
from torch.fx import GraphModule, Node

from autotp.cost_model.graph_costs import GraphReport, assign_layers, build_report
from autotp.analysis.layers import EMBEDDING, HEAD, LayerKey, num_layers
from autotp.ir.op_facts import Direction, OpKind, op_kind, op_name
from autotp.ir import ops
from autotp.ir.plan import ParallelPlan
from autotp.ir.errors import UserInputError

CompileFn = Callable[[ParallelPlan], GraphModule]
"""A plan -> tp rank 0's graph compiled under it, on meta (``autotp.compiler.model_costs`` binds it)."""

PREAMBLE = "preamble"
MATMUL_BACKWARD_FACTOR = 2.0
COLLECTIVE_COPY_BYTES = 2
_MATMUL, _ATTENTION, _OTHER, _FUSED_LOSS = 1, 2, 0, 3
_BATCH_MAKERS = {"expand", "new_ones", "new_zeros", "new_full", "new_empty", "ones", "zeros", "full", "empty"}


@dataclass(frozen=True)
class Collective:
    """A collective of the node at position ``node`` of its segment (forward, or in its backward)."""

    kind: str
    direction: str
    bytes: Affine
    ranks: int
    node: int
    overlapped: bool = False


@dataclass(frozen=True, eq=False)
class Segment:
    """One rank's share of the embedding, a decoder layer, or the head.

    Arrays run over the segment's call nodes in graph order: ``flops`` and ``bytes`` are
    [nodes, 2] of (const, per_sample); ``kinds`` tells matmuls and attention from the
    rest; ``grad`` marks the nodes that have a backward.
    """

    flops: np.ndarray
    bytes: np.ndarray
    kinds: np.ndarray
    grad: np.ndarray
    collectives: tuple[Collective, ...]
    params: dict[str, int]
    memory: SegmentMemory
    # GEMMs each node runs as: 1, or t per weight for the overlapped collectives' chunks.
    pieces: np.ndarray | None = None
    fp8: np.ndarray | None = None  # FP8 GEMM nodes; their casts' bytes [nodes, (fwd, bwd), (const, per_sample)]:
    casts: np.ndarray | None = None
    grad_sums: np.ndarray | None = None  # [nodes, 2]: bytes of the backward's gradient sums (``gradient_sums``)
    overlap: np.ndarray | None = None  # [nodes, 6, (const, per_sample)]: ``overlap_overheads.overlap_overheads``
    # a rank graph run with ``compile=True``: nodes inductor fuses, and at each region's first node its
    # [(bytes, kernels, backward bytes), (const, per_sample)] (``fused_kernels``); None: eager
    fusible: np.ndarray | None = None
    fused: np.ndarray | None = None

    @property
    def ops(self) -> int:
        return len(self.kinds)

    @property
    def grad_ops(self) -> int:
        return int(self.grad.sum())

    @functools.cached_property
    def param_numel(self) -> int:
        return sum(self.params.values())


@dataclass(frozen=True)
class SegmentTime:
    """Forward + backward of one microbatch through a segment: the queue's time, and the
    GPU's compute, communication and the host's issue time within it."""

    total_s: float
    compute_s: float
    comm_s: float
    host_s: float

    @property
    def gpu_s(self) -> float:
        """The GPU's busy time: compute and communication."""
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class RankCosts:
    """A model compiled for one tp: the plan and rank 0's segments (every tp rank does the same).

    ``preamble`` holds the nodes every pipeline chunk repeats (module docstring); they
    are in no other segment.
    """

    plan: ParallelPlan
    embedding: Segment
    layers: tuple[Segment, ...]
    head: Segment
    preamble: Segment


def batch_dependent(gm: GraphModule, batch: int) -> set[Node]:
    """Nodes whose values have one row per sample: computed from the graph's inputs, or
    from a broadcast or factory that creates dim 0 of size ``batch`` (HF builds masks and
    positions from shapes, not from the inputs' values)."""
    out: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in out for a in node.all_input_nodes) or _makes_batch_dim(node, batch):
            out.add(node)
    return out


def _makes_batch_dim(node: Node, batch: int) -> bool:
    if node.op != "call_function" or op_name(node.target) not in _BATCH_MAKERS:
        return False
    outputs = global_tensors(node)
    inputs = [t for a in node.all_input_nodes for t in global_tensors(a)]
    return bool(outputs and outputs[0].shape) and outputs[0].shape[0] == batch and all(
        not t.shape or t.shape[0] == 1 for t in inputs
    )


def _kind(node: Node) -> int:
    if node.target is ops.LINEAR_CROSS_ENTROPY:
        return _FUSED_LOSS
    kind = op_kind(node.target)
    if kind.is_matmul:
        return _MATMUL
    return _ATTENTION if kind is OpKind.ATTENTION else _OTHER


class ModelCosts:
    """A traced model's costs per rank at any tp and microbatch size (sequence length fixed)."""

    def __init__(self, gm: GraphModule, num_layers_total: int | None = None, *, compile_fn: CompileFn) -> None:
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        if not inputs:
            raise UserInputError("the traced graph has no tensor inputs; trace it with example inputs such as input_ids")
        shape = tuple(inputs[0].meta["val"].shape)
        self.gm = gm
        self._compile_fn = compile_fn
        self.batch = shape[0]
        self.seq = shape[1] if len(shape) > 1 else 1
        self.traced_layers = num_layers(gm)
        self.num_layers = num_layers_total if num_layers_total is not None else self.traced_layers
        dependent = batch_dependent(gm, self.batch)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        flops = affine_costs(calls, {}, dependent, self.batch)[:, 0]
        self._segment_flops = self._per_segment_flops(calls, flops)
        self.layer_weights, self.head_weight = layer_costs(gm)
        self.hidden_bytes = self._hidden_bytes(calls)
        self.linears = self._linears(calls, dependent)
        self._plans: dict[tuple[int, frozenset[str]], ParallelPlan] = {}
        self._ranks: dict[tuple, RankCosts] = {}  # by the plan's layouts: two replicate sets may give one plan
        self._asked: dict[tuple, RankCosts] = {}  # by rank()'s arguments
        self._cuts: dict[int, tuple[int, ...]] = {}
        self._forward_flops: dict[int, float] = {}

    def _per_segment_flops(self, calls: list[Node], flops: np.ndarray) -> dict[LayerKey, Affine]:
        layers = assign_layers(self.gm)
        sums: dict[LayerKey, np.ndarray] = {}
        for n, row in zip(calls, flops):
            sums[layers[n]] = sums.get(layers[n], np.zeros(2)) + row
        return {k: Affine(*v) for k, v in sums.items()}

    def forward_flops(self, batch: int) -> float:
        """Whole-model forward FLOPs of ``batch`` samples (every layer, not one rank's share; cached)."""
        if batch not in self._forward_flops:
            zero = Affine(0, 0)
            layers = sum(self._segment_flops.get(self.traced_index(i), zero).at(batch) for i in range(self.num_layers))
            self._forward_flops[batch] = layers + sum(v.at(batch) for k, v in self._segment_flops.items() if not isinstance(k, int))
        return self._forward_flops[batch]

    def traced_index(self, layer: int) -> int:
        """The traced layer that stands for model layer ``layer``."""
        return layer % self.traced_layers

    def layer_chunks(self, chunks: int) -> tuple[int, ...]:
        """The chunk of every model layer, the layers balanced by matmul weight (``balanced_cuts``;
        ``plan_pipeline`` also cuts around the blocks outside them, weighing parameters too; cached)."""
        if chunks == 1:
            return (0,) * self.num_layers
        if chunks not in self._cuts:
            weights = [self.layer_weights[self.traced_index(i)] for i in range(self.num_layers)]
            weights[-1] += self.head_weight  # the last layer and the head share the last chunk
            self._cuts[chunks] = balanced_cuts(weights, chunks)
        return self._cuts[chunks]

    def total_params(self) -> int:
        """Parameter elements of the whole model."""
        whole = self.rank(1)
        layers = sum(whole.layers[self.traced_index(i)].param_numel for i in range(self.num_layers))
        return layers + sum({**whole.embedding.params, **whole.head.params}.values())

    def _hidden_bytes(self, calls: list[Node]) -> float:
        """Bytes per sample of the hidden state, what a pipeline stage sends to the next."""
        for n in calls:
            if op_name(n.target) == "embedding":
                return sum(t.nbytes for t in global_tensors(n)) / self.batch
        return 0.0

    def _linears(self, calls: list[Node], dependent: set[Node]) -> tuple[tuple[str, float], ...]:
        """(weight name, forward FLOPs per sample) of every linear reading a parameter."""
        params = dict(self.gm.named_parameters(remove_duplicate=False))
        out = []
        for n in calls:
            name = op_name(n.target)
            weight = n.args[1] if name == "linear" else n.args[2] if name == "addmm" else None
            if isinstance(weight, Node) and weight.op == "get_attr" and str(weight.target) in params:
                flops = affine_costs([n], {}, dependent, self.batch)[:, 0]
                out.append((str(weight.target), float(flops[0, 1])))
        return tuple(out)

    def rank(
        self, tp: int, replicate: frozenset[str] = frozenset(), gather_outputs: bool = True, *,
        sequence_parallel: bool = False, tp_overlap: tuple[str, ...] = (), fp8: str = "", compiled: bool = False,
    ) -> RankCosts:  # fmt: skip
        """Rank 0's segments at ``tp`` with the linears in ``replicate`` kept whole (cached);
        ``gather_outputs``, ``sequence_parallel``, ``tp_overlap`` and ``fp8`` (a recipe, ""
        for none) as in ``ParallelPlan``; ``compiled``: run with ``compile=True`` (``fused_kernels``).

        Raises plan_tensor_parallel's ValueError when tp does not divide the model.
        """
        sequence_parallel = sequence_parallel and tp > 1
        asked = (tp, replicate, gather_outputs, sequence_parallel, tp_overlap, fp8, compiled)
        if asked in self._asked:
            return self._asked[asked]
        if (tp, replicate) not in self._plans:
            self._plans[(tp, replicate)] = plan_tensor_parallel(self.gm, tp, replicate=replicate)
        plan = replace(self._plans[(tp, replicate)], gather_outputs=gather_outputs, sequence_parallel=sequence_parallel,
                       tp_overlap=tp_overlap)  # fmt: skip
        if fp8:
            plan = plan_fp8(self._compile_fn(sites_plan(plan)), plan, fp8)
        key = (tp, plan.params, gather_outputs, sequence_parallel, tp_overlap, plan.fp8_linears, plan.fp8_all_gather, compiled)
        if key not in self._ranks:
            self._ranks[key] = self._compile(plan, compiled)
        self._asked[asked] = self._ranks[key]
        return self._ranks[key]

    def _compile(self, plan: ParallelPlan, compiled: bool) -> RankCosts:
        gm = self._compile_fn(plan)
        report = build_report(gm, plan, 0)
        dependent = batch_dependent(gm, self.batch)
        grad = needs_grad(gm)
        tensors = {r.node: list(r.tensors) for r in report.nodes}
        repeated: set[Node] = set()
        for n in gm.graph.nodes:
            if repeatable(n, repeated):
                repeated.add(n)
        groups: dict[LayerKey, list] = {}
        for r in report.nodes:
            groups.setdefault(PREAMBLE if r.node in repeated else r.layer, []).append(r)
        owned = _params_by_segment(gm, report)
        segment_of = {r.node: (PREAMBLE if r.node in repeated else r.layer) for r in report.nodes}
        saved_by = {n: saved_inputs(n, grad) for n in gm.graph.nodes if n.op == "call_function"}
        regions = fused_regions(gm.graph.nodes, segment_of) if compiled else {}
        if compiled:  # what AOTAutograd's partitioner keeps
            saved_by = compiled_saves(regions, saved_by, tensors)
        memory = simulate(gm, tensors, dependent, grad, saved_by, segment_of, self.batch, compiled)

        def segment(key: LayerKey) -> Segment:
            members = groups.get(key, [])
            calls = [r.node for r in members if r.node.op == "call_function"]
            position = {n: i for i, n in enumerate(calls)}
            flops, nbytes = affine_costs(calls, tensors, dependent, self.batch).transpose(1, 0, 2)
            collectives = tuple(
                Collective(
                    c.kind, c.direction, Affine(0, c.bytes / self.batch) if r.node in dependent else Affine(c.bytes, 0),
                    c.ranks, position[r.node], c.overlapped,
                )
                for r in members
                for c in r.collectives
            )
            kinds = np.array([_kind(n) for n in calls], dtype=int)
            pieces = np.array([gemm_pieces(n) for n in calls], dtype=float)
            needs = np.array([n in grad for n in calls], dtype=bool)
            fp8 = np.array([has_fp8_gemms(n) for n in calls], dtype=bool)
            casts = affine_costs(calls, tensors, dependent, self.batch, cast_bytes) if fp8.any() else None
            sums = affine_costs(calls, tensors, dependent, self.batch, lambda n, t: gradient_sum_bytes(n, t, grad))[:, 0]
            overlap = affine_costs(calls, tensors, dependent, self.batch, overlap_overheads) if (pieces > 1).any() else None
            fusible_, fused = None, None
            if compiled:
                fusible_ = np.array([fusible(n) for n in calls], dtype=bool)
                fused = affine_costs(calls, tensors, dependent, self.batch, region_bytes(regions, grad))
            return Segment(flops, nbytes, kinds, needs, collectives, owned.get(key, {}), memory.get(key, SegmentMemory.empty()),
                           pieces, fp8, casts, sums, overlap, fusible_, fused)  # fmt: skip

        layers = tuple(segment(i) for i in range(self.traced_layers))
        return RankCosts(plan, segment(EMBEDDING), layers, segment(HEAD), segment(PREAMBLE))


def _params_by_segment(gm: GraphModule, report: GraphReport) -> dict[LayerKey, dict[str, int]]:
    """Local parameter elements read by each segment, tied parameters under one name.

    A parameter read by two segments (an embedding tied to the lm_head) is listed in both:
    a pipeline stage holds every parameter its segments read.
    """
    named = dict(gm.named_parameters(remove_duplicate=False))
    canonical: dict[int, str] = {}
    for name, p in named.items():
        canonical.setdefault(id(p), name)
    layer_of = {r.node: r.layer for r in report.nodes}
    owned: dict[LayerKey, dict[str, int]] = {}
    for r in report.nodes:
        if r.node.op == "get_attr" and str(r.node.target) in named:
            name = canonical[id(named[str(r.node.target)])]
            for user in r.node.users:
                owned.setdefault(layer_of[user], {})[name] = r.tensors[0].numel
    return owned


def node_times(seg: Segment, batch: int, hw: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
    """GPU compute seconds of each node of ``seg`` at ``batch`` samples, (forward, backward), without collectives."""
    flops = seg.flops[:, 0] + seg.flops[:, 1] * batch
    nbytes = seg.bytes[:, 0] + seg.bytes[:, 1] * batch
    memory = nbytes / hw.memory_bytes_per_s
    matmul = seg.kinds == _MATMUL
    attention = seg.kinds == _ATTENTION
    forward = np.maximum(flops / hw.matmul_flops_per_s, memory)
    pieces = seg.pieces[matmul] if seg.pieces is not None else 1.0
    speed = np.where(seg.fp8[matmul], hw.fp8_matmul_speedup, 1.0) if seg.fp8 is not None else 1.0
    forward[matmul] = np.maximum(pieces * hw.matmul_time_s(flops[matmul] / pieces / speed), memory[matmul])
    forward[attention] = np.maximum(hw.attention_time_s(flops[attention]), memory[attention])
    fused_s = (seg.fused[:, :, 0] + seg.fused[:, :, 1] * batch) / hw.memory_bytes_per_s if seg.fused is not None else None
    loss = seg.kinds == _FUSED_LOSS  # all three GEMMs and the loss passes in its forward, one after another
    loss_speed = np.where(seg.fp8[loss], hw.fp8_matmul_speedup, 1.0) if seg.fp8 is not None else 1.0
    loss_memory = fused_s[loss, 0] if fused_s is not None else memory[loss]
    forward[loss] = (1 + MATMUL_BACKWARD_FACTOR) * hw.matmul_time_s(flops[loss] / loss_speed) + loss_memory
    if fused_s is not None:  # compile=True: the fusible nodes run as their regions' kernels (``fused_kernels``)
        forward = np.where(seg.fusible, fused_s[:, 0], forward)
    forward *= hw.compute_time_scale
    factor = np.where(attention, hw.attention_backward_factor, np.where(matmul, MATMUL_BACKWARD_FACTOR, hw.elementwise_backward_factor))
    factor = np.where(loss, 0.0, factor)  # its backward scales the two gradients it computed
    backward = forward * factor
    if fused_s is not None:
        backward = np.where(seg.fusible, fused_s[:, 2] * hw.compute_time_scale * hw.elementwise_backward_factor, backward)
    if seg.casts is not None:  # FP8 casts: memory-bound kernels of their own, beside the GEMMs
        cast_s = (seg.casts[:, :, 0] + seg.casts[:, :, 1] * batch) / hw.memory_bytes_per_s * hw.compute_time_scale
        forward, backward = forward + cast_s[:, 0], backward + cast_s[:, 1]
    if seg.grad_sums is not None:  # compiled, the sums fuse into the backward's kernels: one read per extra gradient
        sums = (seg.grad_sums[:, 0] + seg.grad_sums[:, 1] * batch) / (GRADIENT_SUM_BYTES if seg.fused is not None else 1)
        backward = backward + sums / hw.memory_bytes_per_s * hw.compute_time_scale
    if seg.overlap is not None:  # the fused overlapped GEMMs' barriers and copies (``overlap_overheads``)
        extra_s = overhead_seconds(seg.overlap, batch, hw) * hw.compute_time_scale
        forward, backward = forward + extra_s[:, 0], backward + extra_s[:, 1]
    return forward, backward


def segment_time(seg: Segment, batch: int, hw: HardwareProfile, tp_ranks_per_node: int, recompute: bool = False) -> SegmentTime:
    """Forward + backward of ``batch`` samples through ``seg`` (formulas in the module docstring);
    ``recompute``: the backward runs the forward again first, collectives included."""
    forward, backward = node_times(seg, batch, hw)
    comm = {"forward": np.zeros(seg.ops), "backward": np.zeros(seg.ops)}
    if seg.fused is None:
        host = {"forward": np.full(seg.ops, hw.op_overhead_s), "backward": np.full(seg.ops, hw.backward_op_overhead_s)}
        backs = seg.grad.copy()
    else:
        launches, backs = compiled_launches(seg)
        host = {"forward": launches[0] * hw.compiled_launch_host_s, "backward": launches[1] * hw.compiled_launch_host_s}
    gemm = forward.copy()
    for c in seg.collectives:
        nbytes = c.bytes.at(batch)
        t = group_collective_s(c.kind, nbytes, c.ranks, min(c.ranks, tp_ranks_per_node), hw)
        comm[c.direction][c.node] += overlapped_s(t, gemm[c.node], c.ranks) if c.overlapped else t
        host[c.direction][c.node] = hw.collective_host_s
        (forward if c.direction == Direction.FORWARD else backward)[c.node] += COLLECTIVE_COPY_BYTES * nbytes / hw.memory_bytes_per_s
    backs |= comm["backward"] > 0
    gpu_forward = forward + comm["forward"]
    gpu_backward = (backward + comm["backward"])[backs][::-1]
    host_backward = host["backward"][backs][::-1]
    runs = 1 + recompute  # times the forward runs
    return SegmentTime(
        total_s=runs * queue_s(host["forward"], gpu_forward) + queue_s(host_backward, gpu_backward),
        compute_s=float(runs * forward.sum() + backward[backs].sum()),
        comm_s=float(runs * comm["forward"].sum() + comm["backward"].sum()),
        host_s=float(runs * host["forward"].sum() + host_backward.sum()),
    )


def compiled_launches(seg: Segment) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Kernels each node of a compiled segment launches (forward, backward), and the nodes with a backward: a
    fusible node its region's (``fused_kernels``: at the region's first node), any other one as eager (a GEMM's
    backward two)."""
    moves = (seg.flops.sum(axis=1) > 0) | (seg.bytes.sum(axis=1) > 0)
    fused_backward = seg.fused[:, 2].sum(axis=1) > 0
    forward = np.where(seg.fusible, seg.fused[:, 1, 0], moves.astype(float))
    backs = np.where(seg.fusible, fused_backward, seg.grad & moves)
    backward = np.where(seg.kinds == _MATMUL, MATMUL_BACKWARD_FACTOR, 1.0) * backs
    return (forward, backward), backs


def queue_s(host: np.ndarray, gpu: np.ndarray) -> float:
    """When the GPU finishes a queue of nodes: ``max_k (H_k + Σ_{j>=k} g_j)`` (module docstring)."""
    if not len(gpu):
        return 0.0
    issued = np.cumsum(host)
    remaining = np.cumsum(gpu[::-1])[::-1]
    return float(np.max(issued + remaining))
