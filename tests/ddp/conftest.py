"""A real daemon over the ramp dataset per test, and the launcher and proof of ``harness``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from episerve_tools.launch import DaemonProcess
from tests.support import ramp

pytest.register_assert_rewrite("tests.ddp.harness")

from tests.ddp.harness import Launch, check_video_run


@pytest.fixture(scope="session")
def ddp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp") / "ramp"
    ramp.write_ramp_dataset(root)
    return root


@pytest.fixture
def daemon(ddp_root: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    """A fresh daemon per test (fresh counters), with no chunk cache: every read fetches."""
    d = DaemonProcess(ddp_root, "--rescan-s", "0", "--cache-bytes", "0", "--log-level",
                      "WARNING", unix=tmp_path / "d.sock")
    yield d
    d.stop(timeout_s=15)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    logs = tmp_path / "logs"
    logs.mkdir()
    runner = Launch(logs)
    yield runner
    runner.kill()


@pytest.fixture
def check_run() -> Callable[[Path, str], None]:
    return check_video_run
