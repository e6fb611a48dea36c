"""A supervisor for test daemons: restarts one that exits, as systemd's ``Restart=always``
or a Kubernetes kubelet would, on the same socket or port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from episerve_tools.launch import DaemonProcess


class Supervisor:
    """Keeps ``start()`` running: a daemon that exits is started again ``restart_s`` later.

    ``restarts`` holds (exit time, serving again time) per restart; ``close`` stops the
    watch and the current daemon.
    """

    def __init__(self, start: Callable[[], DaemonProcess], restart_s: float = 1.0) -> None:
        self._start, self.restart_s = start, restart_s
        self.daemon = start()
        self.target = self.daemon.target
        self.restarts: list[tuple[float, float]] = []
        self.failures: list[BaseException] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._closing.wait(0.05):
            with self._lock:
                daemon = self.daemon
            if daemon.proc.poll() is None:
                continue
            gone = time.time()
            daemon.kill()  # reaps it and its log pump
            if self._closing.wait(self.restart_s):
                return
            try:
                fresh = self._start()
            except BaseException as exc:  # the test sees it in ``failures``
                self.failures.append(exc)
                continue
            with self._lock:
                self.daemon = fresh
            self.restarts.append((gone, time.time()))

    def wait_restarts(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.restarts) < n and time.monotonic() < deadline and not self.failures:
            time.sleep(0.05)
        if self.failures:
            raise self.failures[0]
        if len(self.restarts) < n:
            raise TimeoutError(f"the daemon was restarted {len(self.restarts)} times, not {n}")

    def close(self) -> None:
        self._closing.set()
        self._thread.join(10)
        with self._lock:
            self.daemon.stop(timeout_s=15)
