"""LeRobot files that are small on disk and decode huge, read through the catalog and planner
the daemon uses (in process): each is refused with its reason, naming the file (and the
episode and key for a read), before it costs this process more than ``LIMIT_MIB`` of peak RSS.
Before these bounds the same files took 390-850 MiB (figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from episerve_proto import rawframe
from episerve_proto.errors import DataLossError
from episerve_server.storage.lerobot import files
from episerve_server.storage.lerobot.source import LeRobotSource
from tests.support import lerobot as lr
from tests.support import lerobot_bombs as bombs
from tests.support.served import Served

LIMIT_MIB = 128
STATE = {"s": {"zarr_key": "observation.state", "key_type": "proprio_keys"}}
TOP = {"top": {"zarr_key": "observation.images.top", "key_type": "camera_keys"}}


def costly(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """What ``call`` raised (None if nothing) and how far it raised the peak RSS (MiB)."""
    with bombs.PeakGrowth() as grew:
        try:
            call()
        except Exception as exc:  # (returned to the test, which checks it)
            return exc, grew.done()
    return None, grew.mib


def refused_frame(served: Served) -> str:
    """Frame 0 of episode 0's camera, which must be ``DATA_LOSS`` naming them, costing
    less than ``LIMIT_MIB``: the error's text."""
    start = time.process_time()
    error, grew = costly(lambda: served.read(TOP, [("episode_000000", 0)]))
    cpu = time.process_time() - start
    assert grew < LIMIT_MIB, f"+{grew:.0f} MiB in {cpu:.2f} s of CPU"
    assert isinstance(error, DataLossError), error
    text = str(error)
    assert "'episode_000000'" in text and "'observation.images.top'" in text
    return text


def problem(served: Served) -> str:
    lerobot = served.catalog.source
    assert isinstance(lerobot, LeRobotSource)
    return lerobot.problem


@pytest.mark.parametrize("as_dictionary", [False, True])
def test_tasks_of_4_mib_texts_are_refused_from_the_first_batch(
        tmp_path: Path, serve: Callable[..., Served], as_dictionary: bool) -> None:
    """64 task texts of 4 MiB in a ~1 KiB ``meta/tasks.parquet``: refused after one text
    is decoded (the batch is sized from the footer), not after all 64 became strings;
    whether pyarrow reads the column as plain texts or as a dictionary of them."""
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5,), cameras=()))
    path = bombs.tasks_bomb(root, as_dictionary=as_dictionary)
    assert path.stat().st_size < 4096
    with bombs.PeakGrowth() as grew:
        served = serve(root)
    assert grew.done() < LIMIT_MIB, f"+{grew.mib:.0f} MiB"
    assert not served.catalog.episodes
    why = problem(served)
    assert "'meta/tasks.parquet'" in why and "'task'" in why
    assert f"a text of {4 * bombs.MiB} bytes, more than 65536" in why


@pytest.mark.parametrize("as_dictionary", [False, True])
def test_many_small_tasks_in_small_batches_are_all_read(
        tmp_path: Path, serve: Callable[..., Served], as_dictionary: bool) -> None:
    """5,000 distinct tasks (~0.15 MB of texts): read in batches sized from the footer,
    every text served as written; a dictionary is not counted once per batch."""
    texts = [f"task number {k} of the many" for k in range(5_000)]
    layout = lr.Layout(lengths=(5,), cameras=(), tasks=tuple(texts),
                       frame_tasks={0: [0, 1, 4_999, 7, 7]})
    root = lr.write(tmp_path / "ds", layout)
    column = pa.array(texts).dictionary_encode() if as_dictionary else pa.array(texts)
    pq.write_table(pa.table({"task": column, "task_index": pa.array(range(5_000))}),
                   root / "meta" / "tasks.parquet", row_group_size=2000)
    served = serve(root)
    assert problem(served) == ""
    annotation = {"task": {"zarr_key": "task", "key_type": "annotation_keys"}}
    got = served.read(annotation, [("episode_000000", f) for f in range(5)]).texts["task"]
    assert got == [[texts[k]] for k in (0, 1, 4_999, 7, 7)]


def test_episode_rows_stored_as_bytes_are_refused_from_the_schema(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(48,), cameras=()))
    bombs.binary_feature(root / "meta/episodes/chunk-000/file-000.parquet", "length")
    with bombs.PeakGrowth() as grew:
        served = serve(root)
    assert grew.done() < LIMIT_MIB, f"+{grew.mib:.0f} MiB"
    why = problem(served)
    assert "'meta/episodes/chunk-000/file-000.parquet'" in why
    assert "column 'length' is stored as binary, not numbers" in why


def test_a_float_feature_stored_as_bytes_is_refused_before_its_row_group_is_read(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """48 rows of 8 MiB values in a ~2 KiB data file, where ``observation.state`` is
    declared float32: ``DATA_LOSS`` naming episode, key and type; other keys still read."""
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(48,), cameras=()))
    path = root / lr.DATA_PATH.format(chunk_index=0, file_index=0)
    bombs.binary_feature(path, "observation.state")
    assert path.stat().st_size < 8192
    served = serve(root)
    error, grew = costly(lambda: served.read(STATE, [("episode_000000", 3)]))
    assert grew < LIMIT_MIB, f"+{grew:.0f} MiB"
    assert isinstance(error, DataLossError), error
    text = str(error)
    assert "'episode_000000'" in text and "'observation.state'" in text
    assert "stored as binary, not numbers" in text
    action = {"a": {"zarr_key": "action", "key_type": "action_keys"}}
    got = served.read(action, [("episode_000000", 3)]).arrays["a"][0]
    assert got.tolist() == lr.action_value(0, 3).tolist()


@pytest.mark.parametrize(("field", "value", "why"), [
    ("fps", 1e-300, "'fps' must be a number in [0.001, 10000.0], got 1e-300"),
    ("fps", 10**6, "'fps' must be a number in [0.001, 10000.0], got 1000000"),
    ("total_frames", 2**70, "'total_frames' must be an int in"),
    ("chunks_size", 0, "'chunks_size' must be an int in [1,"),
    ("total_episodes", 2.5, "'total_episodes' must be an int in"),
    ("data_files_size_in_mb", float("inf"), "'data_files_size_in_mb' must be a number"),
    ("some_later_field", -1e300, "'some_later_field' must be a number in"),
])
def test_numbers_of_info_json_out_of_bounds_refuse_the_dataset_with_the_field(
        tmp_path: Path, serve: Callable[..., Served], field: str, value: Any,
        why: str) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5,), cameras=()))
    bombs.edit_info(root, **{field: value})
    served = serve(root)
    assert not served.catalog.episodes
    assert "meta/info.json" in problem(served) and why in problem(served)


def test_a_video_fps_of_1e_300_refuses_the_dataset(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """The feature's ``info`` is checked too (``video.fps``), and the dataset's fps is what
    a video read divides by: 1e-300 there was an ``OverflowError`` (``INTERNAL``)."""
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5,), cameras=lr.Layout.cameras[:1]))
    info = lr.info(lr.Layout(lengths=(5,), cameras=lr.Layout.cameras[:1]), 5)
    info["features"]["observation.images.top"]["info"]["video.fps"] = 1e-300
    bombs.edit_info(root, features=info["features"])
    served = serve(root)
    assert "'features.observation.images.top.info.video.fps'" in problem(served)
    bombs.edit_info(root, features=lr.info(lr.Layout(cameras=lr.Layout.cameras[:1]), 5)[
        "features"], fps=1e-300)
    served = serve(root)
    assert "'fps' must be a number" in problem(served)


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bombs.huge_video(tmp_path_factory.mktemp("huge") / "huge.mp4")


@pytest.mark.slow  # builds its file in a child process
def test_a_14000x14000_video_declared_32x48_is_refused_before_a_frame_is_decoded(
        tmp_path: Path, huge: Path, serve: Callable[..., Served]) -> None:
    """The stream's size from its headers is compared before decoding, and the probe at
    open cannot decode the frame (FFmpeg's ``max_pixels``): before, the frame was decoded
    at open and again by the read (+583 MiB kept, 18 s)."""
    layout = lr.Layout(lengths=(5, 4), per_file=1, cameras=lr.Layout.cameras[:1])
    root = lr.write(tmp_path / "ds", layout)
    target = root / lr.VIDEO_PATH.format(video_key=layout.cameras[0], chunk_index=0,
                                         file_index=0)
    target.write_bytes(huge.read_bytes())
    assert target.stat().st_size < 2 * bombs.MiB
    served = serve(root)
    text = refused_frame(served)
    assert "14000x14000 (HxW), but info.json declares 32x48" in text
    assert served.read(TOP, [("episode_000001", 0)]).frames  # the good file beside it


@pytest.mark.slow  # builds its file in a child process
def test_3000_frames_in_three_quarters_of_a_second_are_refused_after_a_few_dozen(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """An 80 KB mp4 of 3,000 frames of 320x320 in 0.75 s where ``fps`` is 10: the read
    stops once packets come faster than 4x the declared rate (after 33, while its
    keyframes are listed: nothing decoded); long ago, every frame of the window was
    converted to RGB and kept (and served)."""
    layout = lr.Layout(lengths=(8, 8), per_file=1, cameras=lr.Layout.cameras[:1],
                       size=(320, 320))
    root = lr.write(tmp_path / "ds", layout)
    target = root / lr.VIDEO_PATH.format(video_key=layout.cameras[0], chunk_index=0,
                                         file_index=0)
    bombs.dense_video(target)
    assert target.stat().st_size < 256 * 1024
    served = serve(root)
    text = refused_frame(served)
    # the first read lists the file's keyframes: its packets come too fast, nothing decoded
    assert "33 packets demuxed between 0.0 s and" in text and "fps 10.0" in text
    assert served.stats.video_frames_decoded == 0
    served.read(TOP, [("episode_000001", 5)])
    good = root / lr.VIDEO_PATH.format(video_key=layout.cameras[0], chunk_index=0,
                                       file_index=1)
    with av.open(str(good)) as container:
        stream = container.streams.video[0]
        key = max(round(float(p.pts * stream.time_base) * lr.FPS)
                  for p in container.demux(stream) if p.is_keyframe and p.pts is not None
                  and float(p.pts * stream.time_base) <= 0.5 + 1e-9)
    # the good file: frame 5 alone converted, decoded from its keyframe
    assert served.stats.video_frames_converted == 1
    assert served.stats.video_frames_decoded == 5 - key + 1


def test_only_the_frame_nearest_each_time_is_converted(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """A video at 4x the declared rate (within the bound): each wanted time is served by
    the frame exactly at it, and only those 8 frames are converted, not the 29 decoded."""
    layout = lr.Layout(lengths=(8,), per_file=1, cameras=lr.Layout.cameras[:1])
    root = lr.write(tmp_path / "ds", layout)
    target = root / lr.VIDEO_PATH.format(video_key=layout.cameras[0], chunk_index=0,
                                         file_index=0)
    bombs.encode(target, layout.size, 32, 4 * lr.FPS, child=False)
    served = serve(root)
    result = served.read(TOP, [("episode_000000", f) for f in range(8)])
    assert len(result.frames["observation.images.top"]) == 8
    assert served.stats.video_frames_converted == 8
    assert served.stats.video_frames_decoded == 29  # frames 0.0 .. 0.7 s at 40 a second


@pytest.mark.parametrize("codec", [
    "mpeg4",
    pytest.param("libx265", marks=pytest.mark.slow),  # encoded in a child process
    pytest.param("libsvtav1", marks=pytest.mark.slow),
])
def test_videos_of_other_codecs_decode_within_the_pixel_limit(
        tmp_path: Path, serve: Callable[..., Served], codec: str) -> None:
    """The pixel limit leaves each decoder the room it asks for (mpeg4 asks 53,760 pixels
    for a 32x48 frame): every frame equals PyAV's own decode of the file."""
    layout = lr.Layout(lengths=(6,), per_file=1, cameras=lr.Layout.cameras[:1])
    root = lr.write(tmp_path / "ds", layout)
    target = root / lr.VIDEO_PATH.format(video_key=layout.cameras[0], chunk_index=0,
                                         file_index=0)
    bombs.reencode(target, codec, child=codec != "mpeg4")
    truth = lr.decoded_frames(target)
    result = served_frames(serve(root), 6)
    for f in range(6):
        assert np.array_equal(result[f], truth[round(f / lr.FPS, 6)]), (codec, f)


def served_frames(served: Served, n: int) -> list[np.ndarray]:
    result = served.read(TOP, [("episode_000000", f) for f in range(n)])
    column, frames = result.images["top"], result.frames["observation.images.top"]
    out = []
    for b in range(n):
        data = frames[int(column.index[b])]
        size = rawframe.size_of(data)
        assert size is not None
        out.append(np.frombuffer(data, np.uint8, offset=rawframe.HEADER_BYTES)
                   .reshape(*size, 3))
    return out


def _varint(n: int, width: int) -> bytes:
    out = bytearray()
    for k in range(width):
        out.append((n >> (7 * k)) & 0x7F | (0x80 if k < width - 1 else 0))
    return bytes(out)


def test_a_page_header_claiming_more_than_the_footer_is_refused_before_decoding(
        tmp_path: Path, serve: Callable[..., Served], monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow sizes a page's buffer from its header: a header declaring more than the
    read's bound (4 KiB here; 512 MiB by default) is refused from the header, although
    the footer's sizes are within it."""
    monkeypatch.setattr(files, "MAX_READ_BYTES", 4096)
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(48,), cameras=()))
    path = root / lr.DATA_PATH.format(chunk_index=0, file_index=0)
    pq.write_table(pq.read_table(path), path, compression="none", use_dictionary=False)
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    assert chunk.path_in_schema.startswith("observation.state")
    assert chunk.total_uncompressed_size < 4096 and 8 * chunk.num_values < 4096
    data = bytearray(path.read_bytes())
    at = chunk.data_page_offset
    assert data[at] == 0x15 and data[at + 2] == 0x15  # field 1 (type), field 2 (its size)
    width = next(k for k in range(5) if not data[at + 3 + k] & 0x80) + 1
    data[at + 3: at + 3 + width] = _varint(2 * ((1 << (7 * width - 1)) - 1), width)
    path.write_bytes(bytes(data))
    served = serve(root)
    with pytest.raises(DataLossError) as info:
        served.read(STATE, [("episode_000000", 3)])
    text = str(info.value)
    assert "'episode_000000'" in text and "'observation.state'" in text
    assert "has pages that decompress to" in text and "more than 4096" in text
