"""Every numeric setting's declared bounds are what its users can take: at its highest
value the daemon starts and serves a Read over both transports (a value within the check
once overflowed a gRPC argument, a C ``ssize_t`` or a local-plane field later, as a
start-up traceback or a daemon whose every Read was INTERNAL); one past it is one line
naming the setting, exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from episerve_client import Client
from episerve_proto.local_plane import MAX_TOKEN_BYTES
from episerve_server.config import ServerConfig
from episerve_server.settings import MAX_SIZE, MAX_WHOLE, declared
from episerve_tools.launch import DaemonProcess

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
#: Not started at their highest: the process count, and a delay added to every store call.
SKIPPED = {"workers", "inject_latency_s"}


def _highest() -> dict[str, str]:
    """Each numeric setting's flag value at its upper bound (declared, or the kind's)."""
    out = {}
    for item in declared(ServerConfig):
        kind, high = item.spec.kind, item.spec.high
        if item.name in SKIPPED or kind not in ("whole", "size", "seconds"):
            continue
        if kind == "seconds":
            if high is not None:
                out[item.name] = repr(float(high))
            continue
        out[item.name] = str(int(high) if high is not None else
                             MAX_SIZE if kind == "size" else MAX_WHOLE)
    return out


@pytest.mark.parametrize(("name", "value"), sorted(_highest().items()))
def test_a_setting_at_its_highest_serves_and_one_past_it_is_refused(
        name: str, value: str, ramp_roots: dict[str, Path], tmp_path: Path) -> None:
    flag = "--" + name.replace("_", "-")
    with DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", flag, value,
                       unix=tmp_path / "d.sock", start_timeout_s=60) as d:
        for transport in ("local", "grpc"):
            with Client(d.target, transport=transport, timeout_s=30) as client:
                got = client.read(KEYPOINTS, [("ep003d", 5)])
                assert got.arrays["k"].shape == (1, 63), (name, transport)
    past = str(float(value) * 2) if "." in value else str(int(value) + 1)
    done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", "serve",
                           str(ramp_roots["sharded"]), flag, past],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, (name, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], (name, done.stderr[-2000:])


def test_a_token_longer_than_a_local_plane_frame_carries_is_refused_at_start(
        ramp_roots: dict[str, Path], tmp_path: Path) -> None:
    """The longest token works on the local plane; one byte more is refused at start (it
    passed the check, then the local plane refused every client's first frame)."""
    token = "t" * MAX_TOKEN_BYTES
    with DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", env={"EPISERVE_TOKEN": token},
                       unix=tmp_path / "t.sock") as d, \
            Client(d.target, token=token, plaintext_token_ok=True, transport="local") as client:
        assert client.read(KEYPOINTS, [("ep003d", 5)]).arrays["k"].shape == (1, 63)
    done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", "serve",
                           str(ramp_roots["sharded"])],
                          env={**os.environ, "EPISERVE_TOKEN": token + "t"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-1000:]
    assert done.stderr.count("\n") == 1, done.stderr[-1000:]
    assert f"token must be at most {MAX_TOKEN_BYTES} bytes" in done.stderr
