"""Draws from Python's or NumPy's global random generator while a forward is traced.

A forward that calls ``random.random()`` or ``np.random.permutation`` (x-transformers' layer
dropout, BigBird's random attention blocks, wav2vec2's SpecAugment masks and phi-4-multimodal's
modality dropout, all in training mode) decides on the host what the traced graph cannot draw
again: the graph keeps what this one call drew, and every step of the parallel model would repeat
it. torch's own random ops are traced as ops and drawn anew at every call.

``host_random_states`` is compared around a trace; where a generator moved, the trace runs again
under ``host_calls``, a profiler that records each call into either generator with the model's
line that made it. A generator whose first call seeds it (BigBird seeds NumPy with its layer's
number before drawing) draws the same at every call, which the graph may keep; so do calls from
code generated at run time, which has no source file (beartype's type checks sample the containers
they check, deciding nothing the graph computes). Any other draw is refused
(``host_draw_refusal``), naming the line.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from autotp.analysis.trace_sizes import model_line
from autotp.ir.errors import UserInputError

_READS = frozenset({"getstate", "get_state", "__reduce__"})  # calls that leave the generator as it is
_SEEDS = frozenset({"seed", "setstate", "set_state"})  # calls after which it draws the same at every call


def _numpy_generator() -> Any:
    """NumPy's global ``RandomState`` where NumPy is loaded (a model that never imports it draws nothing from it)."""
    numpy = sys.modules.get("numpy")
    return numpy.random.mtrand._rand if numpy is not None else None


def _host_libraries() -> tuple[str, ...]:
    """random.py (``randrange``, ``shuffle``) and NumPy's folder, whose frames are not the model's."""
    numpy = sys.modules.get("numpy")
    return (os.path.realpath(random.__file__),) + ((os.path.dirname(os.path.realpath(numpy.__file__)) + os.sep,) if numpy is not None else ())


def host_random_states() -> tuple[Any, bytes]:
    """The states of Python's and NumPy's global random generators."""
    numpy = _numpy_generator()
    return random.getstate(), pickle.dumps(numpy.get_state()) if numpy is not None else b""


PYTHON, NUMPY = "Python's random module", "NumPy's global generator"


@dataclass(frozen=True)
class HostCall:
    generator: str  # PYTHON or NUMPY
    method: str
    where: str  # the model's line: file:line (source)


@contextmanager
def host_calls() -> Iterator[list[HostCall]]:
    """Record each call into the global generators made while inside, for the retrace only: Python's
    by a profiler (``sys.setprofile``: its methods are C functions, also where a module imported them by
    name), NumPy's by wrapping the functions of ``numpy.random`` (Cython methods, which no profiler sees)."""
    python = id(random._inst)  # type: ignore[attr-defined]
    calls: list[HostCall] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and id(getattr(arg, "__self__", None)) == python and (method := getattr(arg, "__name__", "?")) not in _READS:
            calls.append(HostCall(PYTHON, method, model_line(frame, _host_libraries())))

    def recorded(name: str, draw: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(HostCall(NUMPY, name, model_line(sys._getframe(1), _host_libraries())))
            return draw(*args, **kwargs)

        return call

    numpy_generator = _numpy_generator()
    modules = [sys.modules["numpy.random"], sys.modules["numpy.random.mtrand"]] if numpy_generator is not None else []
    saved = [(m, name, value) for m in modules for name, value in vars(m).items()  # its methods, and seed() and set_state(), functions of their own
             if (getattr(value, "__self__", None) is numpy_generator or name in _SEEDS) and name not in _READS]  # fmt: skip
    previous = sys.getprofile()
    for module, name, value in saved:
        setattr(module, name, recorded(name, value))
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)
        for module, name, value in saved:
            setattr(module, name, value)


def unseeded_draw(calls: list[HostCall]) -> HostCall | None:
    """The first call from a source file into a generator whose first such call does not seed it; None where each
    generator is seeded first (or only generated code drew)."""
    first: dict[str, str] = {}
    for call in calls:
        if call.where.startswith("<"):  # a wrapper generated at run time (beartype's), no model code
            continue
        first.setdefault(call.generator, call.method)
        if first[call.generator] not in _SEEDS:
            return call
    return None


def host_draw_refusal(model_name: str, call: HostCall | None) -> UserInputError:
    """The refusal of a forward whose ``call`` (None: not found again) drew from a host generator."""
    where = f"{call.generator} ({call.method}) at {call.where}" if call else "Python's or NumPy's global random generator"
    return UserInputError(
        f"{model_name}: the forward draws from {where} while it is traced. The traced graph would keep this one draw, so "
        "every step of the parallel model would repeat it (the same layer dropped, the same mask). Fix: draw with torch "
        "(torch.rand(()) < p, torch.randperm, torch.randint), which autotp traces as random ops drawn anew at each call, "
        "or trace the model in eval mode if that draw is for training only"
    )
