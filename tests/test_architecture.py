"""The package structure that the "Reading the code" table of docs/architecture.md promises.

* Imports form one DAG of layers: ``ir`` <- ``analysis`` <- ``passes`` <- ``cost_model``
  <- ``compiler`` (and the leaf ``presets``) <- ``runtime`` <- ``api`` <- ``report`` <- ``cli``.
  A module may import its own layer and the layers before it, never a later one; imports
  inside functions count too, only ``if TYPE_CHECKING:`` blocks do not.
* One compile sequence: ``run_passes`` is called from ``autotp/compiler.py`` alone.
* No library module is over 500 lines.
* The runtime runs the compiler's graphs and never rewrites one: nothing under
  ``autotp/runtime/`` builds or edits an fx graph.
* No module reads another module's underscore members (autotp's own; torch's ``nn.Module``
  internals are torch's business).
* Every step of the compile sequence writes its file under ``autotp dump --dump-dir``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest
import torch

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
    bad.write_text("from autotp.api import parallelize\nimport autotp.runtime.processes.launcher\n")
    found = _imports(bad, "autotp.ir.bad", {"autotp.api", "autotp.runtime.processes.launcher"})
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


# Graph edits: a node made, erased, moved or rewired, or a graph built node by node.
GRAPH_EDITS = {"create_node", "erase_node", "inserting_before", "inserting_after", "replace_all_uses_with",
               "replace_input_with", "call_function", "call_module", "node_copy", "graph_copy", "placeholder"}


def _graph_edits(tree: ast.AST) -> list[tuple[str, int]]:
    return [(node.attr, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in GRAPH_EDITS]


def test_the_runtime_never_edits_a_graph() -> None:
    found = []
    for module, path in _modules().items():
        if module.startswith("autotp.runtime"):
            found += [f"{path.relative_to(ROOT)}:{line}: .{name}" for name, line in _graph_edits(ast.parse(path.read_text()))]
    assert not found, "graph rewrites belong in passes (autotp/passes), which the runner checks and dumps:\n" + "\n".join(found)


def test_graph_edit_rule_detects_one() -> None:
    tree = ast.parse("def f(g, n):\n    with g.inserting_before(n):\n        g.call_function(print, ())\n")
    assert sorted(name for name, _ in _graph_edits(tree)) == ["call_function", "inserting_before"]


TORCH_MODULE_MEMBERS = set(dir(torch.nn.Module)) | set(vars(torch.nn.Module()))


def _private_names(tree: ast.AST) -> set[str]:
    """The underscore names a module defines: functions, classes, module and class variables, ``self._x``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _foreign_private_reads(trees: dict[str, ast.AST]) -> list[str]:
    defined = {module: _private_names(tree) for module, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for module, names in defined.items():
        for name in names:
            owners.setdefault(name, set()).add(module)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autotp"):
                found += [f"{module}:{node.lineno}: imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            others = owners.get(node.attr, set()) - {module}
            if others and module not in owners[node.attr] and node.attr not in TORCH_MODULE_MEMBERS:
                found.append(f"{module}:{node.lineno}: reads .{node.attr} of {', '.join(sorted(others))}")
    return found


def test_no_module_reads_another_modules_underscore_members() -> None:
    trees = {module: ast.parse(path.read_text()) for module, path in _modules().items()}
    found = _foreign_private_reads(trees)
    assert not found, "use a public name (a property, a method, a plan field):\n" + "\n".join(found)


def test_private_read_rule_detects_one() -> None:
    trees = {
        "autotp.a": ast.parse("class A:\n    def __init__(self):\n        self._state = 1\n        self._parameters = {}\n"),
        "autotp.b": ast.parse("def f(a):\n    a._parameters.clear()\n    return a._state\n"),
        "autotp.c": ast.parse("from autotp.a import _helper\n"),
    }
    found = _foreign_private_reads(trees)
    assert len(found) == 2 and "reads ._state of autotp.a" in found[0] and "imports autotp.a._helper" in found[1], found


def test_every_compile_step_writes_its_dump(tmp_path: Path) -> None:
    import autotp
    from autotp.compiler import compile_steps

    model = autotp.presets.build_model("llama-tiny", device="meta")
    compiled = autotp.compile_rank(model, tp=2, pp=2, cuda_graphs=True, dump_dir=tmp_path)
    steps = [p.__name__ for p in compile_steps()]
    for name in ("extract_chunks", "split_cudagraph_regions", "insert_param_waits", "split_weight_grads"):
        assert name in steps
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["00_traced.py", *(f"{i:02d}_{name}.py" for i, name in enumerate(steps, start=1))]
    assert "# ---- chunk_1 ----" in (tmp_path / f"{steps.index('extract_chunks') + 1:02d}_extract_chunks.py").read_text()
    split = (tmp_path / f"{steps.index('split_cudagraph_regions') + 1:02d}_split_cudagraph_regions.py").read_text()
    assert "cudagraph_region_" in split and "# ---- chunk_0.cudagraph_split ----" in split
    deferred = (tmp_path / f"{steps.index('split_weight_grads') + 1:02d}_split_weight_grads.py").read_text()
    assert "deferred_linear" in deferred
    assert set(compiled.program.chunks) == {0, 1} and all(c.deferred is not None for c in compiled.program.chunks.values())
