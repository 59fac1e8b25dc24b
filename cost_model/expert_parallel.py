"""Expert parallelism in the plan: which MoE layers spread their experts over ep ranks, in
which dispatch mode, with what capacity (the times are in ``cost_model.moe_costs``).

``plan_expert_parallel`` checks the degrees against the model and the world, finds the MoE
layers (``autotp.analysis.moe``), warns about and skips the ones expert parallelism cannot
take (their experts stay tensor-parallel), and records the rest as ``plan.moe_layers``.
Their expert parameters leave the tensor-parallel layout (``etp = 1``: an expert is whole
on its ep rank), so the dense plan is redone with them replicated over tp.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from torch.fx import GraphModule

from autotp.analysis.moe import find_moe_layers
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from autotp.ir.moe_ops import DROPLESS, MODES, SYNC_FREE
from autotp.ir.plan import KEPT_WHOLE_COMM, ParallelPlan
from autotp.passes.expert_parallel import moe_layer_plans

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_FACTOR = 1.25
"""Sync-free capacity factor when none is given: 25% above perfectly balanced routing (the
value Switch Transformer and GShard train with); dropped rows are counted."""


def check_degrees(ep: int, etp: int | None, tp: int, dp: int) -> int:
    """The expert tensor-parallel degree to use; raises on degrees that do not fold onto the world."""
    if ep < 1:
        raise UserInputError(f"ep must be >= 1, got {ep}")
    if etp is not None and etp < 1:
        raise UserInputError(f"etp must be >= 1, got {etp}")
    if ep == 1:
        if etp not in (None, tp):
            raise UserInputError(f"etp={etp} without expert parallelism: with ep=1 the experts are split like the dense "
                                 f"layers (etp = tp = {tp}); pass ep > 1 to fold experts differently, or drop etp")  # fmt: skip
        return tp
    if etp not in (None, 1):
        raise UserInputError(f"etp={etp} with ep={ep}: autotp splits experts over ep ranks whole (etp=1) for now; "
                             "pass etp=1 (or leave it out), or ep=1 to keep tensor-parallel experts")  # fmt: skip
    if (tp * dp) % ep:
        raise UserInputError(f"ep={ep} does not divide tp*dp = {tp}*{dp} = {tp * dp}, the ranks of one pipeline stage that "
                             f"expert layers fold onto (etp*ep*edp = tp*dp); pick an ep that divides {tp * dp}")  # fmt: skip
    return 1


def plan_expert_parallel(gm: GraphModule, plan: ParallelPlan, *, ep: int, etp: int | None, dispatch: str | None,
                         capacity_factor: float | None) -> ParallelPlan:  # fmt: skip
    """``plan`` with expert parallelism over ``ep`` ranks (``dispatch``: ``dropless`` or
    ``sync_free``; None: dropless with ep > 1, nothing at ep = 1)."""
    expert_tp = check_degrees(ep, etp, plan.tp, plan.dp)
    if dispatch not in (None, *MODES):
        raise UserInputError(f"moe_dispatch must be one of {', '.join(MODES)}, got {dispatch!r}")
    mode = dispatch or (DROPLESS if ep > 1 else "")
    if capacity_factor is not None and mode != SYNC_FREE:
        raise UserInputError(f"moe_capacity_factor={capacity_factor} drops the rows past the capacity, but the dispatch is "
                             f"{mode or 'not expert-parallel'}, which promises every row reaches its expert; pass "
                             "moe_dispatch='sync_free' with it, or drop the capacity factor")  # fmt: skip
    if capacity_factor is not None and capacity_factor <= 0:
        raise UserInputError(f"moe_capacity_factor must be > 0, got {capacity_factor}")
    if not mode:
        return replace(plan, ep=1, etp=expert_tp)
    if plan.sequence_parallel and (ep > 1 or mode == SYNC_FREE):
        raise UserInputError("sequence_parallel=True with expert parallelism: the dispatch moves whole tokens; pass "
                             "sequence_parallel=False with ep/moe_dispatch")  # fmt: skip
    layers = find_moe_layers(gm)
    if not layers:
        raise UserInputError(f"ep={ep} / moe_dispatch={mode!r}: the model has no MoE layer autotp recognises (a grouped "
                             "matmul over [experts, ...] weights, or a loop over expert modules picked by a topk "
                             "router); drop ep and moe_dispatch")  # fmt: skip
    for layer in layers:
        if layer.blocker:
            log.warning("MoE layer %s keeps tensor-parallel experts: %s", layer.name, layer.blocker)
        elif layer.num_experts % ep:
            raise UserInputError(f"ep={ep} does not divide the {layer.num_experts} experts of {layer.name}; pick an ep "
                                 f"that divides {layer.num_experts}")  # fmt: skip
    usable = [l for l in layers if not l.blocker]
    if mode == SYNC_FREE and any(l.form != "grouped" for l in usable):
        loop = next(l for l in usable if l.form != "grouped")
        raise UserInputError(f"moe_dispatch='sync_free' needs fused expert weights; {loop.name} loops over expert modules "
                             "(its rows come from nonzero, a host sync); use moe_dispatch='dropless'")  # fmt: skip
    factor = (capacity_factor or DEFAULT_CAPACITY_FACTOR) if mode == SYNC_FREE else 0.0
    entries = moe_layer_plans(usable, plan.tp, factor)
    chosen = replace(plan, ep=ep, etp=expert_tp, moe_dispatch=mode, moe_capacity_factor=factor, moe_layers=entries)
    if ep > 1 and plan.tp > 1:
        experts = {p for e in entries for p in e.params}
        slower = tuple(k for k in plan.kept_whole if k.reason == KEPT_WHOLE_COMM)
        dense = plan_tensor_parallel(gm, plan.tp, replicate=experts | {k.name for k in slower})
        chosen = replace(chosen, params=dense.params, kept_whole=dense.kept_whole + slower, gathered=dense.gathered)
    return chosen
