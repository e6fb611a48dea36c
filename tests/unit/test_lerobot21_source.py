"""LeRobot v2.1 and v2.0 roots: what they are refused for, each by name, while the rest of
the root is served (the rows themselves: the source suite, test_source_conformance.py)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from episerve_proto.errors import BrokenEpisodeError
from episerve_server.core.counters import Stats
from episerve_server.storage.lerobot.source import LeRobotSource
from episerve_server.storage.store import open_root
from tests.support import lerobot as lr

LAYOUT = lr.Layout(lengths=(5, 4, 6))


def _source(root: Path) -> tuple[LeRobotSource, set[str]]:
    store = open_root(str(root), stats=Stats())
    local = store.local_root()
    assert local is not None
    source = LeRobotSource(store, local)
    return source, asyncio.run(source.names(sorted(os.listdir(root))))


def _open(source: LeRobotSource, name: str) -> Any:
    return asyncio.run(source.open(name))


def test_a_missing_video_breaks_its_episode_naming_the_file(tmp_path: Path) -> None:
    root = lr.write_v21(tmp_path / "root", LAYOUT)
    lr.v21_video(root, "observation.images.wrist", 1).unlink()
    source, names = _source(root)
    assert names == {"episode_000000", "episode_000001", "episode_000002"}
    episode = _open(source, "episode_000001")
    assert episode.problems["observation.images.wrist"] == (
        "video file 'videos/chunk-000/observation.images.wrist/episode_000001.mp4' is missing")
    assert not _open(source, "episode_000002").problems


def test_a_length_the_data_file_disagrees_with_refuses_that_episode(tmp_path: Path) -> None:
    root = lr.write_v21(tmp_path / "root", LAYOUT)
    listing = root / "meta" / "episodes.jsonl"
    lines = [json.loads(line) for line in listing.read_text().splitlines()]
    lines[0]["length"] = 3  # its file holds 5 rows: fewer listed is refused too
    listing.write_text("".join(json.dumps(line) + "\n" for line in lines))
    source, _ = _source(root)
    with pytest.raises(BrokenEpisodeError) as info:
        _open(source, "episode_000000")
    assert info.value.message == (
        "meta/episodes.jsonl gives episode_000000 3 frames, but its data file "
        "'data/chunk-000/episode_000000.parquet' holds 5 rows")
    assert _open(source, "episode_000001").total_frames == 4
    # the global index of later episodes follows the listing, as LeRobot numbers them
    assert _open(source, "episode_000002").attrs["lerobot_from_index"] == 3 + 4


def test_a_bad_line_of_the_listing_breaks_only_its_episode(tmp_path: Path) -> None:
    root = lr.write_v21(tmp_path / "root", LAYOUT)
    listing = root / "meta" / "episodes.jsonl"
    lines = listing.read_text().splitlines()
    lines[1] = json.dumps({"episode_index": 1, "tasks": [], "length": -4})
    listing.write_text("\n".join(lines) + "\n")
    source, names = _source(root)
    assert "episode_000001" in names
    with pytest.raises(BrokenEpisodeError, match=r"line 2 \(episode_000001\): 'length' must"):
        _open(source, "episode_000001")
    assert _open(source, "episode_000000").total_frames == 5


@pytest.mark.parametrize(("field", "value", "said"), [
    ("data_path", "data/{chunk_index:03d}/episode_{episode_index:06d}.parquet",
     "may name only episode_chunk and episode_index"),
    ("codebase_version", "v1.6", "'codebase_version' must be v2.0, v2.1 or"),
])
def test_a_root_whose_info_cannot_be_served_is_refused_whole(tmp_path: Path, field: str,
                                                             value: str, said: str) -> None:
    root = lr.write_v21(tmp_path / "root", LAYOUT)
    path = root / "meta" / "info.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {field: value}))
    source, names = _source(root)
    assert names == {"lerobot_dataset"}
    assert said in source.refusal(), source.refusal()


def test_a_v20_root_is_served_as_v21(tmp_path: Path) -> None:
    """v2.0 differs from v2.1 only by its statistics file (``meta/stats.json``)."""
    root = lr.write_v21(tmp_path / "root", LAYOUT)
    path = root / "meta" / "info.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"codebase_version": "v2.0"}))
    source, names = _source(root)
    assert len(names) == 3
    episode = _open(source, "episode_000002")
    assert episode.total_frames == 6 and not episode.problems
    assert "observation.images.top" in episode.readers and "task" in episode.readers


def test_an_episode_listed_twice_is_broken_saying_so(tmp_path: Path) -> None:
    root = lr.write_v21(tmp_path / "root", LAYOUT)
    listing = root / "meta" / "episodes.jsonl"
    lines = listing.read_text().splitlines()
    listing.write_text("\n".join([*lines, lines[1]]) + "\n")
    source, names = _source(root)
    assert names == {"episode_000000", "episode_000001", "episode_000002"}
    with pytest.raises(BrokenEpisodeError,
                       match=r"meta/episodes\.jsonl lists episode_000001 more than once"):
        _open(source, "episode_000001")
    assert _open(source, "episode_000002").total_frames == 6
