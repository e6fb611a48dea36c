"""``DaemonProcess`` started another way: through a wrapper command (``ip netns exec NS``),
or through a test module that wires a fault into the daemon (``tests.support.faultstore``).
The daemon itself is the real one; only how its process is started differs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from episerve_tools.launch import DaemonProcess

REPO = Path(__file__).resolve().parents[2]


class WrappedDaemon(DaemonProcess):
    """``[*prefix, python, -m, module, *module_args, serve, root, *args]``, then as
    ``DaemonProcess``: waits for its "listening" line, ``target`` is what it printed."""

    def __init__(self, root: str | Path, *args: str, prefix: Sequence[str] = (),
                 module: str = "episerve_tools.cli", module_args: Sequence[str] = (),
                 unix: str | Path | None = None, port: int = 0,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 120.0,
                 workers: int = 1) -> None:
        cmd = [*prefix, sys.executable, "-m", module, *module_args, "serve", str(root), *args]
        cmd += ["--unix", str(unix)] if unix else ["--port", str(port)]
        if not any(a == "--workers" or a.startswith("--workers=") for a in args):
            cmd += ["--workers", str(workers)]
        self.cmd = cmd
        self.lines: list[str] = []
        self._log = None
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            cwd=REPO, env={**os.environ, "PYTHONPATH": path, **(env or {})})
        self.target = self._wait_listening(start_timeout_s)


def fault_daemon(root: str | Path, control: str | Path, *args: str,
                 **kw: object) -> WrappedDaemon:
    """A daemon whose store is wrapped in ``FaultStore`` reading ``control``."""
    return WrappedDaemon(root, *args, module="tests.support.faultstore",
                         module_args=[str(control)], **kw)  # type: ignore[arg-type]
