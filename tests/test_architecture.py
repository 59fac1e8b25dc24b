"""The package structure that the "Reading the code" table of docs/architecture.md promises.

* Imports form one DAG of layers: ``ir`` <- ``analysis`` <- ``passes`` <- ``cost_model``
  <- ``compiler`` (and the leaf ``presets``) <- ``runtime`` <- ``api`` <- ``report`` <- ``cli``.
  A module may import its own layer and the layers before it, never a later one; imports
  inside functions count too, only ``if TYPE_CHECKING:`` blocks do not.
* One compile sequence: ``run_passes`` is called from ``autotp/compiler.py`` alone.
* No library module is over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> package it is installed as (pyproject.toml's package-dir).
FOLDERS = {"autotp": "autotp", "passes": "autotp.passes", "cost_model": "autotp.cost_model"}
LAYERS = [
    ("ir", ("autotp.ir",)),
    ("analysis", ("autotp.analysis",)),
    ("passes", ("autotp.passes",)),
    ("cost_model", ("autotp.cost_model",)),
    ("compiler", ("autotp.compiler", "autotp.presets")),
    ("runtime", ("autotp.runtime",)),
    ("api", ("autotp.api",)),
    ("report", ("autotp.report",)),
    ("cli", ("autotp.cli", "autotp.__main__", "autotp")),
]
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _layer(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} belongs to no layer; add it to LAYERS"
    return best


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported autotp module, line) for every import in ``path`` outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "autotp"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "autotp":
                continue
            for alias in node.names:  # ``from autotp.x import y`` may name a submodule y
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return found


def _import_graph() -> tuple[nx.DiGraph, dict[str, Path]]:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for target, line in _imports(path, module, set(modules)):
            if target != module:
                graph.add_edge(module, target, line=line)
    return graph, modules


def test_imports_follow_the_layer_dag() -> None:
    graph, modules = _import_graph()
    wrong = []
    for src, dst, data in graph.edges(data=True):
        if dst in modules and _layer(dst) > _layer(src):
            wrong.append(
                f"{modules[src].relative_to(ROOT)}:{data['line']}: {src} ({LAYERS[_layer(src)][0]}) imports "
                f"{dst} ({LAYERS[_layer(dst)][0]})"
            )
    assert not wrong, "imports against the layer DAG:\n" + "\n".join(sorted(wrong))


def test_module_imports_have_no_cycle() -> None:
    graph, _ = _import_graph()
    # Package __init__ files re-export their children; an edge child -> parent package
    # is Python's import machinery, not a design dependency.
    design = nx.DiGraph((a, b) for a, b in graph.edges if not a.startswith(b + "."))
    cycles = list(nx.simple_cycles(design))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_layer_rule_detects_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from autotp.api import parallelize\nimport autotp.runtime.launcher\n")
    found = _imports(bad, "autotp.ir.bad", {"autotp.api", "autotp.runtime.launcher"})
    assert [_layer(m) > _layer("autotp.ir.bad") for m, _ in found] == [True, True]


def test_run_passes_has_one_caller() -> None:
    callers = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == "run_passes":
                    callers.append(module)
    assert callers == ["autotp.compiler"]


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_no_module_over_the_line_limit(folder: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"
