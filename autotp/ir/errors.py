"""The error type of bad user input, and helpers that turn graph nodes into readable
locations for error messages."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.fx import Node


class UserInputError(ValueError):
    """Bad input from the user (arguments, files, data), with the fix in the message.

    The CLI prints it as one line and exits with code 2; any other exception is an
    internal error and keeps its traceback.
    """


def module_of(node: Node) -> str:
    """The dotted name and class of the innermost module that produced ``node``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "<top level>"
    path, cls = list(stack.values())[-1]
    cls_name = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return f"{path or '<root>'} ({cls_name})"


def source_line(node: Node) -> str:
    """The last ``File ..., line ...`` entry of the node's stack trace, or ''."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else ""


def describe(node: Node) -> str:
    """``node 'name' (target) in module 'path (Class)'`` plus the source line when known."""
    target = getattr(node.target, "__name__", str(node.target))
    where = f"node '{node.name}' ({target}) in module {module_of(node)}"
    line = source_line(node)
    return f"{where} [{line}]" if line else where
