"""Tracing leaves the model's modules' global state as it found it.

The trace runs the model's code on a fake copy. What that code writes to the model's own
submodules lands on the copy, but a cache it keeps at module level (a memo of rotary tables
keyed by length and device, a dict of masks by size, an attribute of a global object) is the
process's: left as the trace wrote it, it would hand fake tensors to the unmodified model
afterwards, and to the next trace of another input signature, which would then read a fake
tensor of an earlier trace as a constant. ``global_state_restored`` snapshots the containers
reachable from the globals of the modules that define the model's classes (dicts, lists, the
attributes of objects and classes, ``MAX_DEPTH`` deep, at most ``MAX_CONTAINERS``) and undoes
what the trace wrote into them that holds a fake tensor: such an entry it added is removed, one
it replaced is put back.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

log = logging.getLogger(__name__)

MAX_DEPTH = 6
MAX_CONTAINERS = 20_000
MAX_ITEMS = 4096  # larger containers (a dataset in a script's globals) are not caches a forward fills
_OWN_PACKAGES = frozenset({"torch", "autotp"}) | frozenset(sys.stdlib_module_names)
_LEAVES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor, str, bytes, int, float,
           complex, bool, type(None))  # fmt: skip


@contextmanager
def global_state_restored(model: nn.Module) -> Iterator[None]:
    snapshots = _snapshots(_defining_modules(model))
    try:
        yield
    finally:
        undone = [where for where, container, before in snapshots if _restore(container, before)]
        if undone:
            log.info("removed the fake tensors tracing left in module-level state of the model's code: %s", ", ".join(undone[:5]))


def _defining_modules(model: nn.Module) -> list[types.ModuleType]:
    names = {type(m).__module__ for m in model.modules() if not _foreign(type(m))}
    modules = [sys.modules.get(n) for n in sorted(names)]
    return [m for m in modules if m is not None]


def _snapshots(modules: list[types.ModuleType]) -> list[tuple[str, Any, Any]]:
    """(where, container, a shallow copy of its contents) for each container reachable from the modules' globals."""
    out: list[tuple[str, Any, Any]] = []
    seen: set[int] = {id(m) for m in modules}
    frontier: list[tuple[str, Any]] = [(m.__name__, vars(m)) for m in modules]
    for _ in range(MAX_DEPTH):
        found: list[tuple[str, Any]] = []
        for where, obj in frontier:
            if len(out) >= MAX_CONTAINERS:
                return out
            for name, child in _children(where, obj, out):
                if id(child) not in seen and not isinstance(child, _LEAVES):
                    seen.add(id(child))
                    found.append((name, child))
        frontier = found
    return out


def _children(where: str, obj: Any, out: list[tuple[str, Any, Any]]) -> list[tuple[str, Any]]:
    """What ``obj`` holds, after recording a snapshot of it where it is a container the trace may write.
    Modules (nn) are not entered: the trace writes to the fake copy's."""
    if isinstance(obj, (dict, list, tuple, set, frozenset)) and len(obj) > MAX_ITEMS:
        return []
    if isinstance(obj, dict):  # read raw: a dict subclass's __getitem__ may compute (transformers' ACT2FN instantiates)
        out.append((where, obj, dict(dict.items(obj))))
        return [(f"{where}[{k!r}]", v) for k, v in list(dict.items(obj))]
    if isinstance(obj, list):
        out.append((where, obj, list.copy(obj)))
        return [(f"{where}[{i}]", v) for i, v in enumerate(list.copy(obj))]
    if isinstance(obj, (tuple, set, frozenset)):
        return [(where, v) for v in obj]
    if isinstance(obj, nn.Module) or _foreign(obj if isinstance(obj, type) else type(obj)):
        return []
    if isinstance(obj, type):
        out.append((where, obj, dict(vars(obj))))
        return [(f"{where}.{k}", v) for k, v in vars(obj).items()]
    attributes = _attributes(obj)
    return [(where, attributes)] if attributes else []


def _foreign(cls: type) -> bool:
    """A class of torch's, autotp's or the standard library's: not the model's code."""
    return (getattr(cls, "__module__", None) or "builtins").split(".")[0] in _OWN_PACKAGES


def _restore(container: Any, before: Any) -> bool:
    """Undo the changes to ``container`` since ``before`` was copied that put a fake tensor in it
    (other writes, a counter or a lazily filled registry, are the code's own); whether there were any."""
    if isinstance(container, list):
        now = list.copy(container)
        if (len(now) == len(before) and all(a is b for a, b in zip(now, before))) or not any(map(_holds_fake, now)):
            return False
        container[:] = before
        return True
    now = dict(vars(container)) if isinstance(container, type) else dict(dict.items(container))
    changed = [k for k in now if now[k] is not before.get(k, _MISSING) and _holds_fake(now[k])]
    for k in changed:
        if isinstance(container, type) and k in before:
            setattr(container, k, before[k])
        elif isinstance(container, type):
            delattr(container, k)
        elif k in before:
            container[k] = before[k]
        else:
            del container[k]
    return bool(changed)


def _holds_fake(value: Any, depth: int = 4) -> bool:
    """Whether ``value`` is, or holds within ``depth`` levels, a fake tensor (a module's parameters and buffers included)."""
    if isinstance(value, FakeTensor):
        return True
    if depth == 0 or isinstance(value, _LEAVES):
        return False
    if isinstance(value, nn.Module):
        return any(isinstance(t, FakeTensor) for t in (*value.parameters(), *value.buffers()))
    if isinstance(value, dict):
        items = list(dict.values(value))
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = list(_attributes(value).values())
    return any(_holds_fake(v, depth - 1) for v in items[:MAX_ITEMS])


def _attributes(obj: Any) -> dict[str, Any]:
    try:  # not through a class's __getattr__, which may compute (a lazy loader)
        attributes = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - an object without attributes of its own
        return {}
    return attributes if isinstance(attributes, dict) else {}


_MISSING = object()
