"""A daemon measured from outside: its process's CPU, an ``episerve loadtest`` run against it,
and the read core in process (the planner the daemon would use)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import BATCH

from episerve_server.config import ServerConfig
from episerve_server.plan.planner import Planner
from episerve_server.wiring import build_read_core

CLIENTS = 16
EPISODES = 24


def loadtest(target: str, keymap: Path, seconds: float, transport: str,
             tmp: str) -> tuple[float, float]:
    """(samples in all, the loadtest process's CPU seconds)."""
    report, cpu = _loadtest(target, keymap, seconds, transport, tmp)
    return float(report["samples_per_s"]) * float(report["elapsed_s"]), cpu


def warm_loadtest(target: str, keymap: Path, seconds: float, transport: str, tmp: str,
                  daemon_pid: int, warmup_s: float = 1.0) -> tuple[float, float]:
    """(samples of the timed phase, the daemon's CPU in ms per 1,000 of them): the
    loadtest counts the daemon's CPU (``--daemon-pid``) over its timed phase only, after
    ``warmup_s`` of the same clients reading, so its start-up (listing the episodes, which
    rescans the root; the clients' connections and first segments) is left out."""
    report, _ = _loadtest(target, keymap, seconds, transport, tmp,
                          ("--warmup", str(warmup_s), "--daemon-pid", str(daemon_pid)))
    return (float(report["samples_per_s"]) * float(report["elapsed_s"]),
            float(report["daemon_cpu_ms_per_1k_samples"]))


def _loadtest(target: str, keymap: Path, seconds: float, transport: str, tmp: str,
              extra: tuple[str, ...] = ("--warmup", "0")) -> tuple[dict[str, Any], float]:
    out = f"{tmp}/lt.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "episerve_tools.cli", "loadtest", target, "--episodes",
         str(EPISODES), "-c", str(CLIENTS), "--batch", str(BATCH), "--duration", str(seconds),
         *extra, "--keymap", str(keymap), "--json", out, "--timeout-s", "120",
         "--quiet", "--transport", transport], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"loadtest exited with {proc.returncode}")
    report: dict[str, Any] = json.loads(Path(out).read_text())
    return report, usage.ru_utime + usage.ru_stime


def planner_for(root: str, cache_bytes: int, loop: asyncio.AbstractEventLoop) -> Planner:
    core = build_read_core(ServerConfig(root=root, cache_bytes=cache_bytes))
    loop.run_until_complete(core.catalog.scan())
    return core.planner
