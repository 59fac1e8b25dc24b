"""Delayed scaling (``fp8="tensorwise-delayed"``, Transformer Engine's default): every FP8
operand's scale comes from the amaxes of earlier steps, so its cast need not wait for this
step's amax.

**State.** One float32 *amax history* per ``fp8_linear`` op, ``[length, 1 + 2n]`` for its n
weights (``ParallelPlan.fp8_amax_history`` rows): column 0 is x, columns 1..n the weights,
n+1..2n the output gradients; row 0 the latest step. ``passes/fp8_linear`` makes it a buffer
of the rank graph (``HISTORY_PREFIX``), which the op mutates in place, forward and backward.

**Scale** of an operand: ``fp8_max / max(window)``, the window being its column's rows (the
max over the last ``length`` steps), exactly as the dynamic recipe's scale of one amax
(``fp8.to_scale``). The cast clamps to ±fp8_max: a value past the window's amax saturates
instead of overflowing, and the next step's scale covers it.

**Update.** Each step records every operand's amax of this step, computed from the same
values its cast reads and max-reduced over the tp group where the dynamic recipe reduces it
(``fp8.group_amaxes``), into row 0, shifting older rows down (the oldest drops out). Nothing
reads it back on the host: the op traces through ``torch.compile`` and CUDA graphs, and under
inductor the producer, the cast and the amax become one pass over the producer's output.

**Seeding.** A column that has recorded nothing (zeros: a fresh history, or one a checkpoint
without FP8 left empty) gives no scale: there the operand scales from this step's amax, as
the dynamic recipe does, and that amax fills every row of the column. The choice is made on
the device, per column (``torch.where`` on the window's max), inside the compiled graph: the
first step runs compiled like every other, computes what ``tensorwise`` computes, and needs
no host sync; a column already filled (a checkpoint loaded, another signature ran first)
goes on delayed.

**Ownership.** The histories are named after each op's first weight (``history_name``): the
``ParallelModel`` holds them as buffers (``autotp.runtime.state.parameters``), shared by every
signature's graphs and saved with its ``state_dict`` (so checkpoints carry them).
"""

from __future__ import annotations

import torch
from torch import Tensor

HISTORY_PREFIX = "fp8_amax_history_"
"""Name prefix of the rank graph's amax-history buffers (one per ``fp8_linear`` op)."""
CUDA_GRAPHS_REFUSAL = (
    "fp8='tensorwise-delayed' with cuda_graphs=True is not supported: a captured region takes each amax "
    "history as a static input (a copy) and never writes its updates back, so every scale would stay the "
    "first step's; use compile=True without cuda_graphs, or fp8='tensorwise' with cuda_graphs=True")
"""Why delayed scaling is refused under CUDA graphs (``parallelize`` and a hand-made plan)."""
DEFAULT_LENGTH = 16
"""Steps in the window (Transformer Engine's ``amax_history_len`` default is 1024 with
``"max"``; torchao's delayed scaling used 16: a short window follows a shrinking gradient)."""


def history_name(first_weight: str) -> str:
    """The buffer name of the history of the op whose first weight is ``first_weight``."""
    return HISTORY_PREFIX + first_weight.replace(".", "_")


def history_columns(n_weights: int) -> int:
    """Columns of one op's history: x, each weight, each output gradient."""
    return 1 + 2 * n_weights


def new_history(length: int, n_weights: int, device: torch.device) -> Tensor:
    """An empty history (zeros: never recorded; the first step seeds it)."""
    return torch.zeros(length, history_columns(n_weights), dtype=torch.float32, device=device)


def window(history: Tensor, column: int) -> Tensor:
    """The largest amax recorded for ``column`` over the window, [1, 1]."""
    return history[:, column].amax().reshape(1, 1)


def scale_amax_then_record(history: Tensor, column: int, amax: Tensor) -> Tensor:
    """The amax the cast of ``column`` scales by: the window's, read before this step's ``amax``
    is pushed into row 0; an empty column (module docstring) takes ``amax`` itself, in every row."""
    used = window(history, column)
    now = amax.reshape(1).float()
    empty = used == 0
    used = torch.where(empty, now.reshape(1, 1), used)
    pushed = torch.where(empty.reshape(1), now.expand(history.shape[0]), torch.cat([now, history[:-1, column]]))
    history[:, column].copy_(pushed)
    return used


def scales_then_record(history: Tensor, columns: list[int], amaxes: list[Tensor]) -> list[Tensor]:
    return [scale_amax_then_record(history, c, a) for c, a in zip(columns, amaxes)]
