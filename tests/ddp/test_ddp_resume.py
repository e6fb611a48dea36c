"""Kill a two-rank run mid-epoch, resume from its checkpoint on one rank and on two.

The checkpoint (sampler state and manifest) is the one the run wrote before it was killed
with SIGKILL, DataLoader workers and all. Over the killed run's steps up to the checkpoint
and the resumed run's, the epoch's indices are every index of the manifest exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from episerve_tools.launch import DaemonProcess
from tests.ddp.harness import Launch

pytestmark = pytest.mark.slow
KILL_AFTER_STEP = 9


def start(launch: Launch, target: str, out: Path, world: int, *extra: str) -> None:
    for rank in range(world):
        launch.start("tests.ddp.resume_worker", [target, str(out), *extra],
                     f"{out.name}.rank{rank}",
                     env={"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})


def steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(out.glob("steps.rank*.jsonl"))
            for line in f.read_text().splitlines()]


def kill_mid_epoch(launch: Launch, out: Path) -> dict[str, Any]:
    """Wait for a checkpoint at or past KILL_AFTER_STEP, then SIGKILL every process group."""
    ckpt = out / "ckpt.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if ckpt.exists() and json.loads(ckpt.read_text())["step"] >= KILL_AFTER_STEP:
            break
        assert all(p.poll() is None for p in launch.procs), launch.output()
        time.sleep(0.05)
    else:
        pytest.fail(f"no checkpoint at step {KILL_AFTER_STEP}:\n{launch.output()}")
    for p in launch.procs:
        os.killpg(p.pid, signal.SIGKILL)
    assert [p.wait(10) for p in launch.procs] == [-signal.SIGKILL] * len(launch.procs)
    assert not list(out.glob("rank*.json"))  # the run did not get to its end
    return json.loads(ckpt.read_text())  # type: ignore[no-any-return]


def test_resume_after_a_kill_on_one_and_two_ranks_sees_each_index_once(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    killed.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    first = Launch(logs)
    try:
        start(first, daemon.target, killed, 2)
        ckpt = kill_mid_epoch(first, killed)
    finally:
        first.kill()
    total, consumed = ckpt["sampler"]["total"], ckpt["sampler"]["consumed"]
    assert consumed == ckpt["step"] * 8 * 2 and 0 < consumed < total
    before = [g for s in steps(killed) if s["step"] <= ckpt["step"] for g in s["indices"]]
    # Steps after the checkpoint may have been logged before the kill: they are redone.
    assert len(before) == consumed
    saved = shutil.copy(killed / "ckpt.json", tmp_path / "saved.json")
    for world in (1, 2):
        resumed = tmp_path / f"resumed{world}"
        resumed.mkdir()
        second = Launch(logs)
        try:
            start(second, daemon.target, resumed, world, "--resume", str(saved))
            assert second.wait(400.0) == [0] * world, second.output()
        finally:
            second.kill()
        after = [g for s in steps(resumed) for g in s["indices"]]
        assert all(s["resumed"] for s in steps(resumed))
        assert len(before) + len(after) == total, world
        assert sorted(before + after) == list(range(total)), world
        results = [json.loads((resumed / f"rank{r}.json").read_text()) for r in range(world)]
        assert [r["steps"] for r in results] == [-(-(total - consumed) // (8 * world))] * world
