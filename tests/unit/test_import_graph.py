"""The import graph of the packages has no cycle.

Every import counts, at module level or inside a function (a function-local import that
dodges a cycle at import time is still a cycle of the design). An edge goes from a module to
the module it names: ``from a.b import c`` names ``a.b.c`` when that is a module, else
``a.b``. Importing a submodule does not count as importing its parent package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.imports import MODULES

#: No module is longer than this: a longer one holds more than one job, and is split.


def edges_of(path: Path, known: set[str]) -> set[str]:
    """Our modules that the file at ``path`` imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
            names = [n if n in known else node.module for n in names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules)
    return {mod: edges_of(path, known) - {mod} for mod, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_function_local_import_is_an_edge(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from pkg import other\n    import pkg.third\n")
    assert edges_of(path, {"pkg", "pkg.other", "pkg.third"}) == {"pkg.other", "pkg.third"}


def test_no_import_cycle() -> None:
    assert cycles(graph(MODULES)) == []

