"""Parity with LeRobot itself: datasets written by ``LeRobotDataset``'s own writer (h264 and
av1, two cameras of different sizes, a task that changes mid-episode, episodes of different
lengths), served by a real daemon, read by ``LeRobotWindowDataset`` and by
``LeRobotDataset.__getitem__`` with the same ``delta_timestamps``, every sample compared
field by field; ``lerobot_stats()`` against the dataset's own statistics.

It runs in LeRobot's own venvs, the daemon in the project's: ``DAEMON_PYTHON`` names its
interpreter (default: this one). ``make lerobot-parity`` runs this file with LeRobot 0.6
(v3.0 datasets), ``make lerobot21-parity`` with LeRobot 0.3.3, the last release that writes
and reads v2.1 datasets (one file per episode, JSON-lines metadata), both with
``--noconftest``. Where ``lerobot`` does not import it is skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

try:
    from importlib.metadata import version

    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    #: LeRobot 0.3.x writes and reads v2.1 datasets; 0.6 writes v3.0 ones.
    V21 = version("lerobot").startswith("0.3.")
    if not V21:
        from lerobot.configs.video import RGBEncoderConfig
except Exception as exc:  # ImportError, or a torchvision built for another torch
    pytest.skip(f"lerobot's dataset module does not import here ({type(exc).__name__}: "
                f"{str(exc)[:200]})", allow_module_level=True)

from episerve_client import LeRobotWindowDataset, WindowDataset, keymap_from_lerobot
from episerve_client.errors import InvalidArgument
from episerve_tools.launch import DaemonProcess
from tests.support import lerobot as lr

LENGTHS = (12, 7, 20, 5)
CAMERAS = {"observation.images.top": (48, 64), "observation.images.wrist": (36, 48)}
TASKS = ("pick the cube", "place the cube", "wave")
#: Past and future offsets; one video window of one offset; a camera with none.
DELTAS: dict[str, dict[str, list[float]]] = {
    "window": {"observation.state": [-0.2, -0.1, 0.0], "action": [0.0, 0.1, 0.2, 0.3],
               "observation.images.top": [-0.1, 0.0, 0.1]},
    "single": {"observation.state": [0.0], "action": [0.1],
               "observation.images.top": [0.0], "observation.images.wrist": [-0.1]},
}


def task_of(ep: int, f: int) -> str:
    """Episode 2 switches task halfway through; the others keep one."""
    if ep == 2:
        return TASKS[2] if f >= LENGTHS[ep] // 2 else TASKS[0]
    return TASKS[ep % 2]


def write_with_lerobot(root: Path, vcodec: str) -> None:
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": (lr.STATE_DIM,), "names": None},
        "action": {"dtype": "float32", "shape": (lr.ACTION_DIM,), "names": None},
    }
    for cam, size in CAMERAS.items():
        features[cam] = {"dtype": "video", "shape": (*size, 3),
                         "names": ["height", "width", "channels"]}
    if V21:
        write_v21(root, vcodec, features)
        return
    ds = LeRobotDataset.create(repo_id="episerve/parity", fps=lr.FPS, root=root,
                               features=features, use_videos=True,
                               rgb_encoder=RGBEncoderConfig(vcodec=vcodec))
    for ep, n in enumerate(LENGTHS):
        for f in range(n):
            frame: dict[str, Any] = {"observation.state": lr.state_value(ep, f),
                                     "action": lr.action_value(ep, f), "task": task_of(ep, f)}
            for c, (cam, size) in enumerate(CAMERAS.items()):
                frame[cam] = lr.frame_pixels(ep, f, c, size)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()


def write_v21(root: Path, vcodec: str, features: dict[str, Any]) -> None:
    """LeRobot 0.3.3's writer: the task is an argument of ``add_frame``, and the codec is
    its encoder's argument (which ``save_episode`` leaves at its default, AV1)."""
    import functools

    from lerobot.datasets import lerobot_dataset, video_utils

    encode = lerobot_dataset.encode_video_frames
    lerobot_dataset.encode_video_frames = functools.partial(  # type: ignore[attr-defined]
        video_utils.encode_video_frames, vcodec=vcodec)
    try:
        ds = LeRobotDataset.create(repo_id="episerve/parity", fps=lr.FPS, root=root,
                                   features=features, use_videos=True)
        for ep, n in enumerate(LENGTHS):
            for f in range(n):
                frame: dict[str, Any] = {"observation.state": lr.state_value(ep, f),
                                         "action": lr.action_value(ep, f)}
                for c, (cam, size) in enumerate(CAMERAS.items()):
                    frame[cam] = lr.frame_pixels(ep, f, c, size)
                ds.add_frame(frame, task=task_of(ep, f))
            ds.save_episode()
    finally:
        lerobot_dataset.encode_video_frames = encode  # type: ignore[attr-defined]
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v2.1", info["codebase_version"]


@pytest.fixture(scope="module", params=["h264", "libsvtav1"])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    tmp = tmp_path_factory.mktemp(f"parity-{request.param}")
    root = tmp / "root"
    write_with_lerobot(root, request.param)
    python = os.environ.get("DAEMON_PYTHON")
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp / "d.sock", python=python) as d:
        yield root, d.target


def same(where: tuple[Any, ...], got: dict[str, Any], want: dict[str, Any]) -> float:
    """Every key, dtype, shape and value equal; returns the largest frame difference."""
    assert sorted(got) == sorted(want), where
    worst = 0.0
    for key, value in want.items():
        mine = got[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(mine, torch.Tensor), (where, key)
            assert (mine.dtype, tuple(mine.shape)) == (value.dtype, tuple(value.shape)), \
                (where, key, mine.dtype, tuple(mine.shape), value.dtype, tuple(value.shape))
            if key in CAMERAS:
                worst = max(worst, float((mine.double() - value.double()).abs().max()))
            else:
                assert torch.equal(mine, value), (where, key, mine, value)
        else:
            assert mine == value, (where, key, mine, value)
    return worst


@pytest.mark.parametrize("delta", sorted(DELTAS))
@pytest.mark.parametrize("uint8", [False, True], ids=["float32", "uint8"])
def test_items_equal_lerobot_dataset(served: tuple[Path, str], delta: str,
                                     uint8: bool) -> None:
    root, target = served
    if V21 and uint8:
        pytest.skip("LeRobot 0.3.3 gives float32 frames only (no return_uint8)")
    options = {"return_uint8": True} if uint8 else {}
    theirs = LeRobotDataset("episerve/parity", root=root, delta_timestamps=DELTAS[delta],
                            video_backend="pyav", **options)
    ours = LeRobotWindowDataset(target, root, DELTAS[delta], return_uint8=uint8)
    assert len(ours) == len(theirs) == sum(LENGTHS)
    worst = 0.0
    for i in range(len(theirs)):
        worst = max(worst, same((delta, i), ours[i], theirs[i]))
    assert worst == 0.0, f"frames differ from LeRobot's pyav decode by up to {worst}"
    # a batch, as a DataLoader asks for one, holds the same items
    batch = ours.__getitems__([len(ours) - 1, 0, 13])
    for b, i in enumerate([len(ours) - 1, 0, 13]):
        same((delta, "batch", i), batch[b], theirs[i])


@pytest.mark.parametrize("uint8", [False, True], ids=["float32", "uint8"])
def test_dataloader_batches_equal_lerobot_datasets(served: tuple[Path, str],
                                                   uint8: bool) -> None:
    """As a LeRobot training loop reads: 2 spawned workers, a shuffled order, torch's
    default collate. Our frames are collated without a copy (their column is handed over),
    LeRobot's are stacked; every batch is the same."""
    from torch.utils.data import DataLoader

    root, target = served
    if V21 and uint8:
        pytest.skip("LeRobot 0.3.3 gives float32 frames only (no return_uint8)")
    options = {"return_uint8": True} if uint8 else {}
    theirs = LeRobotDataset("episerve/parity", root=root, delta_timestamps=DELTAS["window"],
                            video_backend="pyav", **options)
    ours = LeRobotWindowDataset(target, root, DELTAS["window"], return_uint8=uint8)
    order = np.random.default_rng(5).permutation(len(ours)).tolist()

    def batches(ds: Any) -> list[dict[str, Any]]:
        return list(DataLoader(ds, batch_size=8, sampler=order, num_workers=2,
                               multiprocessing_context="spawn"))

    got, want = batches(ours), batches(theirs)
    assert len(got) == len(want) == -(-len(order) // 8)
    for k, (mine, ref) in enumerate(zip(got, want, strict=True)):
        assert same(("loader", k), mine, ref) == 0.0


def test_an_episode_subset_indexes_as_lerobot_does_over_grpc(
        served: tuple[Path, str]) -> None:
    root, target = served
    delta = DELTAS["window"]
    episodes = [3, 1]
    theirs: Any
    if V21:
        # LeRobot 0.3.3 reads a subset's windows from the wrong episode (it looks the
        # window's rows up by episode index in a table of the subset's positions; an
        # unsorted subset raises IndexError). The reference is then its full dataset's
        # items of those episodes, which a correct subset must equal.
        full = LeRobotDataset("episerve/parity", root=root, delta_timestamps=delta,
                              video_backend="pyav")
        starts = np.cumsum([0, *LENGTHS])
        theirs = [full[int(i)] for e in sorted(episodes)
                  for i in range(starts[e], starts[e + 1])]
    else:
        theirs = LeRobotDataset("episerve/parity", root=root, episodes=episodes,
                                delta_timestamps=delta, video_backend="pyav")
    # over gRPC (the items test above reads through the local plane of a unix socket)
    ours = LeRobotWindowDataset(target, root, delta, episodes=episodes, transport="grpc")
    assert len(ours) == len(theirs) == LENGTHS[1] + LENGTHS[3]
    for i in range(len(theirs)):
        assert same(("subset", i), ours[i], theirs[i]) == 0.0


def test_offsets_off_the_grid_are_refused_as_lerobot_refuses_them(
        served: tuple[Path, str]) -> None:
    root, target = served
    off = {"action": [0.0, 0.01]}
    with pytest.raises(ValueError, match="tolerance"):
        LeRobotDataset("episerve/parity", root=root, delta_timestamps=off, video_backend="pyav")
    with pytest.raises(InvalidArgument, match=r"action.*0\.01.*tolerance_s"):
        LeRobotWindowDataset(target, root, off)
    # within tolerance_s of the grid: both take it
    near = {"action": [0.0, 0.1 + 5e-5]}
    LeRobotDataset("episerve/parity", root=root, delta_timestamps=near, video_backend="pyav")
    assert len(LeRobotWindowDataset(target, root, near)) == sum(LENGTHS)


def test_default_layout_values_match_lerobot(served: tuple[Path, str]) -> None:
    root, target = served
    delta = DELTAS["window"]
    theirs = LeRobotDataset("episerve/parity", root=root, delta_timestamps=delta,
                            video_backend="pyav")
    keymap = keymap_from_lerobot(root, delta)
    ours = WindowDataset(target, keymap, masks="all")
    for i in range(len(theirs)):
        want, got = theirs[i], ours[i]
        assert ours.locate(i) == (f"episode_{int(want['episode_index']):06d}",
                                  int(want["frame_index"]))
        for key in ("observation.state", "action", *CAMERAS):
            mine = np.asarray(got[key]).reshape(want[key].shape)
            assert np.array_equal(mine, want[key].numpy()), (i, key)
        for key in delta:
            assert np.array_equal(np.asarray(got[f"{key}_is_pad"]),
                                  want[f"{key}_is_pad"].numpy()), (i, key)
        assert got["task"] == [want["task"]], i


def test_grpcio_and_protobuf_are_in_the_claimed_range() -> None:
    """The runtimes under test are the ones pyproject.toml claims; with
    ``CLIENT_FLOOR_PINS`` set (``make lerobot-parity-floor``), exactly its pins."""
    import tomllib

    import grpc
    from google.protobuf import __version__ as protobuf_version
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    claimed = {r.name: r for r in map(Requirement, project["project"]["dependencies"])}
    running = {"grpcio": grpc.__version__, "protobuf": protobuf_version}
    for name, version in running.items():
        assert claimed[name].specifier.contains(version), (name, version, claimed[name])
    floor = os.environ.get("CLIENT_FLOOR_PINS")
    if floor:
        pins = dict(p.split("==") for p in floor.split())
        assert running == pins, (running, pins)
        assert all(claimed[n].specifier.contains(v) and f">={v}" in str(claimed[n].specifier)
                   for n, v in pins.items()), (pins, claimed)


def test_lerobot_stats_match_meta_stats_json(served: tuple[Path, str]) -> None:
    root, target = served
    if V21:  # v2.1 keeps per-episode statistics; LeRobot aggregates them when it loads
        want = LeRobotDataset("episerve/parity", root=root, video_backend="pyav").meta.stats
        want = {k: {n: np.asarray(v) for n, v in s.items()} for k, s in want.items()}
    else:
        want = json.loads((root / "meta" / "stats.json").read_text())
    got = LeRobotWindowDataset(target, root).lerobot_stats()
    numeric = ["observation.state", "action", "timestamp", "frame_index", "episode_index",
               "index", "task_index"]
    assert sorted(got) == sorted(numeric)
    for key in numeric:
        names = sorted(want[key])
        if V21:  # 0.3.3 keeps min, max, mean, std and count (no quantiles)
            assert set(names) <= set(got[key]), (key, names)
        else:
            assert sorted(got[key]) == names, key
            assert {"q01", "q10", "q50", "q90", "q99"} <= set(names)
        # v2.1: LeRobot 0.3.3 aggregates per-episode statistics its writer computed in
        # float32; the daemon's are computed from the rows (LeRobot 0.6's rule)
        rtol = 1e-6 if V21 else 1e-9
        for name in names:
            mine, theirs = np.asarray(got[key][name]), np.asarray(want[key][name])
            assert mine.shape == theirs.shape, (key, name)
            np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=0, err_msg=f"{key} {name}")


def test_the_root_make_dataset_writes_reads_as_lerobot_reads_it(
        tmp_path: Path) -> None:
    """``episerve make-dataset --layout lerobot`` (the docs' first LeRobot example) writes a
    root ``LeRobotDataset`` reads, and the daemon serves its items as LeRobot gives them."""
    if V21:
        pytest.skip("make-dataset writes v3.0 roots, which LeRobot 0.3.3 does not read")
    import subprocess
    import sys

    python = os.environ.get("DAEMON_PYTHON") or sys.executable
    root = tmp_path / "made"
    subprocess.run([python, "-m", "episerve_tools.cli", "make-dataset", str(root), "--layout",
                    "lerobot", "--episodes", "2", "--min-frames", "30", "--max-frames", "40"],
                   check=True, capture_output=True, timeout=300)
    delta = {"observation.state": [-1 / 30, 0.0], "action": [0.0, 1 / 30, 2 / 30],
             "observation.images.top": [-1 / 30, 0.0]}
    theirs = LeRobotDataset("episerve/made", root=root, delta_timestamps=delta,
                            video_backend="pyav")
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "d.sock", python=python) as d:
        ours = LeRobotWindowDataset(d.target, root, delta)
        assert len(ours) == len(theirs) > 0
        worst = 0.0
        for i in range(len(theirs)):
            want, got = theirs[i], ours[i]
            assert sorted(got) == sorted(want), i
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert got[key].dtype == value.dtype and got[key].shape == value.shape
                    diff = float((got[key].double() - value.double()).abs().max())
                    worst = max(worst, diff)
                else:
                    assert got[key] == value, (i, key, got[key], value)
        assert worst == 0.0, worst
        assert isinstance(theirs[0]["task"], str) and theirs[0]["task"].startswith("Pick up")
