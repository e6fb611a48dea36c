"""``LeRobotWindowDataset`` in the project's own venv, on a v3 root written with pyarrow and
PyAV (``tests.support.lerobot``): LeRobot's keys, dtypes, shapes and index against the
literal window rule, through a DataLoader with the default ``collate_fn``. The comparison
with ``LeRobotDataset`` itself is ``test_lerobot_parity.py``, in LeRobot's venv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from episerve_client import LeRobotWindowDataset
from episerve_client.errors import InvalidArgument
from episerve_tools.launch import DaemonProcess
from tests.support import lerobot as lr
from tests.support.daemons import isolated

pytestmark = pytest.mark.slow

DELTA = {"observation.state": [-0.2, 0.0, 0.1], "action": [0.1],
         "observation.images.top": [0.0]}


def load(target: str, root: str) -> dict[str, Any]:
    ds = LeRobotWindowDataset(target, root, DELTA)
    items = [ds[i] for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    batches = list(loader)
    return {"items": items, "batches": batches, "len": len(ds)}


def test_items_have_lerobots_keys_shapes_and_values(tmp_path: Path) -> None:
    layout = lr.Layout()
    root = lr.write(tmp_path / "ds", layout)
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock") as d:
        got = isolated(load, d.target, str(root))
        with pytest.raises(InvalidArgument, match=r"'action'.*0\.01.*tolerance_s"):
            LeRobotWindowDataset(d.target, root, {"action": [0.0, 0.01]})
    assert got["len"] == sum(layout.lengths)
    h, w = layout.size
    g = 0
    for ep, length in enumerate(layout.lengths):
        for f in range(length):
            item = got["items"][g]
            assert sorted(item) == sorted([
                "observation.state", "observation.state_is_pad", "action", "action_is_pad",
                *layout.cameras, "observation.images.top_is_pad", "timestamp", "frame_index",
                "episode_index", "index", "task_index", "task"]), g
            rows, pad = lr.window(length, f, DELTA["observation.state"])
            want = np.stack([lr.state_value(ep, r) for r in rows])
            assert item["observation.state"].dtype == torch.float32
            assert np.array_equal(item["observation.state"].numpy(), want), g
            assert item["observation.state_is_pad"].tolist() == pad
            rows, pad = lr.window(length, f, DELTA["action"])
            assert item["action"].shape == (1, lr.ACTION_DIM)  # numbers keep a window of 1
            assert np.array_equal(item["action"].numpy(), lr.action_value(ep, rows[0])[None])
            assert item["action_is_pad"].tolist() == pad
            for cam in layout.cameras:  # a video window of 1, and no window: one frame
                assert item[cam].shape == (3, h, w) and item[cam].dtype == torch.float32
            assert item["observation.images.top_is_pad"].tolist() == [False]
            assert item["timestamp"].dtype == torch.float32 and item["timestamp"].ndim == 0
            assert float(item["timestamp"]) == np.float32(f / lr.FPS)
            for key, value in (("frame_index", f), ("episode_index", ep), ("index", g),
                               ("task_index", lr.task_of(layout, ep, f))):
                assert item[key].dtype == torch.int64 and item[key].ndim == 0, key
                assert int(item[key]) == value, (g, key)
            assert item["task"] == layout.tasks[lr.task_of(layout, ep, f)]
            g += 1
    first = got["batches"][0]  # torch's default collate, as LeRobot's training loop has it
    assert first["action"].shape == (8, 1, lr.ACTION_DIM)
    assert first["index"].tolist() == list(range(8))
    assert first["task"] == [got["items"][i]["task"] for i in range(8)]


def loader_pass(target: str, root: str, uint8: bool) -> list[dict[str, Any]]:
    ds = LeRobotWindowDataset(target, root, DELTA, return_uint8=uint8)
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
    return list(loader)


@pytest.mark.parametrize("uint8", [False, True], ids=["float32", "uint8"])
def test_workers_batches_equal_in_process_ones_and_reuse_the_daemons_segments(
        tmp_path: Path, uint8: bool) -> None:
    """Items are copied by torch's collate, so a worker's answers are not kept: each goes
    back to the daemon's pool once read and the next batch is written into the same
    pages. Every batch is still what the main process reads on its own."""
    from torch.utils.data import default_collate

    from episerve_client import Client

    layout = lr.Layout()
    root = lr.write(tmp_path / "ds", layout)
    with DaemonProcess(root, "--rescan-s", "0", "--local-segments", "4",
                       unix=tmp_path / "d.sock") as d, Client(d.target) as c:
        before = c.stats()["local_segments_made"]
        batches = isolated(loader_pass, d.target, str(root), uint8)
        made = c.stats()["local_segments_made"] - before
        ds = LeRobotWindowDataset(d.target, root, DELTA, return_uint8=uint8)
        want = [default_collate([ds[i] for i in range(k, min(k + 2, len(ds)))])
                for k in range(0, len(ds), 2)]
    assert len(batches) == len(want) == sum(layout.lengths) // 2 == 24
    assert made <= 2 * 4, made  # each worker's pool of 4; before, a segment per batch
    cam = layout.cameras[0]
    assert batches[0][cam].dtype == (torch.uint8 if uint8 else torch.float32)
    for k, (got, ref) in enumerate(zip(batches, want, strict=True)):
        assert got.keys() == ref.keys(), k
        for key, value in ref.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), (k, key)
            else:
                assert got[key] == value, (k, key)
