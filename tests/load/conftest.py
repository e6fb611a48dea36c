"""Load and soak fixtures: a realistic dataset, the load generator run as the CLI, and
samples of a daemon's RSS and open file descriptors.

The dataset is ``data/bench`` when it is complete (200 episodes, written by the benchmarks);
otherwise a smaller realistic one is written to pytest's temp folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "data" / "bench"
BENCH_EPISODES = 200


def _complete(root: Path, episodes: int) -> bool:
    found = sorted(root.glob("*.zarr"))
    return len(found) >= episodes and all((p / "zarr.json").is_file() for p in found)


@pytest.fixture(scope="session")
def load_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _complete(BENCH, BENCH_EPISODES):
        return BENCH
    from episerve_tools.synth.writer import make_dataset

    root = tmp_path_factory.mktemp("load_data")
    make_dataset(root, episodes=64, min_frames=120, max_frames=300, progress=False)
    return root


@pytest.fixture(scope="session")
def loadtest() -> Callable[..., dict[str, Any]]:
    """``loadtest(target, *args, out=path)``: run ``episerve loadtest``; return its JSON."""

    def run(target: str, *args: str, out: Path, limit_s: float) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "episerve_tools.cli", "loadtest", target, *args,
               "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s,
                              check=False)
        print(proc.stdout)
        assert out.is_file(), proc.stdout + proc.stderr[-2000:]
        report: dict[str, Any] = json.loads(out.read_text())
        report["exit_code"] = proc.returncode
        return report

    return run


def proc_sample(pid: int) -> tuple[int, int]:
    """(resident set size in bytes, open file descriptors) of a live process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


@dataclass
class Sampler:
    """Samples a process every ``every_s`` from a thread, for at most ``limit_s``."""

    pid: int
    every_s: float
    limit_s: float
    extra: Callable[[], dict[str, Any]] = dict
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.t0 = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = self.t0 + self.limit_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> dict[str, Any]:
        extra = self.extra()  # first: a probe's connection is open before fds are counted
        rss, fds = proc_sample(self.pid)
        s = {"t": round(time.monotonic() - self.t0, 1), "rss": rss, "fds": fds,
             "loadavg": os.getloadavg()[0], **extra}
        self.samples.append(s)
        return s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


@pytest.fixture
def sampler() -> Iterator[Callable[..., Sampler]]:
    made: list[Sampler] = []

    def make(pid: int, every_s: float, limit_s: float, **kw: Any) -> Sampler:
        s = Sampler(pid, every_s, limit_s, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
