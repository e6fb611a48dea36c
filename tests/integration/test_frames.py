"""Client-side frame checks: a JPEG header is checked against the episode's ``features``
shape before the frame is decoded; an undecodable frame is still retried at another frame.

Real daemon, real ``WindowDataset``, real DataLoader workers (in a fresh interpreter, so they
can fork). The crafted episode ``huge`` holds 4000x4000 frames while its features say
360x640: the error must name everything, come fast and never decode (allocate) a frame.
"""

from __future__ import annotations

import pickle
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from torch.utils.data import DataLoader

from episerve_client import Client, WindowDataset, collate, errors
from episerve_client.data.jpeg import (
    MAX_FRAME_PIXELS,
    DeclaredSizeMismatch,
    FrameCheck,
    decode_column,
)
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode
from tests.support import ramp
from tests.support.daemons import isolated
from tests.support.hostile import replace_chunk, update_group_attrs, vlen_items

pytestmark = pytest.mark.slow

CAMERA = ramp.CAMERA_KEY
KEYMAP = {"front": {"zarr_key": CAMERA, "key_type": "camera_keys"},
          "head": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}}
HEIGHT, WIDTH = 360, 640
BIG = 4000
FRAMES = 20
BAD_HEADER, BAD_BODY = 7, 9  # frames of ``corrupt``: garbage, and a truncated JPEG


def _uniform_jpeg(height: int, width: int, value: int) -> bytes:
    rgb = np.full((height, width, 3), value, np.uint8)
    return bytes(simplejpeg.encode_jpeg(rgb, quality=85, colorspace="RGB"))


def _episode(root: Path, h: str, frames: list[bytes]) -> Path:
    n = len(frames)
    group: Path = write_episode(root, h, total_frames=n, fps=30, embodiment="human_bimanual",
                                numeric={"obs_head_pose": ramp.ramp_values(n, (7,))},
                                jpeg={CAMERA: frames}, annotations=[])
    return group


@pytest.fixture(scope="module")
def frames_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, DaemonProcess]]:
    root = tmp_path_factory.mktemp("frames")
    big = _uniform_jpeg(BIG, BIG, 120)  # ~0.4 MB on disk, 48 MB decoded, 192 MB as CHW float
    group = _episode(root, "huge", [big] * FRAMES)
    update_group_attrs(group, features={CAMERA: {"dtype": "jpeg", "shape": [HEIGHT, WIDTH, 3]},
                                        "obs_head_pose": {"dtype": "float32", "shape": [7]}})
    good = [ramp.frame_jpeg(5, t, width=WIDTH, height=HEIGHT) for t in range(FRAMES)]
    _episode(root, "right", good)
    group = _episode(root, "corrupt", good)
    replace_chunk(group, CAMERA, BAD_HEADER, vlen_items([b"\xff\xd8 not a jpeg"]))
    replace_chunk(group, CAMERA, BAD_BODY, vlen_items([good[BAD_BODY][:700]]))
    d = DaemonProcess(root, "--rescan-s", "0", "--log-level", "WARNING", unix=root / "d.sock")
    yield root, d
    d.stop(timeout_s=15)


def _read_rpcs(target: str) -> int:
    with Client(target) as c:
        return int(c.stats()["read_rpcs"])


def load_until_error(target: str, episodes: list[str], context: str) -> dict[str, Any]:
    """A DataLoader (2 workers) over ``episodes``; what it raised and how long it took.
    Runs in a fresh interpreter."""
    ds = WindowDataset(target, KEYMAP, episodes=episodes)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate,
                        multiprocessing_context=context)
    start = time.monotonic()
    try:
        for _ in loader:
            pass
    except Exception as exc:
        return {"type": type(exc).__name__, "data_loss": isinstance(exc, errors.DataLossError),
                "message": str(exc), "seconds": time.monotonic() - start}
    return {"type": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_oversized_frames_fail_fast_through_a_dataloader(
        context: str, frames_daemon: tuple[Path, DaemonProcess]) -> None:
    _, d = frames_daemon
    # The same loader over an episode of good frames, just before: the workers' start-up
    # (seconds under spawn on a busy machine) and a pass over it, at this moment's load.
    baseline = isolated(load_until_error, d.target, ["right"], context)
    assert baseline["type"] is None, baseline
    got = isolated(load_until_error, d.target, ["huge"], context)
    assert got["type"] == "DeclaredSizeMismatch", got
    assert got["data_loss"], got
    message = got["message"]
    for needle in ("'huge'", f"'{CAMERA}'", f"{BIG}x{BIG}", f"[{HEIGHT}, {WIDTH}, 3]"):
        assert needle in message, (needle, message)
    # Refused from the JPEG headers: no slower than the good pass. Decoding the 20 frames
    # as CHW floats (192 MB each) would add several times the good pass on top.
    assert got["seconds"] < 2 * baseline["seconds"] + 1.0, (got, baseline)


def test_an_oversized_frame_is_never_decoded_nor_retried(
        frames_daemon: tuple[Path, DaemonProcess]) -> None:
    _, d = frames_daemon
    ds = WindowDataset(d.target, KEYMAP, episodes=["huge", "right"])
    before = _read_rpcs(d.target)
    tracemalloc.start()
    try:
        start = time.monotonic()
        with pytest.raises(DeclaredSizeMismatch) as info:
            ds.__getitems__([FRAMES + 1, 0, 1, FRAMES + 2])  # right's frames, then huge's
        elapsed = time.monotonic() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = info.value
    print(f"refused 4000x4000 frames in {elapsed * 1e3:.0f} ms, peak allocation "
          f"{peak / 2**20:.1f} MiB")
    assert isinstance(err, errors.DataLossError) and err.code == "DATA_LOSS"
    assert (err.episode, err.key) == ("huge", CAMERA)
    assert f"{BIG}x{BIG}" in str(err) and f"[{HEIGHT}, {WIDTH}, 3]" in str(err)
    assert "frame 0" in str(err)  # the sample's frame index
    assert peak < 16 * 2**20, f"{peak} bytes allocated: a 4000x4000 frame is 48 MB decoded"
    assert elapsed < 2.0
    assert _read_rpcs(d.target) - before == 1, "the batch was retried at other frames"
    restored = pickle.loads(pickle.dumps(err))  # as a DataLoader worker hands it over
    assert type(restored) is DeclaredSizeMismatch
    assert (restored.episode, restored.key, str(restored)) == (err.episode, err.key, str(err))


def test_frames_of_the_declared_size_decode(frames_daemon: tuple[Path, DaemonProcess]) -> None:
    _, d = frames_daemon
    ds = WindowDataset(d.target, KEYMAP, episodes=["right"])
    batch = ds.__getitems__([0, 3, 19])
    for b, t in enumerate([0, 3, 19]):
        assert batch[b]["front"].shape == (3, HEIGHT, WIDTH)
        assert ramp.decode_frame_id(batch[b]["front"].numpy()) == t


def load_corrupt(target: str) -> list[tuple[int, int, float]]:
    """(frame index, decoded frame id, head value) of every sample of one batch read
    through DataLoader workers; runs in a fresh interpreter."""
    ds = WindowDataset(target, KEYMAP, episodes=["corrupt"])
    loader = DataLoader(ds, batch_size=4, sampler=[BAD_HEADER, BAD_BODY, 8, 0], num_workers=2,
                        collate_fn=collate)
    out = []
    for batch in loader:
        for b, f in enumerate(batch["frame_index"].tolist()):
            out.append((f, ramp.decode_frame_id(batch["front"][b].numpy()),
                        float(batch["head"][b][0])))
    return out


def test_an_undecodable_frame_is_still_retried_at_another_frame(
        frames_daemon: tuple[Path, DaemonProcess]) -> None:
    """A header that does not parse, and a header that parses over a truncated body: both
    are undecodable frames, read again at another frame, not a size mismatch."""
    _, d = frames_daemon
    got = isolated(load_corrupt, d.target)
    frames = [f for f, _, _ in got]
    assert frames[2:] == [8, 0]
    assert frames[0] not in (BAD_HEADER, BAD_BODY) and frames[1] not in (BAD_HEADER, BAD_BODY)
    head = ramp.ramp_values(FRAMES, (7,))
    for f, frame_id, value in got:
        assert frame_id == f and value == head[f, 0]


def test_decode_column_checks_headers_before_decoding() -> None:
    small = _uniform_jpeg(24, 32, 50)
    index = np.array([0, 1, 1], np.int32)
    check = FrameCheck("cam", ["a", "b", "b"], [3, 4, 5], {"a": (24, 32), "b": None})
    out, failed = decode_column([small, b"\xff\xd8 junk"], index, check)
    assert failed == {1, 2} and out is not None and out.shape == (3, 3, 24, 32)
    wrong = FrameCheck("cam", ["a"], [9], {"a": (24, 33)})
    with pytest.raises(DeclaredSizeMismatch, match=r"'a' key 'cam'.*frame 9.*24x32"):
        decode_column([small], index[:1], wrong)
    side = int(MAX_FRAME_PIXELS**0.5) + 8  # undeclared, and over the pixel bound
    huge = _uniform_jpeg(side, side, 7)
    with pytest.raises(DeclaredSizeMismatch, match="declare no shape"):
        decode_column([huge], index[:1], FrameCheck("cam", ["a"], [0], {"a": None}))
    with pytest.raises(DeclaredSizeMismatch, match="over the"):
        decode_column([huge], index[:1], FrameCheck("cam", ["a"], [0], {"a": (side, side)}))
    assert decode_column([huge], index[:1]) == (None, {0})  # no check: counts as undecodable
