"""Real daemons (child processes) on loopback TCP and unix sockets, and both clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from episerve_tools.launch import DaemonProcess
from tests.support.daemons import SyncAsync


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """``start_daemon(root, *flags, unix=False)``: a daemon stopped when the test ends."""
    started: list[DaemonProcess] = []

    def start(root: Path | str, *flags: str, unix: bool = False, **kw: Any) -> DaemonProcess:
        sock = tmp_path / f"d{len(started)}.sock" if unix else None
        d = DaemonProcess(root, "--rescan-s", "0", *flags, unix=sock, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(timeout_s=15)


@pytest.fixture(scope="session")
def shared_daemons(ramp_roots: dict[str, Path],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProcess]]:
    """One long-lived daemon per transport over the sharded ramp dataset, for read-only tests."""
    sock = tmp_path_factory.mktemp("sock") / "episerve.sock"
    daemons = {
        "tcp": DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0"),
        "unix": DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock),
    }
    yield daemons
    for d in daemons.values():
        d.stop(timeout_s=15)


@pytest.fixture(params=["sync", "async"])
def make_client(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Builds a ``Client`` or an ``AsyncClient`` (behind sync calls): one suite for both."""
    made: list[Any] = []

    def make(target: Any, **options: Any) -> Any:
        c = Client(target, **options) if request.param == "sync" else SyncAsync(target, **options)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
