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

from torch.fx import GraphModule

from autotp.analysis.propagation import propagate
from autotp.cost_model.fused_loss import loss_chunk_tokens
from autotp.analysis.propagation_result import Propagation, check_divisible, param_sharding
from autotp.ir.plan import KEPT_WHOLE_CONFLICT, KeptWhole, ParallelPlan, ParamLayout
from autotp.ir.errors import UserInputError

MIN_EMBEDDING_ROWS_PER_RANK = 16
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
    kept = tuple(KeptWhole(n, KEPT_WHOLE_CONFLICT, blocked[n]) for n in sorted(banned - set(replicate)))
    chunk = loss_chunk_tokens(gm, tp, {p.name for p in params if p.dim == 0})
    return ParallelPlan(tp=tp, params=tuple(params), kept_whole=kept, loss_chunk_tokens=chunk)
