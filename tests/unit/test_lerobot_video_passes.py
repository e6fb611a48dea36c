"""How much a LeRobot video read decodes: each frame its own chunk, keyframes listed from the
stream's packets (no metadata needed), frames decoded in passes from the keyframe at or
before them, converted only when served; counted through the reader's own counters (never
timed).

With chunks of 8 frames (the reader before), a sample of 2 random frames under a cache too
small to keep the rest converted 8 frames (16 across a chunk edge) and decoded 11.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from episerve_proto.errors import LimitExceeded
from episerve_server.core.counters import Stats
from episerve_server.core.ledger import KEYFRAME_BYTES, EpisodeState
from episerve_server.storage.lerobot.columns import FileProblem
from episerve_server.storage.lerobot.meta import Feature, VideoSpan
from episerve_server.storage.lerobot.video import (
    AHEAD,
    KEYFRAME_BLOCK,
    MAX_DECODED_FRAMES,
    VideoReader,
)
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


def lerobot_decodes(keys: list[float], times: list[float]) -> int:
    """Frames LeRobot's pyav loop decodes for ``times`` (1/FPS apart on the grid): from the
    keyframe at or before the first through the last."""
    first = max(k for k in keys if k <= min(times) + 1e-9)
    return round((max(times) - first) * lr.FPS) + 1


def reader_of(served: Served, episode: str) -> Any:
    return served.catalog.episodes[episode].readers[TOP]


def _pixels(data: bytes) -> np.ndarray:
    from episerve_proto import rawframe

    return np.frombuffer(data, np.uint8, offset=rawframe.HEADER_BYTES)


def test_keyframes_are_listed_from_the_packets_of_the_episodes_span(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """No ``video.g`` in ``info.json``: the reader lists the keyframes of its own episode's
    span (and the one at or before its first frame) from the stream, once."""
    layout = lr.Layout(lengths=(20, 16, 24), per_file=3, cameras=(TOP,), gop=3)
    root = lr.write(tmp_path / "ds", layout)
    video = root / lr.VIDEO_PATH.format(video_key=TOP, chunk_index=0, file_index=0)
    keys = keyframes(video)
    assert len(keys) > 3
    served = serve(root, cache_bytes=0)
    reader = reader_of(served, "episode_000001")
    assert reader.keyframes is None  # not listed before the first read
    served.read(WINDOW, [("episode_000001", 5)])
    start, end = 2.0, 2.0 + 15 / lr.FPS
    want = [k for k in keys if start - 1e-9 <= k <= end + 1e-9]
    before = [k for k in keys if k < start - 1e-9]
    if before and (not want or want[0] > start + 1e-9):
        want.insert(0, before[-1])
    assert [round(k, 6) for k in reader.keyframes] == [round(k, 6) for k in want]
    listed = reader.keyframes
    served.read(WINDOW, [("episode_000001", 9)])
    assert reader.keyframes is listed  # listed once


def test_random_samples_without_a_cache_decode_no_more_than_lerobot(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """LeRobot's own layout (a keyframe every 2 frames), no ``video.g`` declared, no cache:
    each sample of 2 frames converts exactly its distinct frames and decodes no more
    frames than LeRobot's loop does for it (from the keyframe at or before its first frame
    through its last), and every frame is PyAV's own decode of the file."""
    layout = lr.Layout(lengths=(20, 16, 24), per_file=3, cameras=(TOP,), gop=2)
    root = lr.write(tmp_path / "ds", layout)
    video = root / lr.VIDEO_PATH.format(video_key=TOP, chunk_index=0, file_index=0)
    keys = keyframes(video)
    assert keys == [k / lr.FPS for k in range(0, sum(layout.lengths), 2)]
    truth = lr.videos(root, layout)
    served = serve(root, cache_bytes=0)
    samples = [(f"episode_{e:06d}", f) for e, n in enumerate(layout.lengths)
               for f in range(n)]
    random.Random(0).shuffle(samples)
    decoded = theirs = 0
    for name, frame in samples:
        reader = reader_of(served, name)
        assert reader.info.chunk_rows == 1
        before = (reader.frames_decoded, reader.frames_converted)
        result = served.read(WINDOW, [(name, frame)])
        got_decoded = reader.frames_decoded - before[0]
        got_converted = reader.frames_converted - before[1]
        _, length, file, start_s = lr.place(layout, name)
        rows, _ = lr.window(length, frame, [-0.1, 0.0])
        assert got_converted == len(set(rows)), (name, frame)
        times = [start_s + r / lr.FPS for r in rows]
        assert got_decoded <= lerobot_decodes(keys, times), (name, frame)
        column = result.images["top"]
        for k, r in enumerate(rows):
            data = result.frames[column.source][int(column.index[0, k])]
            assert np.array_equal(_pixels(data).reshape(*layout.size, 3),
                                  truth[TOP, file][round(start_s + r / lr.FPS, 6)]), (name, r)
        decoded += got_decoded
        theirs += lerobot_decodes(keys, times)
    # 2.5 frames a sample on average where LeRobot's loop decodes the same, and chunks of 8
    # decoded 11 and converted 8 (16 across a chunk edge)
    assert decoded <= theirs <= 3 * len(samples)


def test_two_frames_of_one_group_of_pictures_decode_in_one_pass(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """Keyframes far apart (x264 adds some at scene cuts, so the test finds them in the
    file): two frames of one group of pictures are decoded in one pass from its keyframe,
    and two frames of groups apart in two, never decoding the frames between the groups."""
    layout = lr.Layout(lengths=(60,), per_file=1, cameras=(TOP,), gop=12)
    root = lr.write(tmp_path / "ds", layout)
    video = root / lr.VIDEO_PATH.format(video_key=TOP, chunk_index=0, file_index=0)
    keys = [round(k * lr.FPS) for k in keyframes(video)]
    gaps = [(a, b) for a, b in itertools.pairwise(keys) if b - a >= 4]
    assert len(gaps) >= 2, keys
    truth = lr.videos(root, layout)
    served = serve(root, cache_bytes=0)
    reader = reader_of(served, "episode_000000")

    def read(rows: tuple[int, int]) -> tuple[int, int]:
        before = (reader.frames_decoded, reader.frames_converted)
        offsets = [(rows[0] - rows[1]) / lr.FPS, 0.0]
        keymap = {"top": {"zarr_key": TOP, "key_type": "camera_keys", "offsets_s": offsets}}
        result = served.read(keymap, [("episode_000000", rows[1])])
        column = result.images["top"]
        for k, r in enumerate(rows):
            data = result.frames[column.source][int(column.index[0, k])]
            assert np.array_equal(_pixels(data).reshape(*layout.size, 3),
                                  truth[TOP, 0][round(r / lr.FPS, 6)])
        return reader.frames_decoded - before[0], reader.frames_converted - before[1]

    (a, b), (c, _) = gaps[0], gaps[1]
    # one group: from its keyframe a through a + 3, one pass (a seek each: 2 + 4)
    assert read((a + 1, a + 3)) == (4, 2)
    # two groups: a + 1 from a (2 frames), then c + 1 from c (2 frames)
    assert read((a + 1, c + 1)) == (4, 2)
    assert b <= c


def test_passes_follow_the_keyframes() -> None:
    """The rule itself: a frame joins the pass before it when its keyframe is at or before
    the frame after that pass's last; without a list, passes are runs of consecutive rows."""
    reader = fake_reader()
    reader.keyframes = [0.0, 0.4, 0.8, 1.2]  # every 4 frames at 10 fps
    assert reader.passes([1, 2, 3]) == [[1, 2, 3]]
    assert reader.passes([1, 3, 4, 6]) == [[1, 3, 4, 6]]  # 4's keyframe is right after 3
    assert reader.passes([1, 5]) == [[1], [5]]  # 5's keyframe (4) lies after 2
    assert reader.passes([0, 9, 10, 13]) == [[0], [9, 10], [13]]
    reader.keyframes = []  # not listed: consecutive runs
    assert reader.passes([1, 2, 4, 5, 9]) == [[1, 2], [4, 5], [9]]


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


@pytest.mark.parametrize("room", [True, False])
def test_a_group_of_pictures_is_kept_whole_while_the_cache_has_room(
        tmp_path: Path, serve: Callable[..., Served], room: bool) -> None:
    """A keyframe every 2 frames. With room in the cache, a read of 13 keeps its keyframe 12
    (decoded on the way) and a read of keyframe 16 decodes and keeps 17 too: later reads of
    12 and 17 decode nothing (the very first read, of 10, lists the keyframes and reads 10
    alone). With a cache of one frame, only the frames read are
    converted (12 is decoded on the way to 13, not kept) and 12 is decoded again."""
    layout = lr.Layout(lengths=(40,), per_file=1, cameras=(TOP,), gop=2)
    root = lr.write(tmp_path / "ds", layout)
    frame_bytes = layout.size[0] * layout.size[1] * 3 + 16 + 64
    served = serve(root, cache_bytes=(64 << 20) if room else frame_bytes)
    reader = reader_of(served, "episode_000000")
    one = {"top": {"zarr_key": TOP, "key_type": "camera_keys"}}
    truth = lr.videos(root, layout)[TOP, 0]

    def read(frame: int) -> tuple[int, int]:
        result = served.read(one, [("episode_000000", frame)])
        column = result.images["top"]
        data = result.frames[column.source][int(column.index[0])]
        assert np.array_equal(_pixels(data).reshape(*layout.size, 3),
                              truth[round(frame / lr.FPS, 6)])
        return reader.frames_decoded, reader.frames_converted

    assert read(10) == (1, 1)  # the first read lists the keyframes
    assert reader.keyframes[:3] == [0.0, 0.2, 0.4]
    if room:
        assert read(13) == (3, 3)  # 12 and 13
        assert read(12) == (3, 3)
        assert read(15) == (5, 5)  # 14 and 15
        assert read(14) == (5, 5)
        assert read(16) == (7, 7)  # a keyframe: 17 is decoded and kept with it
        assert read(17) == (7, 7)
    else:
        assert read(13) == (3, 2)
        assert read(12) == (4, 3)
        assert read(14) == (5, 4)


def test_a_file_held_by_one_thread_opens_a_second_container_for_another(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """Both decode threads can read one file (the episodes of a LeRobot v3 file share it):
    while one container of a file is held, the next request gets a second one; once both
    are free, requests take the ones already open."""
    layout = lr.Layout(lengths=(6, 6), per_file=2, cameras=(TOP,))
    root = lr.write(tmp_path / "ds", layout)
    served = serve(root)
    reader = reader_of(served, "episode_000000")
    files, path = reader.files, reader.span.path
    with files.video(path, layout.size) as first, files.video(path, layout.size) as second:
        assert first is not second
    with files.video(path, layout.size) as again:
        assert again is first


class _Packets:
    """A stream's packets (demuxed, nothing decoded): ``count`` of them ``step_s`` apart
    from 0, a keyframe every ``gop``."""

    def __init__(self, count: int, step_s: float, gop: int) -> None:
        self.count, self.step_s, self.gop = count, step_s, gop
        self.demuxed = 0

    def seek(self, ticks: int, *, stream: Any, backward: bool, any_frame: bool) -> None:
        pass

    def demux(self, stream: Any) -> Iterator[Any]:
        for k in range(self.count):
            self.demuxed += 1
            yield SimpleNamespace(pts=round(k * self.step_s * 1000), is_keyframe=k % self.gop == 0)


def test_a_long_episodes_keyframes_are_listed_and_a_dense_one_refused() -> None:
    """An episode of 6,000 frames (far more than one pass may decode) has its 1,200
    keyframes listed; packets 40 times denser than the declared 10 fps are refused after
    a few dozen, naming the rate."""
    feature = Feature(TOP, "video", (4, 4, 3), "uint8")
    reader = VideoReader("episode_000000", feature, _Files(), VideoSpan("v.mp4", 0.0),
                         6000, 10.0, 1e-4, Stats())
    stream = _Packets(6000, 0.1, 5)
    keys = reader._list_keyframes(stream)
    assert len(keys) == 1200 and keys[:2] == [0.0, 0.5] and stream.demuxed == 6000
    dense = _Packets(6000, 0.0025, 5)
    with pytest.raises(FileProblem, match=r"packets demuxed between 0\.0 s and"):
        reader._list_keyframes(dense)
    assert dense.demuxed < 64


def test_a_keyframe_list_is_charged_to_the_episode_state_and_refused_past_it() -> None:
    """The list is kept while the episode is served: charged by blocks as it is demuxed and
    settled to its length after; past the limit the listing stops, LimitExceeded names the
    episode and key, and nothing of it stays charged."""
    feature = Feature(TOP, "video", (4, 4, 3), "uint8")
    reader = VideoReader("episode_000000", feature, _Files(), VideoSpan("v.mp4", 0.0),
                         60000, 10.0, 1e-4, Stats())
    state = EpisodeState(1 << 20)
    reader.account = state.account("episode_000000")
    keys = reader._list_keyframes(_Packets(6000, 0.1, 5))
    assert len(keys) == 1200 and state.used == 1200 * KEYFRAME_BYTES
    state = EpisodeState(4 * KEYFRAME_BLOCK * KEYFRAME_BYTES)
    reader.account = state.account("episode_000000")
    many = _Packets(60000, 0.1, 1)  # every packet a keyframe: 60,000 of them
    with pytest.raises(LimitExceeded) as refused:
        reader._list_keyframes(many)
    assert refused.value.episode == "episode_000000" and refused.value.key == TOP
    assert "keyframe list" in str(refused.value)
    assert many.demuxed <= 5 * KEYFRAME_BLOCK and state.used == 0


def test_the_frames_kept_with_a_frame_reach_back_at_most_one_pass() -> None:
    """One keyframe at the start of a 10^6-frame episode: the frames worth keeping with
    frame 900,000 are those one pass decodes before it, not 900,000 of them."""
    feature = Feature(TOP, "video", (4, 4, 3), "uint8")
    reader = VideoReader("episode_000000", feature, _Files(), VideoSpan("v.mp4", 0.0),
                         10**6, 10.0, 1e-4, Stats())
    reader.keyframes = [0.0]
    near = reader.companions(30)
    assert list(near) == [*range(30), *range(31, 35)]  # from the keyframe, and AHEAD after
    far = reader.companions(900_000)
    assert len(far) == MAX_DECODED_FRAMES + AHEAD
    assert min(far) == 900_000 - MAX_DECODED_FRAMES and max(far) == 900_000 + AHEAD
