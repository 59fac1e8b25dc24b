"""Loops over a data-dependent index list, unrolled over the list's bound while tracing.

``for e in mask.nonzero(): body(e)`` runs ``body`` once per nonzero entry of ``mask``
(HF's eager MoE: ``for expert_idx in expert_hit``). The trip count is known only at run
time, so ``torch.export`` cannot trace the loop. The entries lie in ``mask``'s shape,
so ``unrolled_index_loops`` unrolls the loop over every index of that shape, in
row-major order (``nonzero``'s order). Each iteration gets its index as a constant and
runs under the predicate ``mask[index] != 0``.

An iteration whose predicate is false must change nothing. Its writes to tensors that
existed before it are masked by the predicate:
- accumulating writes (``index_add_``, ``index_put_(accumulate=True)``, ``scatter_add_``,
  ``add_``/``sub_``) add ``where(p, value, 0)``;
- ``__setitem__`` writes ``where(p, value, old)``;
- any other in-place op writes ``where(p, op(old), old)``.

With a false predicate each write is then an exact no-op.

What the unrolled loop could still get wrong is refused with an error naming the loop's
line:
- a tensor made in an iteration and read after that iteration (only in-place writes may
  carry results out);
- a ``break``;
- a loop none of whose iterations writes anything (e.g. ``[int(e) for e in hit]``, whose
  Python values would leave unmasked).

An iteration whose constant index is out of range for a tensor it indexes (``one_hot``
with a spare class, ``weights[e]`` for the spare ``e``) cannot run: the original raises
there if its predicate ever holds. The trace is taken again with that iteration replaced
by a run-time assertion that its predicate is false (``unreachable``, keyed by the loop's
line and the index, so one retry covers every layer running the same code).

A branch inside an iteration on a value known only at run time (``if rows.numel() == 0:
continue``) takes the side PyTorch's size-oblivious reasoning gives (a row count is at
least 2), under a run-time assertion that the branch goes that way whenever the
iteration's predicate holds; when it does not hold, the iteration's writes are masked
whichever side it took.

Python state the body changes (a counter in a plain ``int``) is not seen.
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_size_oblivious
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from autotp.ir.errors import UserInputError

# Unrolling a bound this large would multiply the graph; such a loop is left to export (which refuses it).
MAX_UNROLLED_ENTRIES = 1024

_NONZERO = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere}
_ACCUMULATING = {"add_": 1, "__iadd__": 1, "sub_": 1, "__isub__": 1, "index_add_": 3, "scatter_add_": 3}
_ORIGINAL_ITER = torch.Tensor.__iter__
_ORIGINAL_BOOL = torch.SymBool.__bool__


@dataclass
class _Iteration:
    loop: str
    index: tuple[int, ...]
    predicate: torch.Tensor
    made: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # tensor -> True
    writes: int = 0

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) was made in this iteration."""
        base = t._base if t._base is not None else t
        return base in self.made


@dataclass
class _Loop:
    where: str
    iterations: int = 0
    writes: int = 0
    broken: bool = False


def _caller_line() -> str:
    frame = sys._getframe(2)
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({line})"


def _inplace_flag(func: Callable, args: tuple, kwargs: dict) -> bool:
    """A ``torch.nn.functional`` call with ``inplace=True`` (``F.relu(x, True)`` included)."""
    if "inplace" in kwargs:
        return bool(kwargs["inplace"])
    if getattr(func, "__module__", "") != "torch.nn.functional":
        return False
    try:
        bound = inspect.signature(func).bind_partial(*args)
    except (TypeError, ValueError):
        return False
    return bool(bound.arguments.get("inplace", False))


def _written(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor ``func`` writes in place, if any."""
    if "out" in kwargs and isinstance(kwargs["out"], torch.Tensor):
        return kwargs["out"]
    name = getattr(func, "__name__", "")
    inplace = (name.endswith("_") and not name.startswith("__")) or name in {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}
    if (inplace or _inplace_flag(func, args, kwargs)) and args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


class _LoopWatch(TorchFunctionMode):
    """Tags ``nonzero`` results, masks the writes of unrolled iterations, refuses escapes."""

    def __init__(self, unreachable: frozenset[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        self.unreachable = unreachable  # (loop line, index) of iterations asserted not to run
        self.failed: tuple[str, tuple[int, ...]] | None = None  # the iteration that raised IndexError
        self.sources = WeakIdKeyDictionary()  # nonzero result -> (its input, coordinate or None)
        self.stack: list[_Iteration] = []
        self.ended = WeakIdKeyDictionary()  # tensor made in an ended iteration -> the loop's line
        self.loops: list[_Loop] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.where and len(args) + len(kwargs) == 1:
            return self._tagged(args[0], torch.where(*args, **kwargs), as_tuple=True)
        if func in _NONZERO:
            out = func(*args, **kwargs)
            return self._tagged(args[0], out, as_tuple=isinstance(out, tuple))
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        self._refuse_escapes(func, inputs)
        if self.stack:
            target = _written(func, args, kwargs)
            conditions = [it for it in self.stack if target is not None and not it.holds(target)]
            if conditions:
                for it in conditions:
                    it.writes += 1
                return self._masked_write(func, args, kwargs, target, conditions)
        try:
            out = func(*args, **kwargs)
        except IndexError:
            if self.stack:
                self.failed = (self.stack[-1].loop, self.stack[-1].index)
            raise
        if self.stack:
            self._record(out, inputs)
        return out

    def _tagged(self, source: Any, out: Any, as_tuple: bool) -> Any:
        if isinstance(source, torch.Tensor) and source.dim() > 0:
            if as_tuple:
                for k, coordinate in enumerate(out):
                    self.sources[coordinate] = (source, k)
            else:
                self.sources[out] = (source, None)
        return out

    def _record(self, out: Any, inputs: list[torch.Tensor]) -> None:
        seen = {id(x) for x in inputs}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            for it in self.stack:
                if t._base is None or it.holds(t._base):
                    it.made[t] = True

    def _refuse_escapes(self, func: Callable | str, inputs: list[torch.Tensor]) -> None:
        for t in inputs:
            loop = self.ended.get(t if t._base is None else t._base)
            if loop is not None:
                raise UserInputError(
                    f"the loop at {loop} iterates over a list of indices known only at run time (a nonzero/argwhere "
                    f"result); autotp unrolls such a loop over every index the list may hold, and the iterations not in "
                    f"the list must change nothing. A tensor computed in one of its iterations is read after that "
                    f"iteration ({getattr(func, '__name__', func)}), which the unrolled loop would compute for every "
                    f"index. Fix: carry results out of each iteration by in-place writes (out.index_add_(0, rows, y), "
                    f"out[rows] += y), or loop over range(n) with the index's rows."
                )

    def _masked_write(self, func: Callable, args: tuple, kwargs: dict, target: torch.Tensor, conditions: list[_Iteration]) -> Any:
        p = conditions[0].predicate
        for it in conditions[1:]:
            p = p & it.predicate
        name = getattr(func, "__name__", "")
        if name in _ACCUMULATING and len(args) > _ACCUMULATING[name] and "out" not in kwargs:
            k = _ACCUMULATING[name]
            return func(*args[:k], torch.where(p, args[k], 0), *args[k + 1 :], **kwargs)
        if name == "index_put_" and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
            return func(args[0], args[1], torch.where(p, args[2], 0), *args[3:], **kwargs)
        if name == "__setitem__":
            target[args[1]] = torch.where(p, args[2], target[args[1]])
            return None
        if "out" in kwargs:
            new = func(*args, **{k: v for k, v in kwargs.items() if k != "out"})
        else:
            new = func(target.clone(), *args[1:], **kwargs)
        target.copy_(torch.where(p, new, target))
        return target

    def assumed(self, condition: torch.SymBool, where: str) -> bool:
        """The side of a branch on ``condition`` (data-dependent) inside an iteration, asserted
        at run time for the iterations whose predicates hold."""
        with warnings.catch_warnings():  # its replacements (guard_or_false/true) do not reason size-obliviously
            warnings.simplefilter("ignore", FutureWarning)
            side = guard_size_oblivious(condition)
        live = self.stack[0].predicate
        for it in self.stack[1:]:
            live = live & it.predicate
        value = torch.scalar_tensor(torch.sym_ite(condition, 1, 0), dtype=torch.int64, device=live.device)
        torch._assert_async(~live | (value == int(side)), f"the branch at {where} inside the loop at {self.stack[-1].loop} went the other way than the trace took it ({side})")
        return side

    def unrolled(self, hit: torch.Tensor, source: torch.Tensor, coordinate: int | None, where: str) -> Iterator[torch.Tensor]:
        loop = _Loop(where)
        self.loops.append(loop)
        complete = False
        try:
            for index in itertools.product(*(range(n) for n in source.shape)):
                if (where, index) in self.unreachable:
                    torch._assert_async(source[index] == 0, f"the iteration for index {index} of the loop at {where} ran; it cannot (the trace found an index out of range in it)")
                    continue
                element = torch.tensor(index if coordinate is None else index[coordinate], dtype=hit.dtype, device=hit.device)
                iteration = _Iteration(where, index, source[index] != 0)
                iteration.made[element] = True
                self.stack.append(iteration)
                try:
                    yield element
                finally:
                    self.stack.remove(iteration)
                    loop.iterations += 1
                    loop.writes += iteration.writes
                    for t in iteration.made.keys():
                        self.ended[t] = where
            complete = True
        finally:
            loop.broken = not complete


def _unrollable(watch: _LoopWatch, t: torch.Tensor) -> tuple[torch.Tensor, int | None] | None:
    found = watch.sources.get(t)
    if found is None or t.dim() == 0 or isinstance(t.shape[0], int):
        return None
    source, _ = found
    if not all(isinstance(n, int) for n in source.shape) or source.numel() > MAX_UNROLLED_ENTRIES:
        return None
    return found


@contextmanager
def unrolled_index_loops(model: torch.nn.Module, unreachable: frozenset[tuple[str, tuple[int, ...]]] = frozenset()) -> Iterator[_LoopWatch]:
    """While tracing ``model``: loops over ``nonzero``/``argwhere``/one-argument ``where``
    results are unrolled as described in the module docstring, but for the ``unreachable``
    iterations; an output made in an iteration is refused. After the trace,
    ``refuse_broken_loops``; a failed trace with ``failed`` set is taken again with that
    iteration unreachable."""
    watch = _LoopWatch(unreachable)

    def check_outputs(module: torch.nn.Module, args: Any, output: Any) -> None:
        watch._refuse_escapes("the model's output", [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)])

    def iterate(self: torch.Tensor) -> Iterator[torch.Tensor]:
        found = _unrollable(watch, self)
        if found is None:
            return _ORIGINAL_ITER(self)
        return watch.unrolled(self, found[0], found[1], _caller_line())

    def branch(self: torch.SymBool) -> bool:
        try:
            return _ORIGINAL_BOOL(self)
        except GuardOnDataDependentSymNode:
            if not watch.stack:
                raise
            return watch.assumed(self, _caller_line())

    torch.Tensor.__iter__ = iterate  # type: ignore[method-assign]
    torch.SymBool.__bool__ = branch  # type: ignore[method-assign]
    hook = model.register_forward_hook(check_outputs)
    try:
        with watch:
            yield watch
    finally:
        hook.remove()
        torch.Tensor.__iter__ = _ORIGINAL_ITER  # type: ignore[method-assign]
        torch.SymBool.__bool__ = _ORIGINAL_BOOL  # type: ignore[method-assign]


def refuse_broken_loops(watch: _LoopWatch) -> None:
    """Raise ``UserInputError`` for an unrolled loop that was left by ``break`` or wrote nothing."""
    for loop in watch.loops:
        if loop.broken:
            raise UserInputError(
                f"the loop at {loop.where} iterates over a list of indices known only at run time (a nonzero/argwhere "
                f"result) and leaves it early (break); autotp unrolls such a loop over every index the list may hold and "
                f"cannot tell where the run would stop. Fix: loop over the whole list (skip an entry with continue)."
            )
        if loop.iterations and not loop.writes:
            raise UserInputError(
                f"the loop at {loop.where} iterates over a list of indices known only at run time (a nonzero/argwhere "
                f"result) and writes no tensor in place; autotp unrolls such a loop over every index the list may hold, "
                f"and values its iterations hand on as Python objects would hold every index. Fix: write each "
                f"iteration's result in place (out.index_add_(0, rows, y)), or use the indices as a tensor."
            )
