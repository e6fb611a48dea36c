"""Parity with LeRobot's own writer and loader: a dataset written by ``LeRobotDataset``
(two cameras, several episodes per file), served by a real daemon, read by
``WindowDataset`` and by ``LeRobotDataset.__getitem__`` with the same ``delta_timestamps``.

Runs only where ``lerobot`` (0.4.x, the ``lerobot-tests`` extra) imports with its video
stack: it needs a torchvision that matches the installed torch, and LeRobot 0.4 asks for
torch < 2.11. Elsewhere it is skipped with the import error as the reason; the reader's own
tests (``tests/unit/test_lerobot_reader.py``, ``test_lerobot_daemon.py``) run on a v3 root
that pyarrow and PyAV write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

try:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
except Exception as exc:  # ImportError, or a torchvision built for another torch
    pytest.skip(f"lerobot's dataset module does not import here ({type(exc).__name__}: "
                f"{str(exc)[:200]})", allow_module_level=True)

from episerve_client import WindowDataset, keymap_from_lerobot
from episerve_tools.launch import DaemonProcess
from tests.support import lerobot as lr

LENGTHS = (12, 7, 20)
SIZE = (32, 48)
CAMERAS = ("observation.images.top", "observation.images.wrist")
TASKS = ("pick the cube", "place the cube")
DELTA = {"observation.state": [-0.2, 0.0], "action": [0.0, 0.1, 0.2, 0.3],
         "observation.images.top": [-0.1, 0.0]}


def write_with_lerobot(root: Path) -> None:
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": (lr.STATE_DIM,), "names": None},
        "action": {"dtype": "float32", "shape": (lr.ACTION_DIM,), "names": None},
    }
    for cam in CAMERAS:
        features[cam] = {"dtype": "video", "shape": (*SIZE, 3),
                         "names": ["height", "width", "channels"]}
    ds = LeRobotDataset.create(repo_id="episerve/parity", fps=lr.FPS, root=root,
                               features=features, use_videos=True, vcodec="h264")
    for ep, n in enumerate(LENGTHS):
        for f in range(n):
            frame: dict[str, Any] = {"observation.state": lr.state_value(ep, f),
                                     "action": lr.action_value(ep, f),
                                     "task": TASKS[ep % 2]}
            for c, cam in enumerate(CAMERAS):
                frame[cam] = lr.frame_pixels(ep, f, c, SIZE)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()


def test_window_dataset_equals_lerobot_dataset(tmp_path: Path) -> None:
    root = tmp_path / "parity"
    write_with_lerobot(root)
    theirs = LeRobotDataset("episerve/parity", root=root, delta_timestamps=DELTA,
                            video_backend="pyav")
    keymap = keymap_from_lerobot(root, DELTA, features=[*DELTA, CAMERAS[1], "task"])
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        ours = WindowDataset(d.target, keymap, masks="all")
        assert len(ours) == len(theirs) == sum(LENGTHS)
        worst = 0.0
        for i in range(len(theirs)):
            want, got = theirs[i], ours[i]
            where = (i, int(want["episode_index"]), int(want["frame_index"]))
            assert ours.locate(i) == (f"episode_{where[1]:06d}", where[2])
            for key in ("observation.state", "action"):
                assert np.array_equal(np.asarray(got[key]), want[key].numpy()), (where, key)
                assert np.array_equal(np.asarray(got[f"{key}_is_pad"]),
                                      want[f"{key}_is_pad"].numpy()), (where, key)
            assert np.array_equal(np.asarray(got["observation.images.top_is_pad"]),
                                  want["observation.images.top_is_pad"].numpy()), where
            for cam in CAMERAS:
                diff = np.abs(np.asarray(got[cam]) - want[cam].numpy())
                worst = max(worst, float(diff.max()))
            assert got["task"] == [want["task"]], where
        assert worst == 0.0, f"frames differ from LeRobot's pyav decode by up to {worst}"
