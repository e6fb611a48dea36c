"""The contract is written once: the source of the daemon, the client and the tools names
the key types, the limits and the keymap messages through ``episerve_proto``, never as a
second copy of their values.

Read from the source (the AST, docstrings left out), so a copy is found whether or not a
test happens to run the code that holds it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from episerve_proto import contract

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("server/episerve_server", "client/episerve_client", "tools/episerve_tools")
#: The contract's strings that only it may spell: key types, trailers, the service, markers.
SPELLED_ONCE = frozenset({
    *contract.KEY_TYPES, contract.ERROR_TRAILER, contract.EPISODE_TRAILER,
    contract.KEY_TRAILER, contract.SERVICE_NAME, contract.SERVICE_PATH,
    contract.TOO_LARGE_ATTR, contract.TOO_LARGE_BYTES_ATTR})
#: gRPC options whose value is a contract limit.
MESSAGE_OPTIONS = frozenset({"grpc.max_send_message_length", "grpc.max_receive_message_length"})
#: Copies allowed to remain (none: a new one fails the test).
KNOWN_COPIES: frozenset[tuple[str, str]] = frozenset()
#: Message fragments shorter than this are words any message may use; between the daemon
#: and the client, phrasings up to the longer bound ("must be an integer >= 1, got") are
#: how any two checks of a number speak, not a copied message.
MIN_FRAGMENT = 16
MIN_SHARED_FRAGMENT = 30


def sources(*roots: str) -> Iterator[tuple[str, ast.Module]]:
    for root in roots:
        top = REPO / root
        for path in sorted(top.rglob("*.py")) if top.is_dir() else [top]:
            if not path.name.endswith("_pb2.py"):
                yield str(path.relative_to(REPO)), ast.parse(path.read_text())


def docstrings(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def attribute_names(tree: ast.Module) -> set[int]:
    """String constants that name an attribute (``object.__setattr__(self, "x", v)``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("__setattr__", "setattr", "getattr") and len(node.args) >= 2:
                out.add(id(node.args[-2] if name == "__setattr__" else node.args[1]))
    return out


def number(node: ast.expr) -> int | float | None:
    """The value of a constant arithmetic expression (``256 * 2**20``), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value: int | float = node.value  # type: ignore[assignment]
        return value
    if not isinstance(node, ast.BinOp):
        return None
    left, right = number(node.left), number(node.right)
    if left is None or right is None:
        return None
    if isinstance(node.op, ast.Mult):
        return left * right
    if isinstance(node.op, ast.Pow):
        return left**right
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.LShift):
        return int(left) << int(right)
    return None


def contract_names() -> set[str]:
    return {name for name in vars(contract) if name.isupper()}


def copies(path: str, tree: ast.Module) -> Iterator[str]:
    skip = docstrings(tree) | attribute_names(tree)
    names = contract_names()
    limits = {v for v in vars(contract).values() if type(v) is int}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in SPELLED_ONCE and id(node) not in skip:
            yield f"literal {node.value!r}"
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                yield f"{target.id} defined again"
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            key, value = node.elts
            if isinstance(key, ast.Constant) and key.value in MESSAGE_OPTIONS:
                got = number(value)
                if got is not None and got in limits:
                    yield f"{key.value} = {got}"


def found_copies(*roots: str) -> set[tuple[str, str]]:
    return {(path, what) for path, tree in sources(*roots) for what in copies(path, tree)}


def test_no_key_type_limit_or_trailer_is_written_outside_the_contract() -> None:
    assert found_copies(*PACKAGES) == KNOWN_COPIES


def test_the_scan_finds_each_kind_of_copy(tmp_path: Path) -> None:
    planted = ast.parse(
        'KEY_TYPES = ("camera_keys",)\n'
        'MAX_WINDOW = 4096\n'
        'def f(spec):\n'
        '    """Mentions \'camera_keys\' in a docstring only."""\n'
        '    object.__setattr__(spec, "annotation_keys", 1)\n'
        '    return spec.get("key_type") == "action_keys"\n'
        'OPTIONS = [("grpc.max_send_message_length", 256 * 2**20),\n'
        '           ("grpc.max_receive_message_length", 64 * 2**20)]\n')
    assert set(copies("planted.py", planted)) == {
        "KEY_TYPES defined again", "MAX_WINDOW defined again", "literal 'camera_keys'",
        "literal 'action_keys'", "grpc.max_send_message_length = 268435456"}


def message_fragments(*roots: str, shortest: int = MIN_FRAGMENT) -> dict[str, str]:
    """The literal parts of every message given to an exception (or a helper that makes
    one), at least ``shortest`` characters long, and where each is written."""
    out: dict[str, str] = {}
    for path, tree in sources(*roots):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if not (name[:1].isupper() or name in ("refuse", "bad")):
                continue
            for part in ast.walk(node.args[0]):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    text = part.value.strip()
                    if len(text) >= shortest:
                        out.setdefault(text, f"{path}:{part.lineno}")
    return out


def shared(one: dict[str, str], other: dict[str, str]) -> list[tuple[str, str, str]]:
    return sorted((text, where, there) for text, where in one.items()
                  for other_text, there in other.items()
                  if text in other_text or other_text in text)


def test_no_error_message_is_written_on_both_sides() -> None:
    daemon = message_fragments("server/episerve_server")
    client = message_fragments("client/episerve_client")
    assert shared(message_fragments("server/episerve_server", shortest=MIN_SHARED_FRAGMENT),
                  message_fragments("client/episerve_client", shortest=MIN_SHARED_FRAGMENT)) == []
    # The keymap's per-entry messages live in episerve_proto alone.
    keyspec = message_fragments("protos/episerve_proto/keyspec.py")
    assert "the spec must be a mapping, got" in " ".join(keyspec)
    assert shared(keyspec, daemon) == [] and shared(keyspec, client) == []


def test_a_message_written_twice_is_found() -> None:
    one = {": the spec must be a mapping, got": "a.py:1"}
    other = {"output key: the spec must be a mapping, got": "b.py:2"}
    assert shared(one, other) == [(": the spec must be a mapping, got", "a.py:1", "b.py:2")]
