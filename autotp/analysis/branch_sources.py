"""Which side of an ``if`` on a run-time value the trace can take, read from the function's
source (``ast``): a *skipping branch*, one of whose sides does nothing (``continue``, ``pass``,
no ``else``), and a *check* (``if cond: raise`` without ``else``, ``assert cond``), whose other
side only raises. ``trace_control_flow`` takes them while exporting."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from types import CodeType


def _idle(body: list[ast.stmt]) -> bool:
    return all(isinstance(s, (ast.Pass, ast.Continue)) for s in body)


def _continues(body: list[ast.stmt]) -> bool:
    return any(isinstance(s, ast.Continue) for s in body)


def _span(body: list[ast.stmt]) -> set[int]:
    return set(range(body[0].lineno, body[-1].end_lineno + 1)) if body else set()  # type: ignore[operator]


def _leaves(stmts: list[ast.stmt], kinds: tuple[type, ...]) -> bool:
    """Whether ``stmts`` hold a statement of ``kinds`` (not counting nested functions)."""
    todo: list[ast.AST] = list(stmts)
    while todo:
        node = todo.pop()
        if isinstance(node, kinds):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


_EXITS = (ast.Return, ast.Break, ast.Continue, ast.Yield, ast.YieldFrom)


def _working_side(node: ast.If, loop: ast.For | ast.While | None) -> tuple[bool, set[int]] | None:
    """(the side of ``node`` that works, the lines it runs) when the other side does nothing."""
    body_idle, else_idle = _idle(node.body), _idle(node.orelse)
    body_skips, else_skips = body_idle and _continues(node.body), else_idle and _continues(node.orelse)
    if body_idle and else_idle and body_skips == else_skips:
        return None  # the same either way, or nothing done on either side
    if body_idle and (not else_idle or body_skips):
        side, work, skips = False, node.orelse, body_skips
    elif else_idle:
        side, work, skips = True, node.body, else_skips
    else:
        return None
    if _leaves(work, _EXITS):  # the working side would leave what the other side goes on with
        return None
    span = _span(work)
    if skips:  # the working side goes on with the rest of the loop's iteration, the other skips it
        if loop is None:
            return None
        rest = [n for n in ast.walk(loop) if isinstance(n, ast.stmt) and n.lineno > node.end_lineno]  # type: ignore[operator]
        if _leaves(rest, (ast.Return, ast.Break, ast.Yield, ast.YieldFrom)):
            return None
        span |= set(range(node.end_lineno + 1, loop.end_lineno + 1))  # type: ignore[operator]
    return side, span


def _raises(node: ast.If) -> bool:
    return not node.orelse and bool(node.body) and all(isinstance(s, ast.Raise) for s in node.body)


@dataclass(frozen=True)
class Branch:
    side: bool  # the side that works
    negated: bool  # whether the test is negated by ``not``
    lines: frozenset[int]  # the file lines the working side runs
    check: str = ""  # for a check (``if cond: raise`` or ``assert cond``), what fails it


@functools.lru_cache(maxsize=256)
def skipping_branches(code: CodeType) -> dict[int, Branch]:
    """Per line of an ``if`` test in ``code`` whose one side does nothing, or of a check."""
    try:
        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return {}
    offset = start - 1
    found: dict[int, Branch] = {}

    def visit(node: ast.AST, loop: ast.For | ast.While | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.If, ast.Assert)):
                test, negated = child.test, False
                if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                    test, negated = test.operand, True
                branch = None
                if isinstance(test, (ast.BoolOp, ast.UnaryOp, ast.IfExp, ast.NamedExpr)):
                    pass
                elif isinstance(child, ast.Assert):
                    branch = Branch(True, negated, frozenset(), ast.unparse(child.msg) if child.msg else "AssertionError")
                elif _raises(child):
                    branch = Branch(False, negated, frozenset(), ast.unparse(child.body[0]))
                elif (working := _working_side(child, loop)) is not None:
                    branch = Branch(working[0], negated, frozenset(s + offset for s in working[1]))
                if branch is not None:
                    for line in range(child.test.lineno, child.test.end_lineno + 1):  # type: ignore[operator]
                        found[line + offset] = branch
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) or node is tree:
                visit(child, child if isinstance(child, (ast.For, ast.While)) else loop)

    visit(tree, None)
    return found
