"""Plain torch DDP, two gloo processes with DataLoader workers, a real daemon: the rank-0
video gate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from episerve_tools.launch import DaemonProcess
from tests.ddp.harness import Launch

pytestmark = pytest.mark.slow


def test_video_on_rank_zero_only_under_torch_ddp(daemon: DaemonProcess, launch: Launch,
                                                 tmp_path: Path,
                                                 check_run: Callable[[Path, str], None]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for rank in (0, 1):
        launch.start("tests.ddp.torch_worker", [daemon.target, str(out)], f"rank{rank}",
                     env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    assert launch.wait() == [0, 0], launch.output()
    check_run(out, daemon.target)
