"""The package's modules import each other in one direction only: an ast walk of
variantgen/**/*.py collects every import (module level, function level, under TYPE_CHECKING,
relative ones resolved), and the graph must have no cycle - an import circle hidden behind a
function-level import or TYPE_CHECKING is one all the same."""

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


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    # the package's __init__ re-exports its surface (lazily); it is the root, not a link in a chain
    graph = {m: {t for t in deps if t != "variantgen"} for m, deps in graph.items()}
    assert cycles(graph) == [], "import cycles (modules that import each other, directly or through others)"


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
