"""The packages' own modules and the imports each file makes, for the import-rule tests
(``tests/unit/test_boundaries.py``, ``tests/unit/test_import_graph.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {
    "episerve_proto": REPO / "protos" / "episerve_proto",
    "episerve_server": REPO / "server" / "episerve_server",
    "episerve_client": REPO / "client" / "episerve_client",
    "episerve_tools": REPO / "tools" / "episerve_tools",
}


def modules() -> dict[str, Path]:
    found = {}
    for name, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            if "v1" in path.relative_to(root).parts:
                continue  # generated
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (lazy ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


#: Every hand-written module of the packages (the generated ``v1`` stubs left out).
MODULES = modules()
