"""A daemon killed with SIGKILL leaves its unix sockets behind with nothing listening on
them. A reader started afterwards is told so within seconds on every transport and call,
naming the path; a reader that was running when the daemon was restarted resumes in
seconds, and the daemon's log has no WARNING for the keymap the reader registers again."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from episerve_client import Client, errors
from episerve_client.data.collation import collate
from episerve_client.data.dataset import WindowDataset
from episerve_tools.launch import DaemonProcess
from tests.support.daemons import SyncAsync

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
#: The calls' deadline; a stale socket must be said in a small part of it, not at it.
TIMEOUT_S = 60.0


def _calls(target: str) -> dict[str, Callable[[], Any]]:
    """Every kind of call, on every transport, each from a new client."""
    def sync(transport: str, what: str) -> Callable[[], Any]:
        def call() -> Any:
            with Client(target, transport=transport, timeout_s=TIMEOUT_S) as c:
                if what == "list":
                    return c.list_episodes()
                if what == "read":
                    return c.read(KEYPOINTS, [("ep003d", 5)])
                return c.stats()
        return call

    def aio(transport: str) -> Callable[[], Any]:
        def call() -> Any:
            c = SyncAsync(target, timeout_s=TIMEOUT_S, transport=transport)
            try:
                return c.read(KEYPOINTS, [("ep003d", 5)])
            finally:
                c.close()
        return call

    calls = {f"{t}-{w}": sync(t, w) for t in ("auto", "local", "grpc")
             for w in ("list", "read", "stats")}
    calls |= {f"async-{t}-read": aio(t) for t in ("grpc", "auto", "local")}
    calls["dataset"] = lambda: WindowDataset(target, KEYPOINTS,
                                             client_options={"timeout_s": TIMEOUT_S})
    return calls


def test_a_killed_daemons_socket_is_said_within_seconds_on_every_transport_and_call(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    path = d.target.removeprefix("unix://")
    with Client(d.target) as c:  # it served
        assert c.read(KEYPOINTS, [("ep003d", 5)]).arrays["k"].shape == (1, 63)
    d.kill()
    assert os.path.exists(path) and os.path.exists(path + ".local")  # left behind
    for name, call in _calls(d.target).items():
        started = time.monotonic()
        with pytest.raises(errors.Unavailable) as down:
            call()
        took = time.monotonic() - started
        message = str(down.value)
        assert took < TIMEOUT_S / 10, (name, took, message)  # 3 s here, not the 60 s deadline
        assert path in message and "listens" in message, (name, message)
        assert "left from a daemon that stopped" in message, (name, message)


def test_a_restarted_daemon_costs_the_reader_seconds_and_logs_no_keymap_warning(
        ramp_roots: dict[str, Path], tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock)
    again: DaemonProcess | None = None
    try:
        dataset = WindowDataset(d.target, KEYPOINTS)  # the default deadline: 120 s
        loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate,
                            multiprocessing_context="spawn", shuffle=False)
        batches = iter(loader)
        for _ in range(4):
            assert next(batches)["k"].shape == (4, 63)
        d.kill()
        again = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock)
        ready = time.monotonic()
        for _ in range(4):  # both workers read again
            assert next(batches)["k"].shape == (4, 63)
        resumed_s = time.monotonic() - ready
        del batches
        # Not the 120 s deadline: a tenth of it at most (about 2 s here).
        assert resumed_s < 12, resumed_s
        log = "".join(again.lines)
        assert "registers it again" in log, log[-3000:]
        warnings = [ln for ln in again.lines if "WARNING" in ln]
        assert not warnings, warnings
    finally:
        d.stop(timeout_s=15)
        if again is not None:
            again.stop(timeout_s=15)
