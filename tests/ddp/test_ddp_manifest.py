"""Two gloo ranks agree on rank 0's episode set even when an episode appears in between."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from episerve_tools.launch import DaemonProcess
from tests.ddp.harness import Launch
from tests.support import ramp

pytestmark = pytest.mark.slow


def _listings(daemon: DaemonProcess) -> int:
    return sum("ListEpisodes" in line for line in daemon.lines)


def test_an_episode_added_between_ranks_changes_nothing(launch: Launch, tmp_path: Path) -> None:
    root = tmp_path / "root"
    ramp.write_ramp_dataset(root)
    out = tmp_path / "out"
    out.mkdir()
    with DaemonProcess(root, "--rescan-s", "0", "--log-level", "DEBUG",
                       unix=tmp_path / "d.sock") as daemon:
        for rank in (0, 1):
            launch.start("tests.ddp.manifest_worker", [daemon.target, str(out)], f"rank{rank}",
                         env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
        deadline = time.monotonic() + 60
        while _listings(daemon) < 1:  # rank 0 has listed; rank 1 has not started building
            assert time.monotonic() < deadline, launch.output()
            time.sleep(0.05)
        ramp.write_ramp_episode(root, "ep0000new", episode_no=9, total_frames=50)  # sorts first
        (out / "go").touch()
        assert launch.wait() == [0, 0], launch.output()
        assert _listings(daemon) == 3  # rank 0 once, rank 1 for its dataset and its own listing
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["len"] == r1["len"] == 37 + 100 + 101 + 257
    assert r0["digest"] == r1["digest"] and r0["hashes"] == r1["hashes"]
    assert "ep0000new" not in r1["hashes"]
    assert r0["locate"] == r1["locate"] and r0["locate"][2] == ["ep000a", 36]
    assert r0["read"] == r1["read"] == r0["locate"]
    # Listed on its own, rank 1 would have seen the new episode: every index shifted.
    own = r1["own_listing"]
    assert own["len"] == r1["len"] + 50 and own["locate"][0] == ["ep0000new", 0]
