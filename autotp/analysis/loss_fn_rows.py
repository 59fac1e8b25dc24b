"""Whether a ``loss_fn`` handed to ``train_step`` may be averaged over the pieces of a split batch.

``train_step`` cuts the global batch into pieces (dp ranks x microbatches), calls
``loss_fn(outputs)`` on each piece's outputs and averages the results. That is the whole
batch's loss only where ``loss_fn`` is a mean of terms that each read one row. A loss the
forward returns is traced with the model, so ``batch_rows`` and ``loss_denominators`` see it;
``loss_fn`` is Python that runs after the graph. Here it is traced alone (``make_fx`` on fake
tensors shaped like a piece's outputs, their rows where the traced forward put them:
``ParallelPlan.output_batch_dims``) and the same analyses read its graph. It cannot be
averaged where it

* mixes the rows (CLIP's contrastive loss: each image against every text of the batch);
* sums over the rows (``reduction="sum"``, or a sum over a fixed count): the pieces' mean
  is the whole batch's loss over the number of pieces;
* divides by a statistic of the rows (``(loss * mask).sum() / mask.sum()``, and a mean class
  loss over targets from the outputs, which counts the targets that are not ``ignore_index``):
  each piece divides by its own count, which the forward's own loss would have rescaled
  (``loss_denominators``) and a ``loss_fn``'s cannot. Targets the function makes itself
  (``torch.zeros(n)``) hold no rows and count alike in every piece;
* numbers positions across the rows (targets ``arange(logits[..., 0].numel())``): each piece counts
  from 0 again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autotp.analysis.batch_rows import batch_mixing_verdict
from autotp.analysis.loss_denominators import piece_denominators, summed_loss_terms
from autotp.ir.errors import describe

log = logging.getLogger(__name__)


def loss_fn_refusal(loss_fn: Callable[[Any], torch.Tensor], outputs: Any, row_dims: tuple[int | None, ...]) -> str:
    """Why averaging ``loss_fn`` over the pieces of a batch is not its value on the whole batch
    (module docstring), described; "" where the trace finds no reason. ``outputs``: one piece's
    outputs; ``row_dims``: per leaf of them, the dim holding the rows (None: none)."""
    leaves, spec = tree_flatten(outputs)
    if len(row_dims) != len(leaves):
        return ""
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and row_dims[i] is not None]
    if not at:
        return ""
    rows = leaves[at[0]].shape[row_dims[at[0]]]

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        filled = list(leaves)
        for i, t in zip(at, tensors):
            filled[i] = t
        return loss_fn(tree_unflatten(filled, spec))

    def traced(times: int) -> GraphModule:
        """``loss_fn`` traced on the piece's outputs with ``times`` as many rows (two or more, so that rows can mix)."""
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(leaves[i].detach()) for i in at]
            grown = [f.repeat_interleave(times, dim=row_dims[i]) for f, i in zip(fakes, at)]
        return make_fx(call, tracing_mode="fake", pre_dispatch=True)(*grown)  # ops as export keeps them (cross_entropy_loss)

    try:
        gm = traced(2)
    except Exception as e:  # noqa: BLE001 - any failure to trace leaves the loss unchecked, said once
        log.warning("loss_fn could not be traced (%s: %s), so autotp cannot check that averaging it over the pieces of the "
                    "batch gives the whole batch's loss", type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
        return ""
    mixing, rows_at = batch_mixing_verdict(gm, 2 * rows, [row_dims[i] for i in at])
    if mixing:
        return f"mixes the rows of its batch at {mixing}"
    if sums := summed_loss_terms(gm, rows_at, lambda: traced(4)):
        return f"sums over the rows of its batch at {describe(sums[0][0])} (the mean over the pieces is the whole batch's sum over their number)"
    if divisions := piece_denominators(gm, rows_at):
        return f"divides by a statistic of its batch's rows at {describe(divisions[0])} (each piece would divide by its own)"
    if counted := positions_over_rows(gm, traced(4)):
        return f"numbers the positions of its batch's rows at {describe(counted)} (each piece would count from its own first row)"
    return ""


_POSITIONS = {torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step, torch.ops.aten.linspace.default,
              torch.ops.aten.logspace.default}  # fmt: skip


def positions_over_rows(gm: GraphModule, grown: GraphModule) -> Any:
    """A tensor ``gm`` makes from no other whose values count positions (``arange``) along a dim that
    grows with the rows in ``grown`` (the same function traced on more rows): targets numbered across
    the flattened batch. None where there is none."""
    sizes = {n.name: n.meta.get("val") for n in grown.graph.nodes}
    for node in gm.graph.nodes:
        val, other = node.meta.get("val"), sizes.get(node.name)
        if node.target in _POSITIONS and isinstance(val, torch.Tensor) and isinstance(other, torch.Tensor) and val.shape != other.shape:
            return node
    return None
