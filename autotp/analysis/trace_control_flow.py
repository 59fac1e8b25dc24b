"""Control flow on values known only at run time, traced as straight-line code whose writes
are masked by the condition the run will find.

``torch.export`` cannot trace a loop whose trip count, or a branch whose side, depends on
tensor values. Three common forms are traced here (``guarded_control_flow``).

**Loops over a data-dependent index list.** ``for e in mask.nonzero(): body(e)`` (HF's
eager experts: ``for expert_idx in expert_hit``; also ``argwhere`` and one-argument
``where``) runs ``body`` once per nonzero entry of ``mask``. The entries lie in ``mask``'s
shape, so the loop is unrolled over every index of that shape, in row-major order
(``nonzero``'s order). Each iteration gets its index as a constant and runs in a *scope*
whose predicate is ``mask[index] != 0``.

If a constant index is out of range for a tensor the iteration indexes (``one_hot`` with
a spare class, ``weights[e]`` for the spare ``e``), that iteration cannot run: the original
raises there whenever its predicate holds. The trace is taken again with that iteration
replaced by a run-time assertion that its predicate is false (``unreachable``, keyed by the
loop's line and the index, so one retry covers every layer running the same code).

**Branches that skip work.** This covers a branch on a run-time value one of whose sides
does nothing, its statements only ``continue`` or ``pass`` or no ``else``:
- ``if rows.numel() == 0: continue``;
- ``if counts[i] == 0: continue`` over ``bincount(...).tolist()``;
- ``if rows.numel(): body``;
- ``if mask.any(): body`` (a tensor's truth, taken from the tensor: no host read in the graph).

It is traced on the side that works, found from the source (``ast``) of the function taking
the branch. That side (the ``if``'s body or ``else``, plus the rest of the loop's iteration
after a ``continue``) runs in a scope whose predicate is the branch's condition evaluated at
run time. A test combining conditions (``and``/``or``) is not taken.

**Checks.** ``if cond: raise ...`` (no ``else``) and ``assert cond`` on a run-time value
(input validation: ``if (ids >= vocab).any(): raise``) are traced on the side that goes on,
with a run-time assertion (``torch._assert_async``) that the run takes it, whose message
names the line and the ``raise`` (or the assert's message).

**A scope's writes** to tensors made before it are masked by its predicate:
- accumulating writes (``index_add_``, ``index_put_(accumulate=True)``, ``scatter_add_``,
  ``add_``/``sub_``) add ``where(p, value, 0)``;
- ``__setitem__`` writes ``where(p, value, old)``;
- any other in-place op writes ``where(p, op(old), old)``.

Where the predicate is false, each write is then an exact no-op.

A branch's local name rebound in its working side to a tensor of the shape, dtype and device
it held before (``if special.any(): h = torch.where(special[..., None], embed, h)``), held by
local names only (not also put in a list the scope grows), is carried out: the new tensor is
written in place with ``where(p, new, before)`` as the branch ends.

What the masking cannot keep exact is refused, with an error naming the line:
- any other tensor made in a scope and read after it (only in-place writes and rebound names
  may carry results out);
- a ``break`` out of an unrolled loop;
- an unrolled loop none of whose iterations writes anything (its results would leave as
  Python values, e.g. ``[int(e) for e in hit]``).

Python state a scope changes (a counter in a plain ``int``) is not seen.

**Branches on buffers.** ``if self.initted: return`` (a codebook's k-means initialization
done once) or ``if self.freqs_cos[0, 0] == 0:`` (RoPE tables lost to a meta-device init) tests
the model's buffers, not the data: the trace takes the side the user's model's buffers give
(``buffer_branches``), and the graph asserts at run time that the test still comes out so,
naming the line.

**Value bounds.** ``bincount(x, minlength=m)`` has ``max(m, max(x) + 1)`` entries, a size
known only at run time. Where ``x`` holds indices into a dim of size at most ``m``
(``topk``/``sort``/``argmax`` indices, through views), it has exactly ``m``, and it is traced
as a ``scatter_add`` into ``m`` zeros.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import linecache
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from autotp.analysis.branch_sources import skipping_branches
from autotp.analysis.buffer_branches import constant_host_reads, value_from_buffers
from autotp.ir.errors import UserInputError

# Unrolling a bound this large would multiply the graph; such a loop is left to export (which refuses it).
MAX_UNROLLED_ENTRIES = 1024

_NONZERO = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere}
_ACCUMULATING = {"add_": 1, "__iadd__": 1, "sub_": 1, "__isub__": 1, "index_add_": 3, "scatter_add_": 3}
# Ops whose integer results index a dim of their input: name -> (the indices' position in the result, default dim)
_INDEX_RESULTS = {"topk": (1, -1), "sort": (1, -1), "argsort": (None, -1), "argmax": (None, None), "argmin": (None, None), "max": (1, None), "min": (1, None)}
# Ops that keep their input's values (so their bounds)
_VALUE_KEEPING = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "transpose", "permute", "contiguous", "clone", "__getitem__",
                  "long", "int", "to", "expand", "detach", "t"}  # fmt: skip
_ORIGINAL_ITER = torch.Tensor.__iter__
_ORIGINAL_BOOLS = {torch.SymBool: torch.SymBool.__bool__, torch.SymInt: torch.SymInt.__bool__}
_ORIGINAL_TENSOR_BOOL = torch._C.TensorBase.__bool__


@dataclass
class _Scope:
    """An unrolled iteration, or the working side of a skipping branch."""

    where: str  # the loop's or branch's source line
    predicate: torch.Tensor  # 0-d bool: whether the run takes this scope
    made: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # tensors made in it -> True
    writes: int = 0
    index: tuple[int, ...] = ()  # an iteration's index
    frame: FrameType | None = None  # a branch's frame ...
    lines: frozenset[int] = frozenset()  # ... and the lines of its working side
    bound_before: dict[str, torch.Tensor] = field(default_factory=dict)  # the frame's tensor locals as the branch was taken

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) was made in this scope."""
        base = t._base if t._base is not None else t
        return base in self.made

    def left(self) -> bool:
        """Whether a branch's scope was left: its frame is gone or runs another line."""
        if self.frame is None:
            return False
        f: FrameType | None = sys._getframe()
        while f is not None and f is not self.frame:
            f = f.f_back
        return f is None or f.f_lineno not in self.lines


@dataclass
class _Loop:
    where: str
    iterations: int = 0
    writes: int = 0
    broken: bool = False


def _named_only(t: torch.Tensor, names: dict[str, Any]) -> bool:
    """Whether no list, dict or set holds ``t`` but the frame's names (one the scope put it in
    would hold it only where the run takes the scope)."""
    return not any(isinstance(r, (list, dict, set)) and r is not names for r in gc.get_referrers(t))


def _line_of(frame: FrameType) -> str:
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


class _ControlFlowWatch(TorchFunctionMode):
    """Tags ``nonzero`` results and index bounds, masks the writes of scopes, refuses escapes."""

    def __init__(self, unreachable: frozenset[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        self.unreachable = unreachable  # (loop line, index) of iterations asserted not to run
        self.failed: tuple[str, tuple[int, ...]] | None = None  # the iteration that raised IndexError
        self.sources = WeakIdKeyDictionary()  # nonzero result -> (its input, coordinate or None)
        self.bounds = WeakIdKeyDictionary()  # integer tensor -> an exclusive bound of its values
        self.stack: list[_Scope] = []
        self.ended = WeakIdKeyDictionary()  # tensor made in an ended scope -> the scope's line
        self.loops: list[_Loop] = []
        self.buffers_read: set[str] = set()  # buffers whose values took a branch (``buffer_branches``)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():  # dynamo capturing a higher-order op's body (torch.cond): no scopes there
            return func(*args, **kwargs)
        self._close_left_branches()
        if func is torch.where and len(args) + len(kwargs) == 1:
            return self._tagged(args[0], torch.where(*args, **kwargs), as_tuple=True)
        if func in _NONZERO:
            out = func(*args, **kwargs)
            return self._tagged(args[0], out, as_tuple=isinstance(out, tuple))
        if func in (torch.bincount, torch.Tensor.bincount):
            counted = self._bounded_bincount(*args, **kwargs)
            if counted is not None:
                return counted
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        self._refuse_escapes(func, inputs)
        if self.stack:
            target = _written(func, args, kwargs)
            scopes = [s for s in self.stack if target is not None and not s.holds(target)]
            if scopes:
                for s in scopes:
                    s.writes += 1
                return self._masked_write(func, args, kwargs, target, scopes)
        try:
            out = func(*args, **kwargs)
        except IndexError:
            iterations = [s for s in self.stack if s.frame is None]
            if iterations:
                self.failed = (iterations[-1].where, iterations[-1].index)
            raise
        self._bound(func, args, kwargs, out)
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

    def _bound(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        name = getattr(func, "__name__", "")
        if name in _VALUE_KEEPING and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            bound = self.bounds.get(args[0])
            if bound is not None and not out.dtype.is_floating_point:
                self.bounds[out] = bound
        elif name in _INDEX_RESULTS and args and isinstance(args[0], torch.Tensor):
            position, default = _INDEX_RESULTS[name]
            at = 2 if name == "topk" else 1
            dim = kwargs.get("dim", args[at] if len(args) > at else default)
            if (dim is not None and not isinstance(dim, int)) or (position is not None) != isinstance(out, tuple):
                return  # max(x) without a dim returns the value, not an index
            indices = out if position is None else out[position]
            size = args[0].numel() if dim is None else args[0].shape[dim]
            if isinstance(indices, torch.Tensor) and isinstance(size, int):
                self.bounds[indices] = size

    def _bounded_bincount(self, x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor | None:
        bound = self.bounds.get(x)
        if weights is not None or bound is None or not minlength or bound > minlength or x.dim() != 1:
            return None
        return torch.zeros(minlength, dtype=torch.int64, device=x.device).scatter_add_(0, x.long(), torch.ones_like(x, dtype=torch.int64))

    def _record(self, out: Any, inputs: list[torch.Tensor]) -> None:
        seen = {id(x) for x in inputs}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            for s in self.stack:
                if t._base is None or s.holds(t._base):
                    s.made[t] = True

    def _end(self, scope: _Scope) -> None:
        self.stack.remove(scope)
        carried, views = self._carry_rebound(scope)
        for t in [*scope.made.keys(), *views]:
            if id(t) not in carried:
                self.ended[t] = scope.where
        scope.frame = None

    def _carry_rebound(self, scope: _Scope) -> tuple[set[int], list[torch.Tensor]]:
        """A branch's locals rebound to a tensor made in it, of the shape, dtype and device the
        name held before (``h = torch.where(special, embed, h)``): each is written in place with
        ``where(p, new, before)``, so the name reads what the run gives; their ids. Also the
        locals rebound to a view of a tensor made before the branch (``h = both[1]``), which
        cannot be written so. A name that held a tensor of a scope already ended (an earlier
        iteration's) is left as it was: reading that value is an escape of its own."""
        carried: set[int] = set()
        views: list[torch.Tensor] = []
        if scope.frame is None:
            return carried, views
        names = scope.frame.f_locals
        for name, new in names.items():
            before = scope.bound_before.get(name)
            if not isinstance(new, torch.Tensor) or before is None or new is before or self._ended_where(before) is not None:
                continue
            if new not in scope.made:
                if new._base is not None and not scope.holds(new):
                    views.append(new)
            elif new._base is None and (new.shape, new.dtype, new.device) == (before.shape, before.dtype, before.device) and _named_only(new, names):
                new.copy_(torch.where(scope.predicate.to(new.device), new, before))
                carried.add(id(new))
        return carried, views

    def _close_left_branches(self) -> None:
        for scope in [s for s in self.stack if s.left()]:
            self._end(scope)

    def _ended_where(self, t: torch.Tensor) -> str | None:
        """The line of the ended scope ``t`` (or the tensor it views) was made in, if any."""
        return self.ended.get(t) or (self.ended.get(t._base) if t._base is not None else None)

    def _refuse_escapes(self, func: Callable | str, inputs: list[torch.Tensor]) -> None:
        for t in inputs:
            where = self._ended_where(t)
            if where is not None:
                raise UserInputError(
                    f"autotp traces the code at {where}, whose trip count or branch depends on tensor values, once for "
                    f"every case, each case's writes masked by whether the run takes it; a tensor computed there is read "
                    f"after it ({getattr(func, '__name__', func)}), which would hold every case's value. Fix: carry results "
                    f"out by in-place writes (out.index_add_(0, rows, y), out[rows] += y), or loop over range(n)."
                )

    def _masked_write(self, func: Callable, args: tuple, kwargs: dict, target: torch.Tensor, scopes: list[_Scope]) -> Any:
        p = scopes[0].predicate
        for s in scopes[1:]:
            p = p & s.predicate
        p = p.to(target.device)
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

    def branch(self, value: torch.SymBool | torch.SymInt | torch.Tensor, frame: FrameType) -> bool:
        """The side a skipping branch or a check on ``value`` (known only at run time: a
        symbolic number, or a one-element tensor) is traced on."""
        found = skipping_branches(frame.f_code).get(frame.f_lineno)
        if found is None:
            raise LookupError
        taken = found.side != found.negated  # what bool(value) returns for the if to take the working side
        if isinstance(value, torch.Tensor):
            holds = (value.reshape(()) != 0) == taken
        else:
            truth = value if isinstance(value, torch.SymBool) else value != 0
            holds = torch.scalar_tensor(torch.sym_ite(truth, 1, 0), dtype=torch.int64) == int(taken)
        if found.check:
            torch._assert_async(holds, f"the check at {_line_of(frame)} failed: {found.check}")
        else:
            bound = {n: v for n, v in frame.f_locals.items() if isinstance(v, torch.Tensor)}
            self.stack.append(_Scope(_line_of(frame), holds, frame=frame, lines=found.lines, bound_before=bound))
        return taken

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
                iteration = _Scope(where, source[index] != 0, index=index)
                iteration.made[element] = True
                self.stack.append(iteration)
                try:
                    yield element
                finally:
                    for inner in self.stack[self.stack.index(iteration) + 1 :]:
                        self._end(inner)
                    self._end(iteration)
                    loop.iterations += 1
                    loop.writes += iteration.writes
            complete = True
        finally:
            loop.broken = not complete


def _unrollable(watch: _ControlFlowWatch, t: torch.Tensor) -> tuple[torch.Tensor, int | None] | None:
    found = watch.sources.get(t)
    if found is None or t.dim() == 0 or isinstance(t.shape[0], int):
        return None
    source, _ = found
    if not all(isinstance(n, int) for n in source.shape) or source.numel() > MAX_UNROLLED_ENTRIES:
        return None
    return found


@contextmanager
def guarded_control_flow(model: torch.nn.Module, unreachable: frozenset[tuple[str, tuple[int, ...]]] = frozenset(),
                         real_buffer: Callable[[str], torch.Tensor | None] = lambda name: None) -> Iterator[_ControlFlowWatch]:  # fmt: skip
    """While tracing ``model``: loops over ``nonzero``/``argwhere``/one-argument ``where``
    results are unrolled (but for the ``unreachable`` iterations) and skipping branches taken
    on their working side, as the module docstring says; an output made in a scope is
    refused; a branch on a buffer goes the way its value (``real_buffer(name)``) says. After
    the trace, ``refuse_broken_loops``; a failed trace with ``failed`` set is taken again with
    that iteration unreachable."""
    watch = _ControlFlowWatch(unreachable)

    def check_outputs(module: torch.nn.Module, args: Any, output: Any) -> None:
        watch._close_left_branches()
        watch._refuse_escapes("the model's output", [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)])

    def iterate(self: torch.Tensor) -> Iterator[torch.Tensor]:
        found = _unrollable(watch, self)
        if found is None:
            return _ORIGINAL_ITER(self)
        return watch.unrolled(self, found[0], found[1], _line_of(sys._getframe(1)))

    def guarded(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
        def branch(self: torch.SymBool | torch.SymInt) -> bool:
            try:
                return original(self)
            except GuardOnDataDependentSymNode:
                try:
                    return watch.branch(self, sys._getframe(1))
                except LookupError:
                    pass
                raise

        return branch

    torch.Tensor.__iter__ = iterate  # type: ignore[method-assign]
    for cls, original in _ORIGINAL_BOOLS.items():
        cls.__bool__ = guarded(original)  # type: ignore[method-assign]
    def tensor_branch(self: torch.Tensor) -> bool:
        # a tensor's truth is a host read (``item``) in the graph; on a branch's line take the
        # branch from the tensor itself, before export tries and records the read
        if not is_fake(self):
            return _ORIGINAL_TENSOR_BOOL(self)
        found = value_from_buffers(self, model, real_buffer) if self.numel() == 1 else None
        if found is not None:
            held, names = found[0].item(), f"buffers {', '.join(sorted(found[1]))}" if found[1] else "constants"
            watch.buffers_read |= found[1]
            torch._assert_async((self == held).all(), f"the branch at {_line_of(sys._getframe(1))} was traced with its test on "
                                f"{names} = {held}, which they no longer give; parallelize the model again")  # fmt: skip
            return bool(held)
        try:
            return watch.branch(self, sys._getframe(1))
        except LookupError:
            return _ORIGINAL_TENSOR_BOOL(self)

    torch.Tensor.__bool__ = tensor_branch  # type: ignore[method-assign]
    hook = model.register_forward_hook(check_outputs)
    try:
        with watch, constant_host_reads(model, real_buffer, watch.buffers_read, _line_of):
            yield watch
    finally:
        hook.remove()
        torch.Tensor.__iter__ = _ORIGINAL_ITER  # type: ignore[method-assign]
        for cls, original in _ORIGINAL_BOOLS.items():
            cls.__bool__ = original  # type: ignore[method-assign]
        del torch.Tensor.__bool__  # back to TensorBase's


def refuse_broken_loops(watch: _ControlFlowWatch) -> None:
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
