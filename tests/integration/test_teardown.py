"""Processes that end with a live client, forked children, and DataLoaders dropped mid-epoch.

The stress runs go through ``tests/support/teardown.py`` in a process of their own, so that
this test process's gRPC never meets a fork, and its counts come back as JSON with what the
workers printed. The default run has one round per transport (fork), the slow tier a few
per start method; ``-m stress`` runs 200 per start method and transport (`make stress`;
``EPITEST_STRESS_ROUNDS`` sets another count).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client, channel
from episerve_tools.launch import DaemonProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: What an abort, a crash at exit or an unraisable error in a worker prints.
BAD_LINES = ("terminate called", "Aborted", "Exception ignored", "Segmentation fault",
             "is killed by signal")
#: What gRPC prints when it forks with a thread of its own still inside it: the child's
#: gRPC is then broken (a worker that dies at its first batch).
FORK_UNSAFE = "skipping fork() handlers"
QUICK_ROUNDS = {"spawn": 4, "forkserver": 10, "fork": 10}
#: Rounds per stress case: 200, or ``EPITEST_STRESS_ROUNDS`` (CI runs fewer and says so).
STRESS_ROUNDS = int(os.environ.get("EPITEST_STRESS_ROUNDS") or 200)


def _python(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout_s, cwd=REPO, check=False)


def test_a_process_exiting_with_a_live_client_closes_it_first(
        shared_daemons: dict[str, DaemonProcess]) -> None:
    # The hook registered first runs last: it sees what the client's own exit hook left.
    done = _python(f"""
        import atexit
        from episerve_client import Client
        client = Client({shared_daemons["unix"].target!r}, transport="grpc")
        atexit.register(lambda: print("channels at exit:", len(client._channels)))
        client.stats()
        assert len(client._channels) == 1
    """)
    assert done.returncode == 0, done.stderr
    assert "channels at exit: 0" in done.stdout
    assert not [line for line in done.stderr.splitlines() if line.startswith(BAD_LINES)]


def report_channels_at_exit(target: str, out: str) -> None:
    """A multiprocessing child's target: a client left open as its target returns."""
    import multiprocessing.util

    client = Client(target, transport="grpc")
    client.stats()

    def report() -> None:
        Path(out).write_text(str(len(client._channels)))

    multiprocessing.util.Finalize(None, report, exitpriority=1)  # after the client's own


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_a_multiprocessing_child_closes_its_clients_as_its_target_returns(
        context: str, shared_daemons: dict[str, DaemonProcess], tmp_path: Path) -> None:
    out = tmp_path / "left"
    done = _python(f"""
        import multiprocessing
        from tests.integration.test_teardown import report_channels_at_exit
        if __name__ == "__main__":
            ctx = multiprocessing.get_context({context!r})
            p = ctx.Process(target=report_channels_at_exit,
                            args=({shared_daemons["unix"].target!r}, {str(out)!r}))
            p.start()
            p.join(90)
            raise SystemExit(p.exitcode)
    """)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "0"


def test_a_forked_child_opens_its_own_channel_and_never_touches_the_parents(
        shared_daemons: dict[str, DaemonProcess]) -> None:
    target = shared_daemons["unix"].target
    with Client(target, transport="grpc") as client:
        client.stats()
        parent_channel = client._channels[target]
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return into pytest
            ok = False
            try:
                client.stats()
                ok = (client._channels[target] is not parent_channel
                      and any(c is parent_channel for c in channel._INHERITED))
            finally:
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if status[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on its first call")
        assert os.waitstatus_to_exitcode(status[1]) == 0
        assert client._channels[target] is parent_channel  # the parent's is still its own
        assert client.stats()["read_rpcs"] >= 0


def stress(target: str, context: str, rounds: int, *flags: str) -> dict[str, Any]:
    """Runs ``tests.support.teardown``; fails on any abort, hang or unraisable line."""
    cmd = [sys.executable, "-m", "tests.support.teardown", target, context, str(rounds),
           *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False,
                          timeout=60 + rounds * 30)
    assert done.returncode == 0, done.stderr[-3000:]
    counts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    bad = [line for line in done.stderr.splitlines() if line.lstrip().startswith(BAD_LINES)]
    assert not bad, bad[:5]
    assert FORK_UNSAFE not in done.stderr
    assert counts["hangs"] == counts["errors"] == 0, counts
    assert counts["bad_exits"] == [], counts
    assert counts["rounds"] == rounds
    return counts


#: The workers' transport: the local plane of the unix-socket daemon, or gRPC.
TRANSPORTS = ["auto", "grpc"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_loaders_dropped_mid_epoch_never_abort(
        context: str, transport: str, shared_daemons: dict[str, DaemonProcess]) -> None:
    stress(shared_daemons["unix"].target, context, QUICK_ROUNDS[context], "--camera",
           "--transport", transport)


@pytest.mark.smoke
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_loader_dropped_mid_epoch_per_transport(
        transport: str, shared_daemons: dict[str, DaemonProcess]) -> None:
    """The default run's teardown round: one forked loader per transport, dropped mid-epoch."""
    stress(shared_daemons["unix"].target, "fork", 1, "--camera", "--transport", transport)


@pytest.mark.slow
def test_fork_workers_after_the_main_process_used_grpc_never_hang(
        shared_daemons: dict[str, DaemonProcess]) -> None:
    """The workers read over gRPC too: what gRPC's fork handlers must make safe."""
    stress(shared_daemons["unix"].target, "fork", QUICK_ROUNDS["fork"], "--grpc-first",
           "--transport", "grpc")


#: Seconds a stress test may take: 200 spawn rounds take ~12 min here (each spawned worker
#: imports torch), over the default per-test timeout.
STRESS_TIMEOUT_S = 2400


@pytest.mark.stress
@pytest.mark.timeout(STRESS_TIMEOUT_S)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_200_teardowns_each(context: str, transport: str,
                            shared_daemons: dict[str, DaemonProcess]) -> None:
    stress(shared_daemons["unix"].target, context, STRESS_ROUNDS, "--camera",
           "--transport", transport)


@pytest.mark.stress
@pytest.mark.timeout(STRESS_TIMEOUT_S)
def test_200_fork_starts_after_grpc(shared_daemons: dict[str, DaemonProcess]) -> None:
    stress(shared_daemons["unix"].target, "fork", STRESS_ROUNDS, "--grpc-first",
           "--transport", "grpc")
