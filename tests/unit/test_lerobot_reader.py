"""LeRobot v3 roots through the catalog and planner the daemon uses (in process): numeric
features, video frames, task texts, LeRobot's window and padding rule, the tolerance rule,
and broken or hostile metadata."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from episerve_proto import rawframe
from episerve_proto.errors import BrokenEpisodeError, DataLossError
from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.storage.lerobot import files
from episerve_server.storage.lerobot.source import LeRobotSource
from episerve_server.wiring import build_read_core
from tests.support import lerobot as lr
from tests.support.served import LoopRunner, Served

OFFSETS = {"observation.state": [-0.2, -0.1, 0.0], "action": [0.0, 0.1, 0.2, 0.3, 0.4],
           "observation.images.top": [-0.1, 0.0], "observation.images.wrist": [0.0]}
KEYMAP = {
    "observation.state": {"zarr_key": "observation.state", "key_type": "proprio_keys",
                          "offsets_s": OFFSETS["observation.state"]},
    "action": {"zarr_key": "action", "key_type": "action_keys",
               "offsets_s": OFFSETS["action"]},
    "top": {"zarr_key": "observation.images.top", "key_type": "camera_keys",
            "offsets_s": OFFSETS["observation.images.top"]},
    "wrist": {"zarr_key": "observation.images.wrist", "key_type": "camera_keys",
              "offsets_s": OFFSETS["observation.images.wrist"]},
    "task": {"zarr_key": "task", "key_type": "annotation_keys"},
}
LAYOUT = lr.Layout(frame_tasks={2: [0] * 8 + [1] * 12})


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lr.write(tmp_path_factory.mktemp("lerobot") / "ds", LAYOUT)


def samples() -> list[tuple[str, int]]:
    return [(f"episode_{e:06d}", f) for e, n in enumerate(LAYOUT.lengths) for f in range(n)]


def frame_of(result: Any, name: str, b: int, k: int) -> np.ndarray:
    column = result.images[name]
    data = result.frames[column.source][int(column.index[b, k])]
    size = rawframe.size_of(data)
    assert size is not None
    return np.frombuffer(data, np.uint8, offset=rawframe.HEADER_BYTES).reshape(*size, 3)


def test_every_sample_matches_lerobots_rule_and_pyav(root: Path,
                                                     serve: Callable[..., Served]) -> None:
    """Numbers bit-exact, ``_is_pad`` as LeRobot computes it, task texts per frame (episode
    2 changes task at frame 8), and every frame equal to PyAV's own decode of the file."""
    served = serve(root, cache_bytes=64 << 20)
    assert served.catalog.broken_listing() == {}
    everything = samples()
    result = served.read(KEYMAP, everything, all_masks=True)
    truth = lr.videos(root, LAYOUT)
    for b, (name, frame) in enumerate(everything):
        ep, length, file, start_s = lr.place(LAYOUT, name)
        for out, value in (("observation.state", lr.state_value), ("action", lr.action_value)):
            rows, pad = lr.window(length, frame, OFFSETS[out])
            want = np.stack([value(ep, r) for r in rows])
            assert np.array_equal(result.arrays[out][b].view(np.uint32), want.view(np.uint32))
            assert result.arrays[f"{out}_is_pad"][b].tolist() == pad, (name, frame, out)
        for out, cam in (("top", LAYOUT.cameras[0]), ("wrist", LAYOUT.cameras[1])):
            rows, pad = lr.window(length, frame, OFFSETS[cam])
            assert result.arrays[f"{out}_is_pad"][b].tolist() == pad
            for k, r in enumerate(rows):
                want = truth[cam, file][round(start_s + r / lr.FPS, 6)]
                assert np.array_equal(frame_of(result, out, b, k), want), (name, frame, cam, r)
        assert result.texts["task"][b] == [LAYOUT.tasks[lr.task_of(LAYOUT, ep, frame)]]


def test_each_frame_is_decoded_once_and_cached_for_every_reader(
        root: Path, serve: Callable[..., Served]) -> None:
    """Overlapping windows of one batch decode each needed frame once (chunks of 8 frames);
    a second batch over the same frames decodes none."""
    served = serve(root, cache_bytes=64 << 20)
    keymap = {"top": KEYMAP["top"]}
    batch = [("episode_000002", f) for f in range(1, 16)]  # windows overlap: frames 0..15
    served.read(keymap, batch)
    assert served.stats.video_frames_decoded == 16  # two chunks of 8 frames, each decoded once
    served.read(keymap, batch[::-1])
    assert served.stats.video_frames_decoded == 16


def test_a_timestamp_without_a_frame_names_episode_key_and_time(
        tmp_path: Path, serve: Callable[..., Served], run: LoopRunner) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(6, 6), cameras=lr.Layout.cameras[:1]))
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    col = "videos/observation.images.top/from_timestamp"
    shifted = [t + 0.03 for t in table.column(col).to_pylist()]
    pq.write_table(table.set_column(table.schema.get_field_index(col), col,
                                    pa.array(shifted)), path)
    served = serve(root)
    with pytest.raises(DataLossError) as info:
        served.read({"top": KEYMAP["top"]}, [("episode_000001", 2)])
    text = str(info.value)
    assert "'episode_000001'" in text and "'observation.images.top'" in text
    # the read decodes the one frame it serves, frame 1 (0.6 + 0.03 + 0.1 s), from the
    # keyframe before it: the nearest frame decoded is 0.03 s away
    assert "tolerance_s=0.0001" in text and "frame 1:" in text and "timestamp 0.73 s" in text
    assert "nearest frame is at 0.7 s" in text
    assert served.read({"s": KEYMAP["observation.state"]}, [("episode_000001", 2)])
    # --video-tolerance-s 0.05: the frame 0.03 s off is within it, and served
    core = build_read_core(ServerConfig.from_args(
        [str(root), "--video-tolerance-s", "0.05"], {}))
    run(core.catalog.scan())
    wide = run(core.planner.read(Keymap.parse({"top": KEYMAP["top"]}), [("episode_000001", 2)]))
    assert len(wide.frames["observation.images.top"]) == 2
    with pytest.raises(ValueError, match="video_tolerance_s must be in"):
        ServerConfig.from_args([str(root), "--video-tolerance-s", "0"], {})


def rewrite_info(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((root / "meta/info.json").read_text())
    edit(doc)
    (root / "meta/info.json").write_text(json.dumps(doc))


def edit_episodes(root: Path, edit: Callable[[list[dict[str, Any]]], None]) -> None:
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    rows = pq.read_table(path).to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return lr.write(tmp_path / "ds", lr.Layout(lengths=(5, 4, 6), cameras=()))


def test_inconsistent_episode_rows_break_only_their_episode(
        small: Path, serve: Callable[..., Served]) -> None:
    def edit(rows: list[dict[str, Any]]) -> None:
        rows[1]["length"] = 9  # dataset_to_index - dataset_from_index is 4
        rows[2]["dataset_to_index"] += 40
        rows[2]["length"] += 40  # consistent, but the data file holds fewer rows

    edit_episodes(small, edit)
    served = serve(small)
    broken = served.catalog.broken_listing()
    assert set(broken) == {"episode_000001", "episode_000002"}
    assert "'length' is 9" in broken["episode_000001"]
    assert "'data/chunk-000/file-001.parquet'" in broken["episode_000002"]
    assert "holds 6" in broken["episode_000002"]
    with pytest.raises(BrokenEpisodeError, match="episode_000001"):
        served.read({"s": KEYMAP["observation.state"]}, [("episode_000001", 0)])
    result = served.read({"s": KEYMAP["observation.state"]}, [("episode_000000", 4)])
    assert result.arrays["s"][0, -1].tolist() == lr.state_value(0, 4).tolist()


@pytest.mark.parametrize(("template", "why"), [
    ("../outside/file-{file_index:03d}.parquet", "not a plain relative path"),
    ("/etc/file-{file_index:03d}.parquet", "not a plain relative path"),
    ("data/{chunk_index.__class__}/x.parquet", "may name only"),
])
def test_paths_leaving_the_root_are_refused(small: Path, serve: Callable[..., Served],
                                            template: str, why: str) -> None:
    rewrite_info(small, lambda d: d.update(data_path=template))
    served = serve(small)
    listing = served.catalog.broken_listing()
    lerobot = served.catalog.source
    assert isinstance(lerobot, LeRobotSource)
    assert why in (lerobot.problem + " ".join(listing.values()))
    assert not served.catalog.episodes


def test_a_data_file_linked_outside_the_root_is_refused(
        small: Path, tmp_path: Path, serve: Callable[..., Served]) -> None:
    target = tmp_path / "elsewhere.parquet"
    shutil.move(small / "data/chunk-000/file-000.parquet", target)
    os.symlink(target, small / "data/chunk-000/file-000.parquet")
    served = serve(small)
    broken = served.catalog.broken_listing()
    assert set(broken) == {"episode_000000", "episode_000001"}  # the two in file-000
    assert "outside" in broken["episode_000000"]
    assert "episode_000002" in served.catalog.episodes


def test_a_root_of_another_version_serves_nothing_and_says_why(
        small: Path, serve: Callable[..., Served]) -> None:
    rewrite_info(small, lambda d: d.update(codebase_version="v1.6"))
    served = serve(small)
    assert not served.catalog.episodes
    assert "'v1.6'" in served.catalog.source.problem  # type: ignore[union-attr]
    # a v3.0 root labelled v2.1: its v3 path templates are refused, named
    rewrite_info(small, lambda d: d.update(codebase_version="v2.1"))
    problem = serve(small).catalog.source.problem  # type: ignore[union-attr]
    assert "'data_path'" in problem and "got {chunk_index}" in problem


def test_a_parquet_footer_larger_than_the_bound_is_refused_before_parsing(
        small: Path, serve: Callable[..., Served]) -> None:
    path = small / "data/chunk-000/file-001.parquet"
    data = bytearray(path.read_bytes())
    data[-8:-4] = (2**31).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    served = serve(small)
    broken = served.catalog.broken_listing()
    assert set(broken) == {"episode_000002"}
    assert "footer" in broken["episode_000002"]


def test_a_corrupt_row_group_is_data_loss_naming_episode_and_key(
        small: Path, serve: Callable[..., Served]) -> None:
    path = small / "data/chunk-000/file-001.parquet"
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(0).column(0)  # observation.state of the first rows
    start = column.dictionary_page_offset if column.has_dictionary_page \
        else column.data_page_offset
    data[start: start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))
    served = serve(small)
    with pytest.raises(DataLossError) as info:
        served.read({"s": KEYMAP["observation.state"]}, [("episode_000002", 0)])
    assert "'episode_000002'" in str(info.value) and "'observation.state'" in str(info.value)
    result = served.read({"a": KEYMAP["action"]}, [("episode_000002", 0)])  # other columns
    assert result.arrays["a"][0, 0].tolist() == lr.action_value(2, 0).tolist()


def test_rows_holding_more_values_than_declared_are_refused_from_the_footer(
        small: Path, serve: Callable[..., Served], monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of ``observation.state`` holding 1M values instead of 3, with the read bound
    at 1 MiB (512 MiB by default): the read is refused from the footer's sizes, before
    the row group is decoded."""
    monkeypatch.setattr(files, "MAX_READ_BYTES", 1 << 20)
    path = small / "data/chunk-000/file-001.parquet"
    table = pq.read_table(path)
    rows = table.column("observation.state").to_pylist()
    rows[0] = [0.5] * 1_000_000
    col = table.schema.get_field_index("observation.state")
    pq.write_table(table.set_column(col, "observation.state",
                                    pa.array(rows, pa.list_(pa.float32()))), path,
                   row_group_size=8)
    served = serve(small)
    with pytest.raises(DataLossError) as info:
        served.read({"s": KEYMAP["observation.state"]}, [("episode_000002", 0)])
    assert "'episode_000002'" in str(info.value) and "more than 1048576" in str(info.value)


def test_a_missing_or_garbage_video_fails_only_its_key(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5, 4, 6, 3)))
    top, wrist = (root / lr.VIDEO_PATH.format(video_key=cam, chunk_index=0, file_index=1)
                  for cam in lr.Layout.cameras)
    top.unlink()
    wrist.write_bytes(b"\0not an mp4" * 100)
    served = serve(root)
    assert "video file 'videos/observation.images.top/chunk-000/file-001.mp4' is missing" \
        in served.catalog.broken_listing()["episode_000002"]
    with pytest.raises(BrokenEpisodeError, match=r"observation\.images\.top"):
        served.read({"top": KEYMAP["top"]}, [("episode_000002", 0)])
    with pytest.raises(DataLossError) as info:
        served.read({"wrist": KEYMAP["wrist"]}, [("episode_000002", 0)])
    assert "'observation.images.wrist'" in str(info.value)
    assert "not a video container" in str(info.value)
    result = served.read({"s": KEYMAP["observation.state"]}, [("episode_000002", 1)])
    assert result.arrays["s"][0, -1].tolist() == lr.state_value(2, 1).tolist()
    assert served.read({"top": KEYMAP["top"]}, [("episode_000000", 1)]).frames  # file-000


def test_a_refused_dataset_is_listed_broken_and_its_reads_say_why(
        small: Path, serve: Callable[..., Served]) -> None:
    """A dataset refused whole (here ``fps`` 1e-300 in ``info.json``) lists one broken
    entry with the reason (before: an empty listing, the reason only in the daemon's log);
    a Read of one of its episodes is refused as a broken episode naming the reason."""
    rewrite_info(small, lambda d: d.update(fps=1e-300))
    served = serve(small)
    assert not served.catalog.episodes
    broken = served.catalog.broken_listing()
    assert list(broken) == ["lerobot_dataset"], broken
    assert "'fps' must be a number" in broken["lerobot_dataset"]
    with pytest.raises(BrokenEpisodeError) as caught:
        served.read({"s": {"zarr_key": "observation.state", "key_type": "proprio_keys"}},
                    [("episode_000001", 0)])
    assert caught.value.episode == "episode_000001"
    assert "'fps' must be a number" in caught.value.message
    assert "LeRobot dataset cannot be served" in caught.value.message
    served.run(served.catalog.scan())  # a rescan keeps it listed
    assert list(served.catalog.broken_listing()) == ["lerobot_dataset"]


def test_a_corrupt_episodes_file_serves_nothing_and_says_why(
        small: Path, serve: Callable[..., Served]) -> None:
    path = small / "meta/episodes/chunk-000/file-000.parquet"
    data = bytearray(path.read_bytes())
    data[4: len(data) - 8] = b"\x17" * (len(data) - 12)  # magic and footer length kept
    path.write_bytes(bytes(data))
    served = serve(small)
    assert not served.catalog.episodes
    problem = served.catalog.source.problem  # type: ignore[union-attr]
    assert "meta/episodes/chunk-000/file-000.parquet" in problem


def test_a_row_whose_timestamp_is_not_its_frame_refuses_the_episode(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """LeRobot finds a row's image by its ``timestamp`` column; a row whose timestamp is
    another frame's would get another image from the daemon (which finds it by frame_index
    / fps), so its episode is refused, naming the row and both times. Without a video the
    numbers are read by row either way, and the episode is served."""
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5, 4, 6, 3)))
    path = root / "data/chunk-000/file-001.parquet"  # episodes 2 and 3
    table = pq.read_table(path)
    stamps = table.column("timestamp").to_pylist()
    stamps[2] += 0.1  # episode 2, row 2: at frame 3's time
    table = table.set_column(table.schema.get_field_index("timestamp"), "timestamp",
                             pa.array(stamps, pa.float32()))
    pq.write_table(table, path, row_group_size=8)
    served = serve(root)
    broken = served.catalog.broken_listing()
    assert set(broken) == {"episode_000002"}, broken
    why = broken["episode_000002"]
    assert "row 2 of the episode" in why and "frame 2 at 10 fps is at 0.2" in why, why
    result = served.read({"top": KEYMAP["top"]}, [("episode_000003", 1)])
    assert result.images["top"].index.shape == (1, 2)
    no_video = lr.write(tmp_path / "nv", lr.Layout(lengths=(5, 4, 6, 3), cameras=()))
    table = pq.read_table(no_video / "data/chunk-000/file-001.parquet")
    table = table.set_column(table.schema.get_field_index("timestamp"), "timestamp",
                             pa.array(stamps, pa.float32()))
    pq.write_table(table, no_video / "data/chunk-000/file-001.parquet")
    assert serve(no_video).catalog.broken_listing() == {}


def test_a_timestamp_column_that_cannot_be_read_refuses_only_its_episodes(
        tmp_path: Path, serve: Callable[..., Served]) -> None:
    """The open reads each episode's ``timestamp`` column to check it against its frames;
    a corrupt page there lists that file's episodes broken, naming the key, and the scan
    goes on (before: the DataLossError ended the whole scan, and nothing was served)."""
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(5, 4, 6, 3)))
    path = root / "data/chunk-000/file-001.parquet"  # episodes 2 and 3
    data = bytearray(path.read_bytes())
    group = pq.ParquetFile(path).metadata.row_group(0)
    [column] = [group.column(i) for i in range(group.num_columns)
                if group.column(i).path_in_schema == "timestamp"]
    start = column.dictionary_page_offset if column.has_dictionary_page \
        else column.data_page_offset
    data[start: start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))
    served = serve(root)
    broken = served.catalog.broken_listing()
    assert "episode_000002" in broken and "'timestamp'" in broken["episode_000002"], broken
    assert {"episode_000000", "episode_000001"} <= set(served.catalog.episodes)
    result = served.read({"a": KEYMAP["action"]}, [("episode_000001", 2)])
    assert result.arrays["a"][0, 0].tolist() == lr.action_value(1, 2).tolist()
