"""Random draws of the forward as one process draws them, when a step runs as pieces.

A forward that draws from the default generator (an MAE's masks, a VAE's noise, stochastic
units) draws, in one process, one tensor per draw for the whole batch, in the forward's order.
A pipeline stage draws from its own process's generator, and a piece of a split step (dp
ranks x microbatches) draws its own smaller tensor: other numbers than the unmodified model's.

``passes/batch_draws`` replaces each such draw of a pipelined or split graph by
``batch_draw(key, size, dtype, device)`` and keeps a ``DrawProgram`` per draw, in the forward's
order. Before a step (or a pipelined forward) the runtime makes every draw once at the whole
batch's size, in that order, on the default generator (``step_draws``): the generator is
then where one process's forward leaves it. Each piece's ``batch_draw`` takes its own rows of
that tensor (dim ``rows`` of the draw, the pieces in order; a draw without rows is the same
for every piece). Outside such a step the op draws by itself, as the draw it replaced.

A piece's draws are handed out in the order the piece's forwards run, per key; a recomputed
region takes the piece it took in its forward again (``recompute.RNG_STATE_HOOKS``). The op is
not captured by CUDA graphs (its value is chosen on the host, ``passes/find_cudagraph_candidates``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.library import Library

from autotp.ir import recompute
from autotp.ir.op_facts import draws_random

NAMESPACE = "autotp"

aten = torch.ops.aten
# the draws ``passes/batch_draws`` replays: by size; fills of a tensor whose values they ignore;
# draws whose kernels' formulas it writes out (so they do not read a piece's values)
BY_SIZE = frozenset({aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low})
FILLS = frozenset({
    aten.uniform_.default, aten.normal_.default, aten.exponential_.default, aten.cauchy_.default, aten.log_normal_.default,
    aten.geometric_.default, aten.random_.default, aten.random_.to, getattr(aten.random_, "from"), aten.bernoulli_.float,
    aten.uniform.default, aten.exponential.default, aten.bernoulli.p,
})  # fmt: skip
BY_FORMULA = frozenset({aten.bernoulli.default, aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor})
REPLAYED = BY_SIZE | FILLS | BY_FORMULA


def from_default_generator(node: Any) -> bool:
    """Whether an fx node draws from the default generator (dropout draws from the tp streams,
    ``passes/tp_dropout``)."""
    return draws_random(node) and node.target is not aten.dropout.default

_LIB = Library(NAMESPACE, "FRAGMENT")
_LIB.define("batch_draw(str key, SymInt[] size, ScalarType dtype, Device device) -> Tensor")
BATCH_DRAW = torch.ops.autotp.batch_draw.default


@dataclass(frozen=True)
class DrawProgram:
    """One draw of the forward: ``target(*args, **kwargs)`` with ``SIZE`` in ``args`` (or the
    tensor to fill, ``FILL``) standing for the drawn tensor's size; ``size``, ``dtype`` and
    ``device``: one piece's draw; ``rows``: the dim that holds the batch's rows (None: the draw
    has none, or the graph runs the batch whole)."""

    key: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    rows: int | None

    def draw(self, size: Sequence[int]) -> Tensor:
        """The draw at ``size`` (the program's dtype and device), from the default generator."""

        def place(a: Any) -> Any:
            if a is SIZE:
                return list(size)
            if a is FILL:
                return torch.empty(list(size), dtype=self.dtype, device=self.device)
            return a

        return self.target(*[place(a) for a in self.args], **self.kwargs)


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


SIZE, FILL = _Marker("SIZE"), _Marker("FILL")

_programs: dict[str, DrawProgram] = {}
_pieces: dict[str, list[Tensor]] = {}  # key -> this process's pieces of the step's draw, in order
_taken: dict[str, int] = {}  # key -> pieces handed out so far
_keys = itertools.count()


def register(name: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], like: Tensor, rows: int | None) -> DrawProgram:
    """A program with a key of its own (the op's kernel finds it by it), drawing like ``like``."""
    program = DrawProgram(f"{name}#{next(_keys)}", target, args, kwargs, tuple(like.shape), like.dtype, like.device, rows)
    _programs[program.key] = program
    return program


@torch.library.register_fake(BATCH_DRAW, lib=_LIB)
def _fake(key: str, size: Sequence[Any], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(list(size), dtype=dtype, device=device)


def _batch_draw(key: str, size: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    pieces = _pieces.get(key)
    if pieces is None:
        return _programs[key].draw(size)
    taken = _taken.get(key, 0)
    if taken >= len(pieces):
        raise RuntimeError(f"batch_draw '{key}': {taken + 1} forwards in a step of {len(pieces)} pieces on this process")
    _taken[key] = taken + 1
    return pieces[taken]


_LIB.impl("batch_draw", _batch_draw, "CompositeExplicitAutograd")


@contextmanager
def step_draws(programs: Sequence[DrawProgram], pieces: int, mine: Sequence[int]) -> Iterator[None]:
    """Inside, each program's ``batch_draw`` hands out this process's pieces ``mine`` (indices
    among ``pieces``, in the order its forwards run) of one draw at the whole batch's size.
    The draws are made here, in ``programs``' order."""
    for program in programs:
        whole = list(program.size)
        if program.rows is not None:
            whole[program.rows] *= pieces
        drawn = program.draw(whole)
        parts = drawn.chunk(pieces, program.rows) if program.rows is not None else [drawn] * pieces
        _pieces[program.key] = [parts[i] for i in mine]
        _taken[program.key] = 0
    try:
        yield
    finally:
        for program in programs:
            _pieces.pop(program.key, None)
            _taken.pop(program.key, None)


@contextmanager
def handed_out_again() -> Iterator[None]:
    """The pieces handed out inside are handed out again after it (a loss's denominator
    computed from a piece's draws before that piece's forward)."""
    taken = dict(_taken)
    try:
        yield
    finally:
        _taken.clear()
        _taken.update(taken)


def _pieces_taken() -> dict[str, int]:
    return dict(_taken)


def _restore_taken(taken: dict[str, int]) -> None:
    _taken.update(taken)


recompute.RNG_STATE_HOOKS.append((_pieces_taken, _restore_taken))
