"""Both layouts the daemon serves pass the shipped source suite
(``episerve_server.testing.SourceTests``), each against an independent reading of its own
files: zarr-python for episode stores, pyarrow and PyAV for LeRobot v3.0. And the suite can
fail: each of its tests, run on the zarr source broken in the one way that test is about,
does not pass, while a faithful wrapper of the same source passes them all."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from episerve_proto import rawframe
from episerve_proto.errors import BrokenEpisodeError
from episerve_server.core.cache import Chunk
from episerve_server.core.counters import Stats
from episerve_server.storage.episode import Episode
from episerve_server.storage.lerobot.source import LeRobotSource
from episerve_server.storage.readers import ChunkReader
from episerve_server.storage.readers.base import decode_chunk
from episerve_server.storage.readers.bounds import DEFAULT_MAX_ITEM_BYTES
from episerve_server.storage.readers.decode import Raw
from episerve_server.storage.sources import Source, ZarrSource
from episerve_server.storage.store import open_root
from episerve_server.testing import Example, Rows, SourceTests
from tests.support import lerobot as lr
from tests.support import ramp

LENGTHS = (30, 25)


def _zarr_rows(path: Path) -> dict[str, Rows]:
    """Every array of one episode store as zarr-python reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(path, mode="r")
        out: dict[str, Rows] = {}
        for key in group.array_keys():
            values = group[key][...]
            if values.dtype.kind in "OSUT":
                out[key] = [v if isinstance(v, bytes) else str(v).encode() for v in values]
            else:
                out[key] = np.asarray(values)
    return out


def _replace(path: Path) -> None:
    """The same bytes in a new file (new inode and mtime): a rewrite in place."""
    data = path.read_bytes()
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def zarr_example(folder: Path) -> Example:
    root = folder / "root"
    for k, n in enumerate(LENGTHS):
        ramp.write_ramp_episode(root, f"ep{k}", episode_no=k, total_frames=n, chunk_rows=10)
    (root / "bad.zarr").mkdir()
    (root / "bad.zarr" / "zarr.json").write_text("{not json")
    rows = {f"ep{k}": _zarr_rows(root / f"ep{k}.zarr") for k in range(len(LENGTHS))}

    def rewrite(name: str) -> None:
        _replace(root / f"{name}.zarr" / "zarr.json")

    store = open_root(str(root), stats=Stats())
    return Example(source=ZarrSource(store, DEFAULT_MAX_ITEM_BYTES),
                   entries=sorted(os.listdir(root)),
                   keys={name: set(got) for name, got in rows.items()}, rows=rows,
                   refused={"bad": "unreadable group metadata"}, rewrite=rewrite)


class TestZarrSource(SourceTests):
    def example(self, folder: Path) -> Example:
        return zarr_example(folder)


def _task_spans(task_index: list[int], tasks: Sequence[str]) -> list[bytes]:
    """The ``task`` key as docs/LEROBOT.md states it: one annotation span per run of frames
    with the same ``task_index``, in docs/FORMAT.md's form (``text``, ``start_idx``,
    ``end_idx`` exclusive), then empty rows up to the episode's length."""
    spans: list[bytes] = []
    start = 0
    for f in range(1, len(task_index) + 1):
        if f == len(task_index) or task_index[f] != task_index[start]:
            spans.append(json.dumps({"text": tasks[task_index[start]], "start_idx": start,
                                     "end_idx": f}).encode())
            start = f
    return spans + [b""] * (len(task_index) - len(spans))


class TestLeRobotSource(SourceTests):
    def example(self, folder: Path) -> Example:
        layout = lr.Layout(lengths=(5, 4, 6), per_file=2,
                           frame_tasks={2: [0, 0, 1, 1, 1, 0]})  # three runs in one episode
        root = lr.write(folder / "root", layout)
        store = open_root(str(root), stats=Stats())
        local = store.local_root()
        assert local is not None
        videos = lr.videos(root, layout)
        h, w = layout.size
        keys: dict[str, set[str]] = {}
        rows: dict[str, dict[str, Rows]] = {}
        for ep in range(len(layout.lengths)):
            name = f"episode_{ep:06d}"
            _, length, file, start_s = lr.place(layout, name)
            table = pq.read_table(root / lr.DATA_PATH.format(chunk_index=0, file_index=file))
            mine = table.filter(table.column("episode_index").to_numpy() == ep)
            got: dict[str, Rows] = {}
            for column in mine.column_names:
                values = np.array(mine.column(column).to_pylist(), dtype=np.float64)
                got[column] = values.astype(np.float32).reshape(length, -1)
            for cam in layout.cameras:
                frames = videos[(cam, file)]
                times = np.array(sorted(frames))
                got[cam] = []
                for f in range(length):
                    at = times[np.abs(times - (start_s + f / lr.FPS)).argmin()]
                    got[cam].append(rawframe.pack(h, w, frames[float(at)].tobytes()))
            got["task"] = _task_spans(mine.column("task_index").to_pylist(), layout.tasks)
            keys[name] = set(got)
            rows[name] = got
        return Example(source=LeRobotSource(store, local), entries=sorted(os.listdir(root)),
                       keys=keys, rows=rows)


class TestLeRobot21Source(SourceTests):
    """A v2.1 root: one data file and one video per episode; ``meta/episodes.jsonl`` lists
    them, and an episode whose listed length is not its file's row count is refused."""

    def example(self, folder: Path) -> Example:
        layout = lr.Layout(lengths=(5, 4, 6, 3), frame_tasks={2: [0, 0, 1, 1, 1, 0]})
        root = lr.write_v21(folder / "root", layout)
        listing = root / "meta" / "episodes.jsonl"
        lines = listing.read_text().splitlines()
        lines[3] = json.dumps({"episode_index": 3, "tasks": ["pick the cube"], "length": 4})
        listing.write_text("\n".join(lines) + "\n")  # episode 3's file holds 3 rows
        store = open_root(str(root), stats=Stats())
        local = store.local_root()
        assert local is not None
        h, w = layout.size
        keys: dict[str, set[str]] = {}
        rows: dict[str, dict[str, Rows]] = {}
        for ep, length in enumerate(layout.lengths[:3]):
            name = f"episode_{ep:06d}"
            table = pq.read_table(root / lr.V21_DATA_PATH.format(episode_chunk=0,
                                                                  episode_index=ep))
            got: dict[str, Rows] = {}
            for column in table.column_names:
                values = np.array(table.column(column).to_pylist(), dtype=np.float64)
                got[column] = values.astype(np.float32).reshape(length, -1)
            for cam in layout.cameras:
                frames = lr.decoded_frames(lr.v21_video(root, cam, ep))
                times = np.array(sorted(frames))
                got[cam] = [rawframe.pack(h, w, frames[float(
                    times[np.abs(times - f / lr.FPS).argmin()])].tobytes())
                    for f in range(length)]
            got["task"] = _task_spans(table.column("task_index").to_pylist(), layout.tasks)
            keys[name] = set(got)
            rows[name] = got
        return Example(source=LeRobotSource(store, local), entries=sorted(os.listdir(root)),
                       keys=keys, rows=rows,
                       refused={"episode_000003": "gives episode_000003 4 frames, but its "
                                                  "data file"})


# -- the suite can fail ----------------------------------------------------------------------

SUITE = sorted(name for name in dir(SourceTests) if name.startswith("test_"))
#: The faults each test of the suite is there to catch.
FAULTS: dict[str, tuple[str, ...]] = {
    "test_lists_exactly_the_root_episodes": ("lists an episode that is not there",),
    "test_each_episode_opens_with_its_keys": ("a key short",),
    "test_every_row_equals_an_independent_reading": ("a wrong row", "frames off by one"),
    "test_an_episode_it_cannot_serve_is_refused_in_one_line": (
        "a refusal that leaks a traceback", "refuses without saying which episode"),
    "test_a_rewritten_episode_changes_its_fingerprint": ("a fingerprint that never changes",),
    "test_exists_says_which_episodes_are_there": ("every episode exists",),
}


class _Rows(ChunkReader):
    """``real``, its decoded rows broken by ``fault``."""

    def __init__(self, real: ChunkReader, fault: str | None) -> None:
        super().__init__(real.info, self._decode)
        self.real, self.fault = real, fault

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        raws = await self.real.fetch(first, last)  # decoded here: some come decoded
        chunks = [self._decode(raw, first + k) for k, raw in enumerate(raws)]
        if self.fault == "frames off by one" and self.info.is_bytes and len(chunks) > 1:
            return [*chunks[1:], chunks[0]]  # a frame a chunk: each shows the next one
        return chunks

    def _decode(self, raw: Raw | Chunk, index: int) -> Chunk:
        chunk = decode_chunk(self.real, raw, index)
        if self.fault == "a wrong row" and isinstance(chunk, np.ndarray) and len(chunk) > 3:
            chunk = chunk.copy()
            chunk[2] = chunk[3]
        if self.fault == "frames off by one" and isinstance(chunk, list) and len(chunk) > 1:
            chunk = [*chunk[1:], chunk[0]]
        return chunk


class _Broken:
    """The zarr source with one fault (None: none, a faithful wrapper)."""

    def __init__(self, real: Source, fault: str | None) -> None:
        self.real, self.fault = real, fault
        self.layout, self.tracks_changes = real.layout, real.tracks_changes

    async def names(self, entries: Iterable[str]) -> set[str]:
        names = await self.real.names(entries)
        return names | {"ghost"} if self.fault == "lists an episode that is not there" \
            else names

    def refused_entry(self) -> str:
        return self.real.refused_entry()

    def refusal(self) -> str:
        return self.real.refusal()

    async def fingerprint(self, names: list[str]) -> list[tuple[str, str]]:
        if self.fault == "a fingerprint that never changes":
            return [("same", "")] * len(names)
        return await self.real.fingerprint(names)

    async def open(self, name: str, *, serving: bool, sizes: str) -> Episode:
        try:
            episode = await self.real.open(name, serving=serving, sizes=sizes)
        except BrokenEpisodeError as exc:
            if self.fault == "a refusal that leaks a traceback":
                raise BrokenEpisodeError(f"{exc.message}\nTraceback (most recent call last):"
                                         '\n  File "x.py", line 1', episode=name) from None
            if self.fault == "refuses without saying which episode":
                raise BrokenEpisodeError(exc.message, episode="") from None
            raise
        readers = dict(episode.readers)
        if self.fault == "a key short":
            readers.pop(sorted(readers)[0])
        episode.readers = {k: _Rows(r, self.fault) for k, r in readers.items()}
        return episode

    async def exists(self, name: str) -> bool:
        return True if self.fault == "every episode exists" else await self.real.exists(name)


def _suite(fault: str | None) -> SourceTests:
    class Broken(TestZarrSource):
        def wrap(self, source: Source) -> Source:
            return _Broken(source, fault)

    return Broken()


def _outcome(suite: SourceTests, test: str, tmp_path: Path) -> str:
    try:
        getattr(suite, test)(tmp_path)
    except AssertionError:
        return "failed"
    return "passed"


def test_every_test_of_the_suite_is_checked() -> None:
    assert sorted(FAULTS) == SUITE


@pytest.mark.parametrize("test", SUITE)
def test_each_test_passes_a_faithful_source_and_fails_its_broken_ones(
        test: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    assert _outcome(_suite(None), test, tmp_path_factory.mktemp("faithful")) == "passed"
    for fault in FAULTS[test]:
        got = _outcome(_suite(fault), test, tmp_path_factory.mktemp("broken"))
        assert got == "failed", (test, fault)
