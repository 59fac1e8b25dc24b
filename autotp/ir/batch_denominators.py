"""A loss's denominators over the whole batch, when ``train_step`` splits the batch.

``train_step`` runs the global batch as pieces (dp ranks x microbatches) and averages their
losses and gradients. That is the whole batch's loss only where each piece's loss is
normalized the way the whole batch's is. A mean over the tokens whose label is not
``ignore_index`` (``cross_entropy``'s default), a class-weighted mean, or a sum divided by
``mask.sum()`` divide each piece by its own count, so pieces with fewer counted tokens weigh
more than they do in the whole batch: a padded batch trains another function.

The trace of a split step's graphs (``autotp.analysis.loss_denominators``) rescales such a
piece's ``n / d`` by ``d / batch_denominator(d, key)`` and keeps a ``DenominatorProgram`` that
computes ``d`` from a piece's inputs alone. Outside a step the op is ``d``. In a split step
``train_step`` first evaluates every program on each piece (``whole_batch_values``) and sets
the op (``whole_batch``) to the denominator that gives the whole batch's loss once the pieces
are averaged:

* the program's *core* is a sum (or a mean) over the batch rows; the whole batch's core is
  the pieces' sum (or their mean), summed over the dp group;
* the ops between the core and ``d`` (``clamp(min=1)``, a cast) run on that whole core;
* a numerator summed over rows is ``pieces`` times smaller per piece than the whole
  batch's, so its denominator is divided by ``pieces``; a numerator that is a mean is not.

The op is not captured by CUDA graphs (its value is set on the host each step,
``passes/find_cudagraph_candidates``); it has no gradient (a denominator reads no parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule
from torch.library import Library

NAMESPACE = "autotp"
SUM, MEAN = "sum", "mean"

_LIB = Library(NAMESPACE, "FRAGMENT")
_LIB.define("batch_denominator(Tensor d, str key) -> Tensor")
BATCH_DENOMINATOR = torch.ops.autotp.batch_denominator.default

_whole: dict[str, Tensor] = {}


def _dtype(d: Tensor) -> torch.dtype:
    return d.dtype if d.is_floating_point() else torch.get_default_dtype()


@torch.library.register_fake(BATCH_DENOMINATOR, lib=_LIB)
def _fake(d: Tensor, key: str) -> Tensor:
    return d.new_empty(d.shape, dtype=_dtype(d))


def _batch_denominator(d: Tensor, key: str) -> Tensor:
    whole = _whole.get(key)
    return (d if whole is None else whole).to(device=d.device, dtype=_dtype(d), copy=True)


_LIB.impl("batch_denominator", _batch_denominator, "CompositeExplicitAutograd")


@dataclass(frozen=True)
class DenominatorProgram:
    """How ``train_step`` computes the whole batch's value of one ``batch_denominator``:
    ``core(**piece inputs)`` per piece, combined by ``combine`` (``SUM`` or ``MEAN``) over the
    pieces, ``post(whole core)``, divided by the number of pieces where ``per_piece``."""

    key: str
    core: GraphModule
    combine: str
    post: GraphModule
    per_piece: bool


def whole_batch_values(programs: Sequence[DenominatorProgram], pieces: Sequence[dict[str, Any]], count: int,
                       all_reduce: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:  # fmt: skip
    """Each program's denominator for a step of ``count`` pieces, of which this process runs
    ``pieces`` (their inputs); ``all_reduce`` sums a tensor over the processes that run the
    other pieces (the dp group)."""
    values = {}
    for program in programs:
        total = all_reduce(sum(program.core(**piece).double() for piece in pieces))
        core = total / count if program.combine == MEAN else total
        d = program.post(core)
        values[program.key] = d / count if program.per_piece else d
    return values


@contextmanager
def whole_batch(values: dict[str, Tensor]) -> Iterator[None]:
    """Every ``batch_denominator`` of ``values``' keys is its whole-batch value inside."""
    _whole.update(values)
    try:
        yield
    finally:
        for key in values:
            _whole.pop(key, None)
