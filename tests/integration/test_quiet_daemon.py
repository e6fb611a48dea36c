"""A daemon that accepts and never answers (stopped with SIGSTOP, or wedged), and a local-plane
peer that sends half a frame and goes quiet: with ``max_outage_s`` the call ends with
``Unavailable`` that long after the last byte, on the local plane and over gRPC (sync and
async), with a WARNING naming the daemon; without it a WARNING says so within seconds and
the call waits on, and completes once the daemon runs again."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client, errors
from episerve_proto import local_plane as lp
from tests.support.daemons import SyncAsync

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
#: The calls' deadline: an outage must end them in a small part of it.
TIMEOUT_S = 60.0


@pytest.mark.parametrize("how", ["local", "grpc", "async"])
def test_a_stopped_daemon_ends_a_call_at_max_outage_s_with_a_warning(
        how: str, ramp_roots: dict[str, Path], start_daemon: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    options = {"timeout_s": TIMEOUT_S, "max_outage_s": 3}
    client: Any = SyncAsync(d.target, **options) if how == "async" else \
        Client(d.target, transport=how, **options)
    try:
        assert client.read(KEYPOINTS, [("ep003d", 5)]).arrays["k"].shape == (1, 63)
        os.kill(d.pid, signal.SIGSTOP)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(errors.Unavailable) as down:
            client.read(KEYPOINTS, [("ep003d", 6)])
        took = time.monotonic() - started
    finally:
        os.kill(d.pid, signal.SIGCONT)
        client.close()
    assert 3 <= took < TIMEOUT_S / 6, took  # about max_outage_s, not the 60 s deadline
    assert "max_outage_s=3" in str(down.value) and "stopped or wedged" in str(down.value)
    said = [r.getMessage() for r in caplog.records if d.target in r.getMessage()]
    assert said, caplog.text


def test_without_max_outage_s_a_stopped_daemon_is_said_and_the_call_waits_for_it(
        ramp_roots: dict[str, Path], start_daemon: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    d = start_daemon(ramp_roots["sharded"], unix=True)
    with Client(d.target, transport="local", timeout_s=TIMEOUT_S) as client:
        client.read(KEYPOINTS, [("ep003d", 5)])
        os.kill(d.pid, signal.SIGSTOP)
        resume = threading.Timer(6.0, os.kill, (d.pid, signal.SIGCONT))
        resume.start()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="episerve_client.local_channel"):
            got = client.read(KEYPOINTS, [("ep003d", 6)])
        took = time.monotonic() - started
        resume.join()
    assert got.arrays["k"].shape == (1, 63) and 6 <= took < TIMEOUT_S / 4, took
    [line] = [r.getMessage() for r in caplog.records if "stopped or wedged" in r.getMessage()]
    assert d.target in line and f"pid {d.pid}" in line, line
    said_at = next(r.created for r in caplog.records if "stopped or wedged" in r.getMessage())
    assert said_at - (time.time() - took) < 5, said_at  # within seconds of the stop


def _half_frame_daemon(path: Path, stop: threading.Event) -> threading.Thread:
    """A fake local plane: the first connection is welcomed, and its first call answered
    with half a frame head, then nothing; later connections (liveness probes) are accepted
    and never welcomed."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path) + lp.LOCAL_SUFFIX)
    server.listen(16)
    server.settimeout(0.2)
    held: list[socket.socket] = []

    def run() -> None:
        first = True
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)
            if first:
                first = False
                conn.recv(1 << 16)  # HELLO
                conn.sendall(lp.frame(lp.WELCOME, 4, lp.LEND.pack(1 << 20)))
                conn.recv(1 << 16)  # the CALL
                conn.sendall(lp.frame(lp.REPLY, 1, b"x" * 64)[:7])  # half a head
        for conn in held:
            conn.close()
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_half_a_frame_then_silence_ends_at_max_outage_s(tmp_path: Path) -> None:
    path = tmp_path / "fake.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(path))  # the daemon's own socket: there, and never used here
    stop = threading.Event()
    thread = _half_frame_daemon(path, stop)
    try:
        client = Client(f"unix://{path}", transport="local", timeout_s=TIMEOUT_S,
                        max_outage_s=2)
        client.answered.add(client.targets[0])  # as a dataset's worker: it answered before
        started = time.monotonic()
        with pytest.raises(errors.Unavailable) as down:
            client.list_episodes()
        took = time.monotonic() - started
        client.close()
    finally:
        stop.set()
        thread.join(5)
        unix.close()
    assert 2 <= took < TIMEOUT_S / 6, took
    assert "has sent nothing" in str(down.value) and "max_outage_s=2" in str(down.value)
