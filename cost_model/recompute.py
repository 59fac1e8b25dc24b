"""Which decoder layers recompute their activations in the backward (``plan.recompute_layers``),
and what that costs (``recomputed``: the memory; ``compute.segment_time(recompute=True)``: the
time, the forward run again with its collectives). The planner (``step_estimate.best_estimate``)
weighs every layer recomputed against none for a candidate that does not fit without: a
recomputing candidate is slower, so it wins only where it fits and the others do not, or where
a larger microbatch or fewer microbatches (less bubble) pay for the second forward.

``with_recompute`` settles the field from what the caller asked (``parallelize(recompute=...)``):

* ``None``: the plan's own choice; a plan made here takes the layers the model checkpointed
  itself (``analysis.trace_regions.checkpointed_layers``, reason ``model``), so a model that
  checkpoints to fit keeps fitting;
* ``"none"`` / False: no layer; ``"full"`` / True: every layer; a list of layer indices: those
  (reason ``user``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from torch.fx import GraphModule

from autotp.analysis.layers import num_layers
from autotp.analysis.trace_regions import checkpointed_layers
from autotp.cost_model.liveness import SegmentMemory
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


@functools.lru_cache(maxsize=1024)
def recomputed(memory: SegmentMemory) -> SegmentMemory:
    """A decoder layer's live bytes when it recomputes (``liveness.SegmentMemory`` rows):

    * saved from its forward to its backward: only its inputs (``memory.inputs``: the hidden
      states and the tables it reads from outside, such as rotary ones, counted once per layer
      although the layers share them; parameters are held anyway);
    * its forward: as without (an upper bound: the checkpointed forward frees each
      activation once no later node reads it);
    * its backward: the forward again (its rows, with its output's gradient, as big as its
      input, alive), then its backward as without, whose rows already count its own
      activations, now recomputed.

    Its time is ``compute.segment_time(..., recompute=True)``: the forward runs twice."""
    inputs = memory.inputs
    zeros = np.zeros_like(memory.forward)
    return SegmentMemory(
        saved=inputs,
        forward=memory.forward,
        backward=np.vstack([memory.forward + inputs, memory.backward]),
        own_grads=np.vstack([zeros, memory.own_grads]),
        grad_transient=np.vstack([zeros, memory.grad_transient]),
        param_grads=memory.param_grads,
        deferred=memory.deferred,
        inputs=memory.inputs,
    )
