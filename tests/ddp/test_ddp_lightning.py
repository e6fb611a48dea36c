"""Lightning ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``, gloo, a real daemon.

Plain "ddp" launches rank 1 by re-running the command that started rank 0, so rank 0 is a
script run as a subprocess (``tests/ddp/lightning_worker.py``), not code inside pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from episerve_tools.launch import DaemonProcess
from tests.ddp.harness import Launch

pytestmark = pytest.mark.slow


def test_video_on_rank_zero_only_under_lightning_ddp(daemon: DaemonProcess, launch: Launch,
                                                     tmp_path: Path,
                                                     check_run: Callable[[Path, str], None]
                                                     ) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch.start("tests.ddp.lightning_worker", [daemon.target, str(out)], "lightning")
    assert launch.wait() == [0], launch.output()
    check_run(out, daemon.target)
