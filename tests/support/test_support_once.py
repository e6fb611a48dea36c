"""Test support is written once and never skipped: each shared constant of
``tests/support`` (the layouts, the keymaps) is defined in one module, and no test skips
because a keymap file or another reference document is missing."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHARED = ("LAYOUTS", "KEYMAPS", "DATASETS")


def module_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def definitions(folder: Path) -> Counter[str]:
    return Counter(name for path in sorted(folder.rglob("*.py"))
                   for name in module_constants(path) if name in SHARED)


def test_each_shared_constant_is_defined_once_in_tests_support() -> None:
    assert definitions(TESTS / "support") == Counter(SHARED)


def test_a_second_definition_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('LAYOUTS = ("sharded",)\nKEYMAPS = {}\nDATASETS = ()\n')
    (tmp_path / "b.py").write_text('LAYOUTS: tuple[str, ...] = ("v2",)\n')
    assert definitions(tmp_path)["LAYOUTS"] == 2


#: What a skip for a missing file says, or does before it skips.
MISSING = re.compile(r"keymap|absent|missing|not found|no .* files|\.exists\(|\.is_file\(|"
                     r"\.is_dir\(")


def skips_on_missing_files(source: str) -> list[int]:
    """Lines of ``pytest.skip`` / ``mark.skipif`` calls that skip because a file (a keymap,
    a reference document) is missing: their message says so, or the function around them
    looks for a file. Skips for the machine (root, namespaces, an optional package) pass."""
    tree = ast.parse(source)
    found: list[int] = []

    # The text of a node is taken only for a skip and the function around it: taking it for
    # every function made this a scan of the whole file per function.
    def visit(node: ast.AST, around: ast.AST | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            around = node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("skip", "skipif"):
            said = ast.get_source_segment(source, node) or ""
            where = "" if around is None else ast.get_source_segment(source, around) or ""
            if MISSING.search(said) or MISSING.search(where):
                found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, around)

    visit(tree, None)
    return found


def test_no_test_skips_because_a_file_is_missing() -> None:
    found = {str(path.relative_to(TESTS)): skips_on_missing_files(path.read_text())
             for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__)}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_a_skip_on_a_missing_keymap_is_found() -> None:
    source = ('def load(name):\n'
              '    directory = find_dir()\n'
              '    if directory is None:\n'
              '        pytest.skip("the shared keymaps are absent")\n'
              'def compare():\n'
              '    found = sum(p.exists() for p in PATHS)\n'
              '    if not found:\n'
              '        pytest.skip("nothing to compare with")\n'
              'def machine():\n'
              '    pytest.skip("needs root to run a client under another uid")\n')
    assert skips_on_missing_files(source) == [4, 8]
