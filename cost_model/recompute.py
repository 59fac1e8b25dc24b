"""Which decoder layers recompute their activations in the backward (``plan.recompute_layers``).

``with_recompute`` settles the field from what the caller asked (``parallelize(recompute=...)``):

* ``None``: the plan's own choice; a plan made here takes the layers the model checkpointed
  itself (``analysis.trace_regions.checkpointed_layers``, reason ``model``), so a model that
  checkpoints to fit keeps fitting;
* ``"none"`` / False: no layer; ``"full"`` / True: every layer; a list of layer indices: those
  (reason ``user``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from torch.fx import GraphModule

from autotp.analysis.layers import num_layers
from autotp.analysis.trace_regions import checkpointed_layers
from autotp.ir.errors import UserInputError
from autotp.ir.plan import RECOMPUTE_MODEL, RECOMPUTE_USER, ParallelPlan

log = logging.getLogger(__name__)

RecomputeArg = str | bool | Sequence[int] | None


def with_recompute(traced: GraphModule, plan: ParallelPlan, recompute: RecomputeArg, planned_here: bool) -> ParallelPlan:
    """``plan`` with ``recompute_layers`` settled (module docstring). ``planned_here``: the plan
    was not given by the caller (its recompute field is the default)."""
    layers = num_layers(traced)
    if recompute is None:
        if not planned_here or plan.recompute_layers:
            return plan
        own = checkpointed_layers(traced)
        if own:
            log.info("the model checkpoints layers %s itself: the rank graph recomputes them", list(own))
        return replace(plan, recompute_layers=own, recompute_reason=RECOMPUTE_MODEL if own else "")
    if recompute is False or recompute == "none":
        return replace(plan, recompute_layers=(), recompute_reason="")
    if recompute is True or recompute == "full":
        chosen: tuple[int, ...] = tuple(range(layers))
    elif isinstance(recompute, Sequence) and not isinstance(recompute, str) and all(isinstance(i, int) for i in recompute):
        chosen = tuple(sorted(set(recompute)))
        if any(i < 0 or i >= layers for i in chosen):
            raise UserInputError(f"recompute={list(recompute)}: the model has decoder layers 0..{layers - 1}")
    else:
        raise UserInputError(f"recompute={recompute!r}: give 'none', 'full', True, False or a list of decoder-layer indices")
    return replace(plan, recompute_layers=chosen, recompute_reason=RECOMPUTE_USER if chosen else "")
