"""Tensor-parallel layout planning: which parameters to shard, and how.

The layout walk (``autotp.analysis.propagation``) proposes Megatron's column/row pairs,
vocab-parallel embeddings and the vocab-parallel loss straight from the graph. This
module decides what to keep:

* Every proposal that leads to an op that needs the sharded dim whole (a softmax over
  the MoE router's experts, a norm over a sharded hidden dim...) is dropped: those
  parameters stay replicated, and the walk repeats until no conflict is left.
* An embedding table is vocab-parallel only if each rank keeps at least
  ``MIN_EMBEDDING_ROWS_PER_RANK`` rows; smaller tables (token types) stay replicated,
  since their partial sum costs as much to reduce as the table saves.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from torch.fx import GraphModule, Node

from autotp.analysis.propagation import propagate
from autotp.analysis.propagation_result import Propagation, check_divisible, param_sharding
from autotp.analysis.local_shapes import global_tensors
from autotp.analysis.op_kinds import op_name
from autotp.cost_model.communication import all_gather_s, overlapped_s
from autotp.cost_model.hardware import H200, HardwareProfile
from autotp.ir.plan import OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER, ParallelPlan, ParamLayout
from autotp.ir.errors import UserInputError

MIN_EMBEDDING_ROWS_PER_RANK = 16
REPLICATED_NOTE = "replicated (its sharding conflicts with the graph): "
"""How a plan note naming a parameter kept whole begins; the note goes on with the blocking node."""
MAX_PLANNING_ROUNDS = 16


def plan_tensor_parallel(gm: GraphModule, tp: int, *, replicate: Iterable[str] = ()) -> ParallelPlan:
    """A ``ParallelPlan`` for ``tp`` ranks; ``replicate`` names parameters to keep whole."""
    if tp < 1:
        raise UserInputError(f"tp must be >= 1, got {tp}")
    banned = set(replicate)

    def policy(name: str, kind: str, shape: tuple[int, ...]) -> bool:
        if tp == 1 or name in banned:
            return False
        if kind == "vocab":
            return shape[0] >= MIN_EMBEDDING_ROWS_PER_RANK * tp
        return True

    prop: Propagation | None = None
    blocked: dict[str, str] = {}  # parameter -> the first conflict that made it replicated
    for _ in range(MAX_PLANNING_ROUNDS):
        prop = propagate(gm, tp, policy=policy)
        if not prop.conflicts:
            break
        for c in prop.conflicts:
            for name in c.origins - banned:
                blocked.setdefault(name, str(c))
        new = set().union(*(c.origins for c in prop.conflicts)) - banned
        assert new, f"conflicts without a parameter to blame: {prop.conflicts[0]}"
        banned |= new
    assert prop is not None and not prop.conflicts, "layout planning did not converge"
    check_divisible(prop, gm)
    params = []
    for name in sorted(prop.decisions):
        found = param_sharding(prop, name)
        if found is not None:
            kind, dim, sharding = found
            params.append(ParamLayout(name, kind, dim, sharding))
    notes = tuple(f"{REPLICATED_NOTE}{n}; blocked at {blocked[n]}" for n in sorted(banned - set(replicate)))
    return ParallelPlan(tp=tp, params=tuple(params), notes=notes)


def choose_sequence_parallel(gm: GraphModule, tp: int) -> bool:
    """``sequence_parallel="auto"``: whether to run the replicated regions on 1/tp of the tokens.

    Sequence parallelism replaces each all-reduce of n bytes (ring: 2(t-1)/t·n on the wire)
    by a reduce-scatter and an all-gather ((t-1)/t·n each): the same bytes, one more call
    (about 20 µs on NVLink, ``hardware``). It divides the norm, residual and dropout work
    and their saved activations by t, which outweighs the extra call from a few thousand
    tokens on. So it is on whenever tp > 1 and tp divides the sequence (dim 1) of every
    batched graph input, and off otherwise (a sequence that does not split cannot use it).
    """
    if tp == 1:
        return False
    seqs = [int(n.meta["val"].shape[1]) for n in gm.graph.nodes
            if n.op == "placeholder" and getattr(n.meta.get("val"), "ndim", 0) >= 2]  # fmt: skip
    return bool(seqs) and all(s % tp == 0 for s in seqs)


_GEMM_OPERANDS = {"linear": (0, 1), "mm": (0, 1), "addmm": (1, 2)}
"""Positions of (activation, weight) in the GEMMs ``choose_tp_overlap`` looks at."""


def choose_tp_overlap(gm: GraphModule, plan: ParallelPlan, hw: HardwareProfile = H200) -> tuple[str, ...]:
    """``tp_overlap="auto"``: which sequence-parallel collectives to run behind their GEMMs.

    For each kind, over the linears of the traced graph whose weight the plan shards that
    way (``column``: the all-gather of their input, shared by the linears reading one
    input; ``row``: the reduce-scatter of their output), overlapping saves
    ``C - overlapped_s(C, M, t)`` (``communication``) and costs ``t - 1`` more GEMM launches
    (``op_overhead_s`` each, the ring's extra chunks). A kind is overlapped when it saves
    time over the whole graph; nothing is without sequence parallelism.
    """
    if not plan.sequence_parallel or plan.tp == 1:
        return ()
    kinds = {p.name: p.kind for p in plan.params}
    gathered: dict[Node, list[float]] = {}  # column linears' input -> [gathered bytes, their GEMM FLOPs]
    scattered: list[tuple[float, float]] = []
    for n in gm.graph.nodes:
        name = op_name(n.target) if n.op == "call_function" else ""
        if name not in _GEMM_OPERANDS:
            continue
        x_arg, weight = (n.args[i] for i in _GEMM_OPERANDS[name])
        if not (isinstance(weight, Node) and weight.op == "get_attr" and kinds.get(str(weight.target)) in ("column", "row")):
            continue
        (out,) = global_tensors(n)
        x = global_tensors(x_arg)[0]
        flops = 2.0 * out.numel * x.shape[-1] / plan.tp
        if kinds[str(weight.target)] == "column":
            entry = gathered.setdefault(x_arg, [float(x.nbytes), 0.0])
            entry[1] += flops
        else:
            scattered.append((float(out.nbytes), flops))
    chosen = []
    for kind, pairs in ((OVERLAP_ALL_GATHER, [tuple(v) for v in gathered.values()]), (OVERLAP_REDUCE_SCATTER, scattered)):
        saved = 0.0
        for nbytes, flops in pairs:
            comm = all_gather_s(nbytes, plan.tp, hw.intra_node)
            gemm = float(hw.matmul_time_s(np.array([flops]))[0])
            saved += comm - overlapped_s(comm, gemm, plan.tp) - (plan.tp - 1) * hw.op_overhead_s
        if pairs and saved > 0:
            chosen.append(kind)
    return tuple(chosen)
