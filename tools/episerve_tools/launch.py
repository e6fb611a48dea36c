"""Start a daemon as a child process and wait until it listens (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from episerve_client.errors import Unavailable

_LISTENING = re.compile(r"episerve listening on (\S+)")
_WORKER = re.compile(r"worker (\d+) \(pid (\d+)\) serving on (\S+)")


class DaemonProcess:
    """``with DaemonProcess(root, unix=path) as d: Client(d.target)``; SIGTERM on exit.

    ``workers`` is passed as ``--workers`` unless ``args`` name it: 1 by default, so that a
    test or benchmark measures one process whatever the machine's default would be.
    ``python`` is the interpreter that runs the daemon (default: this one); a client in
    another venv (LeRobot's) starts the daemon from the project's.
    """

    def __init__(self, root: str | Path, *args: str, unix: str | Path | None = None,
                 port: int = 0, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 120.0, log: IO[str] | None = None,
                 workers: int = 1, python: str | Path | None = None) -> None:
        cmd = [str(python or sys.executable), "-m", "episerve_tools.cli", "serve", str(root), *args]
        cmd += ["--unix", str(unix)] if unix else ["--port", str(port)]
        if not any(a == "--workers" or a.startswith("--workers=") for a in args):
            cmd += ["--workers", str(workers)]
        self.cmd = cmd
        self.lines: list[str] = []
        self._log = log
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self.target = self._wait_listening(start_timeout_s)

    def _wait_listening(self, timeout_s: float) -> str:
        found: list[str] = []
        ready = threading.Event()
        assert self.proc.stdout is not None
        stream = self.proc.stdout

        def pump() -> None:
            for line in stream:
                self.lines.append(line)
                if self._log is not None:
                    self._log.write(line)
                m = _LISTENING.search(line)
                if m and not found:
                    found.append(m.group(1))
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.05):
            if time.monotonic() > deadline:
                self.kill()
                raise Unavailable(f"the daemon did not start within {timeout_s:.0f}s: "
                                  f"{''.join(self.lines[-20:])}")
        if not found:
            self.proc.wait(5)
            self._release()
            raise Unavailable(f"the daemon exited with code {self.proc.returncode}: "
                              f"{''.join(self.lines[-20:])}")
        return found[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> dict[int, int]:
        """With ``--workers N``: each worker's latest pid, from the daemon's log."""
        out: dict[int, int] = {}
        for line in list(self.lines):
            m = _WORKER.search(line)
            if m:
                out[int(m.group(1))] = int(m.group(2))
        return out

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._release()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no drain, as when a node dies."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._release()

    def _release(self) -> None:
        self._pump.join(5)
        if self.proc.stdout is not None and not self._pump.is_alive():
            self.proc.stdout.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
