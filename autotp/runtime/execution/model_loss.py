"""Where ``train_step`` finds the loss a model's forward returned itself.

Models compute their loss in ``forward`` from whichever keyword they take (``labels``,
``targets``, ``noise``...) and return it the way their code base does: under ``"loss"`` of a
dict or ``ModelOutput``, or as an element of a tuple (minGPT's ``(logits, loss)``). Without a
``loss_fn``, the loss is ``outputs["loss"]`` where the outputs have that key, else the only
0-dim floating tensor among them (a loss is a scalar; logits are not), with a warning (an
auxiliary loss returned alone would look the same). Anything else is
ambiguous and raises, naming what to pass. On a pipeline this runs on the last stage's outputs.

A ``loss_fn`` of a split step (dp ranks x microbatches) is checked once, on the first piece's
outputs, by ``analysis.loss_fn_rows``: one the pieces cannot average (it mixes the batch's rows,
sums over them, or divides by a count of them) is refused before any backward.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from autotp.analysis.loss_fn_rows import loss_fn_refusal
from autotp.compiler import LOSS_ONLY
from autotp.ir.errors import UserInputError

LossFn = Callable[[Any], Tensor]


# The loss functions found fit to average over pieces, with the outputs' row dims they were checked on: by
# their code (lambdas made anew on every call share it), callable objects by the object, held weakly.
_CHECKED: set[tuple[Any, tuple[int | None, ...]]] = set()
_CHECKED_OBJECTS: weakref.WeakKeyDictionary[Any, set[tuple[int | None, ...]]] = weakref.WeakKeyDictionary()


def step_loss(loss_fn: LossFn | None, row_dims: tuple[int | None, ...], dp: int, microbatches: int) -> tuple[LossFn, tuple[str, ...]]:
    """What a step of ``dp`` ranks x ``microbatches`` trains on, and the outputs it reads (the loss
    alone without a ``loss_fn``): ``returned_loss``, or ``loss_fn`` (checked once where the batch is
    split: ``checked_loss_fn``)."""
    if loss_fn is None:
        return returned_loss, LOSS_ONLY
    return (checked_loss_fn(loss_fn, row_dims, dp * microbatches, dp) if dp * microbatches > 1 else loss_fn), ()


def checked_loss_fn(loss_fn: LossFn, row_dims: tuple[int | None, ...], pieces: int, dp: int) -> LossFn:
    """``loss_fn``, refusing on its first call the one that ``pieces`` pieces of the batch cannot average
    (module docstring); ``row_dims``: ``ParallelPlan.output_batch_dims``. A check that passes is kept
    (``_CHECKED``)."""
    code = getattr(loss_fn, "__code__", None)

    def checked() -> bool:
        return (code, row_dims) in _CHECKED if code is not None else row_dims in _CHECKED_OBJECTS.get(loss_fn, ())

    def loss_of(outputs: Any) -> Tensor:
        if not checked():
            reason = loss_fn_refusal(loss_fn, outputs, row_dims)
            if reason:
                where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
                raise UserInputError(
                    f"loss_fn{where} {reason}: train_step computes it on each of the {pieces} pieces of the batch (dp={dp} ranks x "
                    f"{pieces // dp} microbatches) and averages them, which is not the whole batch's loss. Train with dp=1 and "
                    "num_microbatches=1 (schedule='gpipe' when pp > 1), return a mean over the rows, or compute the loss in "
                    "the model's forward (autotp then makes its sums and denominators the whole batch's)"
                )
            if code is not None:
                _CHECKED.add((code, row_dims))
            else:
                with contextlib.suppress(TypeError):  # an object no weak reference can hold is checked at every step
                    _CHECKED_OBJECTS.setdefault(loss_fn, set()).add(row_dims)
        return loss_fn(outputs)

    return loss_of


def returned_loss(outputs: Any) -> Tensor:
    """The loss the model returned in ``outputs`` (see the module docstring)."""
    try:
        loss = None if isinstance(outputs, Tensor) else outputs["loss"]
    except (KeyError, TypeError, IndexError):
        loss = None
    if isinstance(loss, Tensor):
        return loss
    leaves = torch.utils._pytree.tree_leaves(outputs)
    scalars = [t for t in leaves if isinstance(t, Tensor) and t.dim() == 0 and t.is_floating_point()]
    if len(scalars) == 1:
        warnings.warn(
            f"train_step trains on the only scalar tensor of the model's outputs ({type(outputs).__name__}) as its loss; "
            "if that is an auxiliary loss, pass the inputs forward computes its loss from, or loss_fn=", stacklevel=2)
        return scalars[0]
    raise UserInputError(
        f"the model's outputs ({type(outputs).__name__}) hold no 'loss' and {len(scalars)} scalar tensors, so the loss "
        "is ambiguous: pass the inputs forward computes its loss from (e.g. labels=), or "
        "loss_fn=lambda outputs: <the scalar loss> to train_step"
    )


def returned_logits(outputs: Any) -> Tensor | None:
    """The logits beside a returned loss: ``outputs["logits"]``, a bare tensor output, or
    the first tensor of more than 0 dims of a tuple; None where there are none."""
    if isinstance(outputs, Tensor):
        return outputs
    try:
        return outputs["logits"]
    except (KeyError, TypeError, IndexError):
        pass
    if isinstance(outputs, (tuple, list)):
        return next((t for t in outputs if isinstance(t, Tensor) and t.dim() > 0), None)
    return None
