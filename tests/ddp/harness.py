"""The DDP tests' machinery: two-rank launches on loopback, and the shared proof.

Ranks run as subprocesses (``python -m tests.ddp.<worker>``), each launch in its own
session, so a hung or failed run is cleaned up by killing exactly the process groups it
started. Gloo stays on loopback: MASTER_ADDR=127.0.0.1, a free port, GLOO_SOCKET_IFNAME=lo.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import pytest

from tests.ddp import common as c

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Launch:
    """Processes started in their own sessions; ``wait`` outlives their whole groups."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                    "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path,
                    "PYTHONUNBUFFERED": "1"}

    def start(self, module: str, args: Sequence[str], name: str,
              env: Mapping[str, str] | None = None) -> None:
        self.start_command(["-m", module, *args], name, env)

    def start_command(self, argv: Sequence[str], name: str,
                      env: Mapping[str, str] | None = None) -> None:
        """``python *argv`` (a script and its arguments, or ``-m module ...``)."""
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs.append(subprocess.Popen(
                [sys.executable, *argv], cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                start_new_session=True))

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        while time.monotonic() < deadline and any(self._alive(p.pid) for p in self.procs):
            time.sleep(0.1)  # children they launched (Lightning's rank 1, loader workers)
        self.kill()
        return [p.poll() for p in self.procs]

    @staticmethod
    def _alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        hung = [p.pid for p in self.procs if self._alive(p.pid)]
        for pgid in hung:  # the ranks log their stacks (see common.dump_stacks_on_sigusr1)
            os.killpg(pgid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)
        for p in self.procs:
            if self._alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            if p.poll() is None:
                p.wait(10)

    def output(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-4000:]}"
                         for f in sorted(self.logs.glob("*.log")))


def decoded(path: Path) -> tuple[int, Fraction]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return sum(1 for _ in container.decode(stream)), stream.average_rate


def requests(out: Path, rank: int) -> list[list[str]]:
    path = out / f"requests.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_video_run(out: Path, target: str) -> None:
    """The rank-0 video rule, proven: both ranks finished, rank 0 alone read and wrote the video."""
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    epochs = [str(e) for e in range(c.EPOCHS)]
    # The metric loader runs on both ranks, all-reduced: the same value everywhere.
    assert len(r0["metrics"]) == c.EPOCHS
    assert r0["metrics"] == pytest.approx(r1["metrics"], rel=1e-6)
    # The gate opened on rank 0 on video epochs only, and never on rank 1.
    assert r0["video_batches"] == {e: c.MAX_BATCHES * (int(e) in c.VIDEO_EPOCHS) for e in epochs}
    assert r1["video_batches"] == dict.fromkeys(epochs, 0)
    frames = c.MAX_BATCHES * c.VIDEO_BATCH
    for e in c.VIDEO_EPOCHS:  # in order, from the start: no distributed sampler got in
        assert r0["frames"][str(e)] == list(range(frames))
    # Exactly one complete mp4 per video epoch, no temp file, written by rank 0.
    names = sorted(f"{c.PINNED}_epoch{e:04d}.mp4" for e in c.VIDEO_EPOCHS)
    assert sorted(p.name for p in (out / "videos").iterdir()) == names
    assert sorted(Path(p).name for p in r0["written"]) == names
    assert r1["written"] == []
    for name in names:
        assert decoded(out / "videos" / name) == (frames, Fraction(c.PINNED_FPS))
    check_counters(r0["counters"], out, target)
    # Rank 0 started the video loader's (persistent) worker once; rank 1 never started one.
    assert workers(out, 0) == ["metric", "video"]
    assert workers(out, 1) == ["metric"]


def workers(out: Path, rank: int) -> list[str]:
    lines = (out / f"workers.rank{rank}.jsonl").read_text().splitlines()
    return sorted(json.loads(line)["loader"] for line in lines)


def check_counters(counters: list[dict[str, Any]], out: Path, target: str) -> None:
    """The daemon's per-episode counters: the pinned episode is read only on video passes."""
    by_label = {row.pop("label"): row for row in counters}
    video_rpcs = 0
    assert by_label["setup"]["read_rpcs"] == 0  # building a WindowDataset reads nothing
    assert by_label.get("sanity", by_label["setup"]) == by_label["setup"]
    previous = by_label["setup"]
    for e in range(c.EPOCHS):
        now = by_label[f"epoch {e}"]
        video = e in c.VIDEO_EPOCHS
        video_rpcs += c.MAX_BATCHES * video
        assert now["read_rpcs"] == video_rpcs, (e, by_label)
        fetched = now["chunks_fetched"] - previous["chunks_fetched"]
        assert fetched > 0 if video else fetched == 0, (e, by_label)
        previous = now
    final = c.pinned_counters(target, "end")
    assert final["read_rpcs"] == video_rpcs
    # Every rank recorded the episodes of each batch it read: rank 1 never asked for it.
    assert requests(out, 0).count([c.PINNED]) == video_rpcs
    assert all(c.PINNED not in batch for batch in requests(out, 1))
    assert len(requests(out, 1)) > 0
