"""The exactness harness: a short two-rank training epoch, once clean and once with a fault,
compared batch by batch, byte for byte, in order.

Each run starts two gloo ranks (``tests/support/exactness_rank.py``), each reading one
epoch through a DataLoader with ``Epoch.workers`` forked workers and ``WindowSampler``
batches of a fixed seed, over a keymap with numeric windows (history, horizon) and a camera
frame. Every batch's digest covers every column's dtype, shape and bytes. ``inject`` runs
in a thread of the caller once the ranks have trained ``at_step`` steps (a random point
unless given), and returns when its fault is over; the run then records the pause the
fault caused: the longest wait between two batches of a rank that ended after the fault
began. Used by ``tests/integration/test_exactness.py`` and ``benchmarks/chaos.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tests.support.keymaps import KEYMAPS, without_annotations

REPO = Path(__file__).resolve().parents[2]
#: The bundled mecka keymap without annotations: numeric windows and one camera frame.
KEYMAP = without_annotations(KEYMAPS["mecka_keypoints_k4"])
RANKS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Epoch:
    """What a run reads: the same for the clean and the faulted run."""

    batch: int = 8
    seed: int = 7
    epoch: int = 0
    workers: int = 4
    step_s: float = 0.12  # training time per step: the reads are paced by it
    read_timeout_s: float = 120.0
    collective_timeout_s: float = 120.0
    keymap: dict[str, Any] = field(default_factory=lambda: KEYMAP)


@dataclass(frozen=True, slots=True)
class Run:
    """Per rank: its batches (step, time, digest, samples) in order; errors; retries."""

    batches: tuple[tuple[dict[str, Any], ...], ...]
    errors: tuple[tuple[dict[str, Any], ...], ...]
    retries: int
    returncodes: tuple[int | None, ...]
    log: str
    fault_t: float | None = None
    fault_end_t: float | None = None

    @property
    def digests(self) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(b["digest"] for b in rank) for rank in self.batches)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def pause_s(self) -> float:
        """The longest wait between consecutive batches of a rank that ended after the
        fault began (0 without a fault)."""
        if self.fault_t is None:
            return 0.0
        gaps = [b["t"] - a["t"] for rank in self.batches for a, b in itertools.pairwise(rank)
                if b["t"] > self.fault_t]
        return max(gaps, default=0.0)


def differing(clean: Run, faulted: Run) -> list[tuple[int, int]]:
    """(rank, step) of every batch that differs from the clean run's, or is missing or extra."""
    return [(rank, step)
            for rank, (want, got) in enumerate(zip(clean.digests, faulted.digests, strict=True))
            for step in range(max(len(want), len(got)))
            if step >= len(want) or step >= len(got) or want[step] != got[step]]


def _lines(path: Path) -> tuple[dict[str, Any], ...]:
    if not path.exists():
        return ()
    return tuple(json.loads(line) for line in path.read_text().splitlines() if line.strip())


class Ranks:
    """Two rank processes, each in its own session (killed by process group)."""

    def __init__(self, target: str | Sequence[str], out: Path, epoch: Epoch,
                 prefix: Sequence[str] = ()) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        spec = {"target": target if isinstance(target, str) else list(target),
                "keymap": epoch.keymap, "batch": epoch.batch, "seed": epoch.seed,
                "epoch": epoch.epoch, "workers": epoch.workers, "step_s": epoch.step_s,
                "read_timeout_s": epoch.read_timeout_s,
                "collective_timeout_s": epoch.collective_timeout_s}
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
               "WORLD_SIZE": str(RANKS), "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(RANKS):
            with open(out / f"rank{rank}.log", "wb") as log:
                self.procs.append(subprocess.Popen(
                    [*prefix, sys.executable, "-m", "tests.support.exactness_rank", str(out),
                     json.dumps(spec)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    start_new_session=True))

    def steps(self) -> int:
        """Steps every rank has trained so far (the least of them)."""
        return min(len(_lines(self.out / f"batches.rank{r}.jsonl")) for r in range(RANKS))

    def wait(self, timeout_s: float) -> tuple[int | None, ...]:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill()
        return tuple(p.poll() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):  # the rank and its loader workers
                os.killpg(p.pid, signal.SIGKILL)
            if p.poll() is None:
                p.wait(10)

    def result(self, fault_t: float | None = None, fault_end_t: float | None = None) -> Run:
        out = self.out
        log = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                        for f in sorted(out.glob("rank*.log")))
        return Run(
            batches=tuple(_lines(out / f"batches.rank{r}.jsonl") for r in range(RANKS)),
            errors=tuple(_lines(out / f"errors.rank{r}.jsonl") for r in range(RANKS)),
            retries=sum(len(_lines(out / f"retries.rank{r}.jsonl")) for r in range(RANKS)),
            returncodes=tuple(p.poll() for p in self.procs), log=log, fault_t=fault_t,
            fault_end_t=fault_end_t)


def run_epoch(target: str | Sequence[str], out: Path, epoch: Epoch = Epoch(), *,
              inject: Callable[[], None] | None = None, at_step: int | None = None,
              rng: random.Random | None = None, prefix: Sequence[str] = (),
              timeout_s: float = 180.0) -> Run:
    """One epoch on two ranks; with ``inject``, the fault runs once the ranks have trained
    ``at_step`` steps (default: a random step in the first half of the epoch's 3rd..12th)."""
    ranks = Ranks(target, out, epoch, prefix)
    fault: dict[str, float] = {}
    failure: list[BaseException] = []
    try:
        if inject is not None:
            step = at_step if at_step is not None else (rng or random.Random()).randint(3, 12)
            deadline = time.monotonic() + timeout_s
            while ranks.steps() < step and time.monotonic() < deadline:
                if any(p.poll() is not None for p in ranks.procs):
                    break
                time.sleep(0.02)
            fault["t"] = time.time()

            def go() -> None:
                try:
                    inject()
                except BaseException as exc:  # reported by the caller's assertions
                    failure.append(exc)
                fault["end"] = time.time()

            thread = threading.Thread(target=go, daemon=True)
            thread.start()
            thread.join(timeout_s)
        codes = ranks.wait(timeout_s)
    finally:
        ranks.kill()
    if failure:
        raise failure[0]
    result = ranks.result(fault.get("t"), fault.get("end"))
    return replace(result, returncodes=codes)
