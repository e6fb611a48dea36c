"""Operator mistakes: ``episerve serve`` refuses each with one clear line on stderr and exit
code 2 (no traceback), never deletes a file that is not its socket, never steals a live
daemon's socket, reuses a stale one, and binds metrics to ``--metrics-host``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from episerve_client.errors import FrameOutOfRange
from episerve_server.config import ServerConfig
from tests.support import ramp
from tests.support.introspect import assert_standard_tools_answer

pytestmark = pytest.mark.slow

KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}


def serve(*args: str, env: dict[str, str] | None = None,
          timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EPISERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "episerve_tools.cli", "serve", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
        env={**environ, **(env or {})})


def assert_refused(run: subprocess.CompletedProcess[str], *needles: str) -> str:
    lines = run.stderr.splitlines()
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr and "listening" not in run.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def busy_port() -> Any:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


FLAG_CASES = [
    (["--token", ""], {}, ("--token", "empty", "authentication")),
    ([], {"EPISERVE_TOKEN": ""}, ("EPISERVE_TOKEN", "empty")),
    (["--allow", ""], {}, ("--allow", "empty", "filtering")),
    (["--port", "65536"], {}, ("port", "0..65535")),
    (["--metrics-port", "-1"], {}, ("metrics_port",)),
    (["--max-response-bytes", "0"], {}, ("max_response_bytes", ">= 1")),
    (["--max-response-bytes", "256MiB"], {}, ("max_response_bytes", "headroom")),
    (["--grace-s", "nan"], {}, ("grace_s", "finite")),
    (["--max-connection-age-s", "1e-6"], {}, ("max_connection_age_s", "1e-06", "0 (off)")),
    ([], {"EPISERVE_MAX_CONNECTION_IDLE_S": "0.01"}, ("max_connection_idle_s", "0.01")),
    (["--store-timeout-s", "-1"], {}, ("store_timeout_s",)),
    (["--port", "many"], {}, ("--port", "invalid int")),
]


@pytest.mark.parametrize(("args", "env", "needles"), FLAG_CASES,
                         ids=[" ".join(a) or str(e) for a, e, _ in FLAG_CASES])
def test_bad_settings_are_one_line_and_exit_2(args: list[str], env: dict[str, str],
                                              needles: tuple[str, ...],
                                              ramp_roots: dict[str, Path]) -> None:
    assert_refused(serve(str(ramp_roots["sharded"]), *args, env=env), *needles)


def test_startup_problems_are_one_line_and_exit_2(ramp_roots: dict[str, Path], tmp_path: Path,
                                                  busy_port: int) -> None:
    root = str(ramp_roots["sharded"])
    assert_refused(serve(root, "--port", str(busy_port)), f"--port {busy_port}",
                   "Address already in use")
    assert_refused(serve(root, "--port", "0", "--metrics-port", str(busy_port)),
                   "--metrics-port", "in use")
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate\n")
    assert_refused(serve(root, "--port", "0", "--tls-cert", str(not_pem), "--tls-key",
                         str(not_pem)), "--tls-cert", "not a PEM")
    assert_refused(serve(root, "--port", "0", "--tls-cert", str(tmp_path / "missing.pem"),
                         "--tls-key", str(not_pem)), "cannot read", "missing.pem")


def test_a_unix_path_that_is_a_file_is_refused_and_kept(ramp_roots: dict[str, Path],
                                                        tmp_path: Path) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    assert_refused(serve(str(ramp_roots["sharded"]), "--unix", str(victim)),
                   "not a socket", "notes.txt")
    assert victim.read_text() == "precious\n"


def test_a_live_daemons_socket_is_refused_and_a_stale_one_reused(
        ramp_roots: dict[str, Path], start_daemon: Any, tmp_path: Path) -> None:
    live = start_daemon(ramp_roots["sharded"], "--log-level", "WARNING", unix=True)
    path = live.target.removeprefix("unix://")
    assert_refused(serve(str(ramp_roots["sharded"]), "--unix", path), "another daemon")
    with Client(live.target) as c:  # the first one still serves on its socket
        assert c.read(KEYPOINTS, [("ep003d", 4)]).arrays["k"][0, 0] == \
            ramp.ramp_row(3, "left.obs_keypoints", 4)[0]
    stale = tmp_path / "stale.sock"
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))  # bound, never listening, closed: what a killed daemon leaves
    leftover.close()
    assert stale.is_socket()
    proc = subprocess.Popen([sys.executable, "-m", "episerve_tools.cli", "serve",
                             str(ramp_roots["sharded"]), "--unix", str(stale), "--rescan-s", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on unix://" in line, (line, proc.stderr.read() if proc.poll() else "")
        with Client(f"unix://{stale}") as c:
            assert c.read(KEYPOINTS, [("ep001b", 2)]).arrays["k"].shape == (1, 63)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_metrics_bind_to_the_metrics_host(ramp_roots: dict[str, Path], start_daemon: Any,
                                          busy_port: int) -> None:
    help_text = serve("--help").stdout
    assert "--metrics-host" in help_text and "127.0.0.1" in help_text
    assert ServerConfig().metrics_host == "127.0.0.1"
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    d = start_daemon(ramp_roots["sharded"], "--metrics-port", str(port), "--host", "0.0.0.0",
                     "--log-level", "WARNING")
    deadline = time.monotonic() + 10
    while not (listening := _listening(d.pid, port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listening == {"127.0.0.1"}  # not 0.0.0.0, although the gRPC port is


def _listening(pid: int, port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port`` in the process's namespace."""
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_json_logs_carry_every_rpc_field_and_standard_tools_get_answers(
        ramp_roots: dict[str, Path], start_daemon: Any) -> None:
    import json

    d = start_daemon(ramp_roots["sharded"], "--log-format", "json", "--log-level", "DEBUG",
                     unix=True)
    assert_standard_tools_answer(d.target)
    with Client(d.target, transport="grpc") as client:
        h = client.list_episodes().episodes[0].hash
        data = client.read(KEYPOINTS, [(h, 0), (h, 1), (h, 2)])
        assert len(data) == 3
    with Client(d.target, transport="local") as client:  # accounted the same way
        assert len(client.read(KEYPOINTS, [(h, 4), (h, 5)])) == 2
        with pytest.raises(FrameOutOfRange):
            client.read(KEYPOINTS, [(h, 10**6)])
    d.stop(timeout_s=15)
    records = [json.loads(line) for line in d.lines if line.startswith("{")]
    assert len(records) == len([line for line in d.lines if line.strip()]) - 1  # + "listening"
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert not [r for r in records if r["level"] in ("ERROR", "CRITICAL")], records
    read, local, bad = [r for r in records if r.get("method") == "/episerve.v1.EpiServe/Read"]
    assert read["code"] == "OK" and read["batch"] == 3 and read["peer"].startswith("unix")
    assert read["bytes_sent"] > 3 * 4 * 63 and read["duration_ms"] > 0
    assert f"batch=3 sent={read['bytes_sent']}B" in read["msg"]
    assert local["code"] == "OK" and local["batch"] == 2 and local["peer"].startswith("local:")
    assert local["bytes_sent"] > 2 * 4 * 63 and local["request_id"].startswith("local-")
    assert bad["code"] == "OUT_OF_RANGE" and bad["bytes_sent"] == 0
    [summary] = [r for r in records if "by_method" in r]  # written at the stop
    assert summary["level"] == "INFO"
    assert summary["by_method"]["Read"] == {"OK": 2, "OUT_OF_RANGE": 1}
    assert summary["samples"] == 6
    assert summary["bytes_sent"] >= read["bytes_sent"] + local["bytes_sent"]
