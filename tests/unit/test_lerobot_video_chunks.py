"""How much a LeRobot video read decodes: chunks as long as the declared keyframe interval
(``video.g``), decoding from the keyframe at or before the first wanted frame and no
further than the last, counted through the reader's own counters (never timed).

With chunks of 8 frames, a sample of 2 random frames under a cache too small to keep the
rest converted 8 frames (16 across a chunk edge) and decoded 11: the GOP before the chunk
(its seek went to the first frame less ``tolerance_s``), the chunk, and one frame past it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from episerve_server.core.stats import Stats
from episerve_server.storage.lerobot.meta import Feature, VideoSpan
from episerve_server.storage.lerobot.video import VIDEO_CHUNK_ROWS, VideoReader, chunk_rows
from tests.support import lerobot as lr
from tests.support.served import Served

TOP = "observation.images.top"
WINDOW = {"top": {"zarr_key": TOP, "key_type": "camera_keys", "offsets_s": [-0.1, 0.0]}}


def keyframes(path: Path) -> list[float]:
    """The times of the file's keyframe packets (demuxed, not decoded)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        base = stream.time_base
        assert base is not None
        return [float(p.pts * base) for p in container.demux(stream)
                if p.pts is not None and p.is_keyframe]


def declare_gop(root: Path, gop: int) -> None:
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    for cam in lr.Layout.cameras:
        if cam in info["features"]:
            info["features"][cam]["info"]["video.g"] = gop
    path.write_text(json.dumps(info))


def reader_of(served: Served, episode: str) -> Any:
    return served.catalog.episodes[episode].readers[TOP]


def test_chunk_rows_follow_the_declared_keyframe_interval() -> None:
    assert [chunk_rows(g) for g in (0, 1, 2, 5, 8, 9, 250)] == [
        VIDEO_CHUNK_ROWS, 1, 2, 5, VIDEO_CHUNK_ROWS, VIDEO_CHUNK_ROWS, VIDEO_CHUNK_ROWS]


def test_random_samples_without_a_cache_decode_only_their_keyframe_intervals(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """LeRobot's layout (a keyframe every 2 frames, every episode starting on one): each
    sample of 2 frames, read with no cache, decodes and converts at most 4 frames (2 when
    its first frame is a keyframe), and the frames are PyAV's own decode of the file."""
    layout = lr.Layout(lengths=(20, 16, 24), per_file=3, cameras=(TOP,), gop=2)
    root = lr.write(tmp_path / "ds", layout)
    declare_gop(root, 2)
    video = root / lr.VIDEO_PATH.format(video_key=TOP, chunk_index=0, file_index=0)
    assert keyframes(video) == [k / lr.FPS for k in range(0, sum(layout.lengths), 2)]
    truth = lr.videos(root, layout)
    served = serve(root, cache_bytes=0)
    samples = [(f"episode_{e:06d}", f) for e, n in enumerate(layout.lengths)
               for f in range(n)]
    random.Random(0).shuffle(samples)
    served_frames = decoded = converted = 0
    for name, frame in samples:
        reader = reader_of(served, name)
        assert reader.info.chunk_rows == 2
        before = (reader.frames_decoded, reader.frames_converted)
        result = served.read(WINDOW, [(name, frame)])
        got_decoded = reader.frames_decoded - before[0]
        got_converted = reader.frames_converted - before[1]
        first = max(frame - 1, 0)
        assert got_converted == (2 if first % 2 == 0 else 4), (name, frame)
        assert got_decoded == got_converted, (name, frame)
        _, length, file, start_s = lr.place(layout, name)
        rows, _ = lr.window(length, frame, [-0.1, 0.0])
        column = result.images["top"]
        for k, r in enumerate(rows):
            data = result.frames[column.source][int(column.index[0, k])]
            assert np.array_equal(_pixels(data).reshape(*layout.size, 3),
                                  truth[TOP, file][round(start_s + r / lr.FPS, 6)]), (name, r)
        served_frames += len(set(rows))
        decoded += got_decoded
        converted += got_converted
    # 60 samples of 2 frames (1 at an episode's start): 3 frames decoded per sample on
    # average, where chunks of 8 decoded 11 and converted 8 (16 across a chunk edge)
    assert decoded == converted <= 3 * len(samples)
    assert served_frames == 2 * len(samples) - len(layout.lengths)


def _pixels(data: bytes) -> np.ndarray:
    from episerve_proto import rawframe

    return np.frombuffer(data, np.uint8, offset=rawframe.HEADER_BYTES)


def test_a_chunk_starting_on_a_keyframe_decodes_nothing_before_it_nor_after_it(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """No ``video.g`` declared: chunks of 8. A chunk whose first frame is a keyframe
    decodes its 8 frames only (before, the GOP ahead of it and one frame past it too)."""
    layout = lr.Layout(lengths=(16, 16), per_file=2, cameras=(TOP,), gop=4)
    root = lr.write(tmp_path / "ds", layout)
    video = root / lr.VIDEO_PATH.format(video_key=TOP, chunk_index=0, file_index=0)
    keys = keyframes(video)
    served = serve(root, cache_bytes=0)
    reader = reader_of(served, "episode_000001")
    assert reader.info.chunk_rows == VIDEO_CHUNK_ROWS
    served.read({"top": {"zarr_key": TOP, "key_type": "camera_keys"}},
                [("episode_000001", 8)])  # rows 8..15: frames 24..31 of the file
    first_key = max(k for k in keys if k <= 2.4 + 1e-9)
    assert reader.frames_converted == 8
    assert reader.frames_decoded == round((3.1 - first_key) * lr.FPS) + 1
    if 2.4 in keys:
        assert reader.frames_decoded == 8


class _Frame:
    def __init__(self, time: float) -> None:
        self.time, self.height, self.width = time, 4, 4


class _Container:
    """Frames every 0.1 s from 0; a seek lands on the keyframe (every 0.4 s) at or before
    the time asked, the first seek ``late`` s after it (a demuxer seeking by another
    clock)."""

    def __init__(self, late: float = 0.0) -> None:
        self.late, self.decoded = late, 0
        self.seeks: list[float] = []
        self._at = 0.0

    def seek(self, ticks: int, *, stream: Any, backward: bool, any_frame: bool) -> None:
        at = ticks * float(stream.time_base)
        self.seeks.append(at)
        key = int(round(at * 10, 6)) // 4 * 4 / 10
        self._at = key + (self.late if len(self.seeks) == 1 else 0.0)

    def decode(self, stream: Any) -> Iterator[_Frame]:
        k = round(self._at * 10)
        while k < 100:
            self.decoded += 1
            yield _Frame(k / 10)
            k += 1


class _Stream:
    time_base = 1 / 1000


class _Files:
    @staticmethod
    def checked_stream(container: Any, path: str, size: tuple[int, int]) -> _Stream:
        return _Stream()


def fake_reader() -> VideoReader:
    feature = Feature(TOP, "video", (4, 4, 3), "uint8")
    return VideoReader("episode_000000", feature, _Files(), VideoSpan("v.mp4", 0.0),
                       100, 10.0, 1e-4, Stats())


def test_a_seek_landing_after_the_first_frame_decodes_again_from_before_it() -> None:
    reader = fake_reader()
    targets = [0.9, 1.0, 1.1]
    on_time = _Container()
    best, _, decoded = reader._scan(on_time, targets)
    assert [round(best[k][0], 6) for k in range(3)] == targets
    assert len(on_time.seeks) == 1 and decoded == on_time.decoded == 4  # 0.8 .. 1.1
    late = _Container(late=0.2)  # lands on 1.0 for a seek to 0.9: 0.9 would be skipped
    best, _, decoded = reader._scan(late, targets)
    assert [round(best[k][0], 6) for k in range(3)] == targets
    assert len(late.seeks) == 2 and late.seeks[1] < late.seeks[0]
