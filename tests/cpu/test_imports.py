"""The package's modules import each other in one direction only: an ast walk of
variantgen/**/*.py collects every import (module level, function level, under TYPE_CHECKING,
relative ones resolved), and the graph must have no cycle - an import circle hidden behind a
function-level import or TYPE_CHECKING is one all the same.

The subpackages are layers along the pipeline (LAYERS, bottom first): a module imports only
from its own subpackage or from layers below it, never the package root (which re-exports the
public API and so imports the top layers) and never a subpackage's ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path

import variantgen

PACKAGE = Path(variantgen.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            # `from . import x` / `from .a import b`: a name may be a module of its own
            targets = [f"{root}.{a.name}" if f"{root}.{a.name}" in modules else root for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# The pipeline's layers, bottom first. testing/ (the harness of tests/ and bench/, not in the
# wheel) may import any layer; no product module may import it.
LAYERS = ("_version", "core", "abi", "lang", "routing", "codegen", "build", "planning", "wrappers", "api",
          "tools", "integrations")
HARNESS = "testing"
ENTRY_POINTS = {"variantgen", "variantgen.__main__"}  # the root's re-exports, `python -m variantgen`


def layer_of(module: str) -> str:
    return module.split(".")[1]


def test_the_package_has_no_import_cycle():
    # root edges count: a module importing the package root closes a circle through its re-exports
    assert cycles(import_graph()) == [], "import cycles (modules that import each other, directly or through others)"


def test_every_module_sits_in_a_layer():
    graph = import_graph()
    stray = [m for m in graph if m not in ENTRY_POINTS and layer_of(m) not in (*LAYERS, HARNESS)]
    assert stray == [], "modules outside the layers (add the subpackage to LAYERS where it belongs)"


def test_imports_point_down_the_layers():
    graph = import_graph()
    packages = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file()}
    wrong = []
    for source, targets in sorted(graph.items()):
        if source in ENTRY_POINTS:
            continue
        for target in sorted(targets):
            if target in packages:  # the root or a subpackage's __init__
                wrong.append(f"{source} -> {target} (import the module that defines the name)")
            elif layer_of(source) == HARNESS:
                continue
            elif layer_of(target) == HARNESS:
                wrong.append(f"{source} -> {target} (the harness is not part of the product)")
            elif LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source)):
                wrong.append(f"{source} -> {target} (up from {layer_of(source)} to {layer_of(target)})")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_the_walk_sees_function_level_and_type_checking_imports(tmp_path):
    """The checker itself: a circle through a function-level import and one behind TYPE_CHECKING."""
    pkg = tmp_path / "variantgen_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "c.py").write_text("from .a import f\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, pkg
    try:
        graph = import_graph()
    finally:
        PACKAGE = saved
    assert graph["variantgen_probe_pkg.a"] == {"variantgen_probe_pkg.b"}
    assert graph["variantgen_probe_pkg.b"] == {"variantgen_probe_pkg.a"}
    assert cycles(graph) == [["variantgen_probe_pkg.a", "variantgen_probe_pkg.b"]]
