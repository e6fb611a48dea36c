"""The layers' import rules, checked on the source and on what an import really loads.

- ``episerve_proto``'s hand-written modules import neither grpc nor protobuf;
- the daemon's ``core`` imports no zarr, grpc or protobuf; ``storage`` adds zarr; ``plan``
  builds on both; only ``rpc`` speaks gRPC, and inside it the handlers and the local plane
  do not (gRPC is one transport of the handlers, in ``rpc.grpc``, the local plane the
  other); nothing in the daemon imports torch;
- the client imports nothing of the daemon or the tools, and its client proper no torch;
- ``episerve_tools`` sits on top and may import everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.imports import MODULES, imports_of

# (module prefix, top-level imports it must never make)
RULES = [
    ("episerve_proto.errors", {"grpc", "google", "episerve_server", "episerve_client",
                               "episerve_tools"}),
    ("episerve_proto.contract", {"grpc", "google", "episerve_server", "episerve_client",
                                 "episerve_tools"}),
    ("episerve_server", {"torch", "episerve_client", "episerve_tools"}),
    ("episerve_server.core", {"zarr", "numcodecs", "grpc", "google", "grpc_health"}),
    ("episerve_server.storage", {"grpc", "google", "grpc_health"}),
    ("episerve_server.plan", {"grpc", "google", "grpc_health"}),
    ("episerve_server.rpc.handlers", {"grpc", "grpc_health"}),
    ("episerve_server.rpc.local_plane", {"grpc", "grpc_health"}),
    ("episerve_client", {"episerve_server", "episerve_tools", "zarr"}),
]
CLIENT_PROPER = ["_base", "_ops", "_probe", "_routes", "aio", "answer_wire", "channel", "client",
                 "messages", "errors", "keystats", "listing", "read_answer",
                 "tensors"]
# (module prefix, inner modules it must never import)
LAYERS = [
    ("episerve_server.core", ("episerve_server.storage", "episerve_server.plan",
                              "episerve_server.rpc", "episerve_server.wiring")),
    ("episerve_server.storage", ("episerve_server.plan", "episerve_server.rpc",
                                 "episerve_server.wiring")),
    ("episerve_server.plan", ("episerve_server.rpc", "episerve_server.wiring")),
    # Inside rpc, the codec <- the handlers <- the transports (gRPC, the local plane) <- the
    # process lifecycle; the handlers know no transport.
    ("episerve_server.rpc.wire", ("episerve_server.rpc.handlers", "episerve_server.rpc.grpc",
                                  "episerve_server.rpc.local_plane",
                                  "episerve_server.rpc.process")),
    ("episerve_server.rpc.handlers", ("episerve_server.rpc.grpc",
                                      "episerve_server.rpc.local_plane",
                                      "episerve_server.rpc.process")),
    # The two transports are peers: neither imports the other.
    ("episerve_server.rpc.grpc", ("episerve_server.rpc.local_plane",
                                  "episerve_server.rpc.process")),
    ("episerve_server.rpc.local_plane", ("episerve_server.rpc.grpc",
                                         "episerve_server.rpc.process")),
]




def test_the_walk_finds_every_layer() -> None:
    for prefix in ("episerve_server.core.keymap", "episerve_server.storage.readers.sharded",
                   "episerve_server.plan.planner", "episerve_server.rpc.handlers.service",
                   "episerve_client.data.dataset", "episerve_client.viz.gate",
                   "episerve_tools.synth.writer", "episerve_proto.errors"):
        assert prefix in MODULES


@pytest.mark.parametrize(("prefix", "banned"), RULES, ids=[r[0] for r in RULES])
def test_no_forbidden_imports(prefix: str, banned: set[str]) -> None:
    offenders = {
        mod: sorted(i for i in imports_of(path) if i.split(".")[0] in banned)
        for mod, path in MODULES.items() if mod == prefix or mod.startswith(prefix + ".")
    }
    assert not {m: i for m, i in offenders.items() if i}


@pytest.mark.parametrize(("prefix", "above"), LAYERS, ids=[r[0] for r in LAYERS])
def test_dependencies_point_down(prefix: str, above: tuple[str, ...]) -> None:
    offenders = {
        mod: sorted(i for i in imports_of(path) if i.startswith(above))
        for mod, path in MODULES.items() if mod.startswith(prefix + ".")
    }
    assert not {m: i for m, i in offenders.items() if i}


def test_the_client_proper_needs_no_torch() -> None:
    for name in CLIENT_PROPER:
        path = MODULES[f"episerve_client.{name}"]
        assert not {i for i in imports_of(path) if i.split(".")[0] == "torch"}, name


def loaded(*modules_: str) -> set[str]:
    """The top-level packages a fresh interpreter has loaded after importing ``modules_``."""
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules_)
            + "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120)
    return set(json.loads(out.stdout))


@pytest.mark.slow
def test_what_imports_really_load() -> None:
    core = [m for m in MODULES if m.startswith("episerve_server.core.")]
    assert not {"zarr", "grpc", "google", "torch"} & loaded(*core)
    below_rpc = [m for m in MODULES if m.startswith(("episerve_server.storage",
                                                     "episerve_server.plan"))]
    assert not {"grpc", "google", "torch"} & loaded(*below_rpc)
    daemon = loaded("episerve_server.rpc.process.main")
    assert "grpc" in daemon and "torch" not in daemon
    client = loaded(*(f"episerve_client.{n}" for n in CLIENT_PROPER), "episerve_client")
    assert not {"torch", "zarr", "episerve_server", "episerve_tools"} & client
    assert "episerve_server" not in loaded("episerve_client.data.dataset",
                                           "episerve_client.viz")
