"""Where ``train_step`` finds the loss a model's forward returned itself.

Models compute their loss in ``forward`` from whichever keyword they take (``labels``,
``targets``, ``noise``...) and return it the way their code base does: under ``"loss"`` of a
dict or ``ModelOutput``, or as an element of a tuple (minGPT's ``(logits, loss)``). Without a
``loss_fn``, the loss is ``outputs["loss"]`` where the outputs have that key, else the only
0-dim floating tensor among them (a loss is a scalar; logits are not), with a warning (an
auxiliary loss returned alone would look the same). Anything else is
ambiguous and raises, naming what to pass. On a pipeline this runs on the last stage's outputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from autotp.ir.errors import UserInputError

LossFn = Callable[[Any], Tensor]


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
