"""A LeRobot v3 root served by a real daemon and read with ``WindowDataset`` exactly as a
zarr root is: a DataLoader with 2 workers, the keymap from ``keymap_from_lerobot`` and the
same ``delta_timestamps`` a ``LeRobotDataset`` would take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import WindowDataset, collate, keymap_from_lerobot, lerobot_stats
from episerve_tools.launch import DaemonProcess
from tests.support import lerobot as lr
from tests.support.daemons import isolated

pytestmark = pytest.mark.slow

DELTA = {"observation.state": [-0.2, 0.0], "action": [0.0, 0.1, 0.2, 0.3],
         "observation.images.top": [-0.1, 0.0]}
FEATURES = ["observation.state", "action", "observation.images.top",
            "observation.images.wrist", "task"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lr.write(tmp_path_factory.mktemp("lerobot") / "ds")


def load_all(target: str, root: str) -> dict[str, Any]:
    """Every sample, in both frame modes, through DataLoaders of 2 forked workers."""
    keymap = keymap_from_lerobot(root, DELTA, features=FEATURES)
    runs: dict[str, Any] = {}
    for frames in ("uint8", "float32"):
        ds = WindowDataset(target, keymap, frames=frames, masks="all")
        indices = list(range(len(ds)))
        loader = DataLoader(ds, batch_size=8, sampler=indices, num_workers=2,
                            collate_fn=collate, multiprocessing_context="fork")
        batches = [{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                   for b in loader]
        runs[frames] = {"located": [ds.locate(g) for g in indices], "batches": batches}
    return runs


def test_a_lerobot_root_reads_through_window_dataset(root: Path, tmp_path: Path) -> None:
    """Numbers and ``_is_pad`` by LeRobot's rule, frames equal to PyAV's decode (uint8, and
    float32 as ``uint8 / 255``), two cameras, tasks, several episodes per file."""
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        runs = isolated(load_all, d.target, str(root))
    for frames, got in runs.items():
        check(root, frames, got)


def check(root: Path, frames: str, got: dict[str, Any]) -> None:
    layout = lr.Layout()
    located = got["located"]
    assert len(located) == sum(layout.lengths)
    merged: dict[str, Any] = {}
    for batch in got["batches"]:
        for k, v in batch.items():
            merged.setdefault(k, []).append(v)
    out = {k: np.concatenate(v) if isinstance(v[0], np.ndarray) else [x for p in v for x in p]
           for k, v in merged.items()}
    truth = lr.videos(root, layout)
    for b, (name, frame) in enumerate(located):
        ep, length, file, start_s = lr.place(layout, name)
        for key, value in (("observation.state", lr.state_value), ("action", lr.action_value)):
            rows, pad = lr.window(length, frame, DELTA[key])
            want = np.stack([value(ep, r) for r in rows])
            assert np.array_equal(out[key][b], want), (name, frame, key)
            assert out[f"{key}_is_pad"][b].tolist() == pad, (name, frame, key)
        rows, pad = lr.window(length, frame, DELTA["observation.images.top"])
        assert out["observation.images.top_is_pad"][b].tolist() == pad
        for k, r in enumerate(rows):
            want = truth[layout.cameras[0], file][round(start_s + r / lr.FPS, 6)]
            img = out["observation.images.top"][b, k]  # CHW
            want_chw = want.transpose(2, 0, 1)
            if frames == "uint8":
                assert img.dtype == np.uint8 and np.array_equal(img, want_chw), (name, frame)
            else:
                assert np.array_equal(img, want_chw / np.float32(255)), (name, frame)
        wrist = truth[layout.cameras[1], file][round(start_s + frame / lr.FPS, 6)]
        assert out["observation.images.wrist"][b].shape == (3, *layout.size)
        assert np.array_equal(out["observation.images.wrist"][b],
                              wrist.transpose(2, 0, 1) if frames == "uint8"
                              else wrist.transpose(2, 0, 1) / np.float32(255))
        assert out["task"][b] == [layout.tasks[lr.task_of(layout, ep, frame)]]


def test_statistics_in_lerobots_stats_json_shape(root: Path, tmp_path: Path) -> None:
    """The daemon's statistics over a LeRobot root's numeric features, as stats.json has
    them, equal numpy's over every frame's true values."""
    layout = lr.Layout()
    state = np.stack([lr.state_value(e, f) for e, n in enumerate(layout.lengths)
                      for f in range(n)]).astype(np.float64)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        ds = WindowDataset(d.target, keymap_from_lerobot(root, features=["observation.state"]))
        got = lerobot_stats(ds.stats())["observation.state"]
    assert got["count"] == [len(state)]
    assert got["min"] == state.min(0).tolist() and got["max"] == state.max(0).tolist()
    assert np.allclose(got["mean"], state.mean(0), rtol=1e-12)
    assert np.allclose(got["std"], state.std(0), rtol=1e-9)
    assert np.allclose(got["q01"], np.quantile(state, 0.01, axis=0), rtol=1e-9)
