"""A LeRobot dataset root (v3.0, v2.1 or v2.0) as a source of catalog episodes.

The catalog asks a root with ``meta/info.json`` for its episode names (``episode_<index:06d>``)
and opens each through :meth:`LeRobotSource.open`: the episode's row of ``meta/episodes``
checked, its data file's row count checked against the rows the episode claims, each
numeric feature a :class:`ParquetReader`, each video feature a :class:`VideoReader`, and the
tasks a :class:`TaskReader` under the key ``task``. A v2.x root lists its episodes in
``meta/episodes.jsonl`` and its tasks in ``meta/tasks.jsonl``, one data file and one video per
episode and camera (each video starting at 0 s); an episode's global first row is the sum of
the lengths listed before it, as LeRobot's writer numbers them, and its data file must hold
exactly the rows the listing says. A problem of one episode's metadata makes
that episode broken (listed with its reason), never the dataset. A dataset refused whole
(its ``info.json``, tasks or episode files) lists one broken entry, ``lerobot_dataset``,
with the reason, and a read of any episode of it is refused with that reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from typing import Any

import numpy as np
import pyarrow as pa
from zarr.core.buffer import default_buffer_prototype

from episerve_proto.errors import BrokenEpisodeError, DataLossError, LimitExceeded
from episerve_server.core.ledger import EpisodeState
from episerve_server.storage.confined_root import ConfinedLocalStore
from episerve_server.storage.episode import Episode
from episerve_server.storage.lerobot.columns import FileProblem
from episerve_server.storage.lerobot.files import OpenFiles
from episerve_server.storage.lerobot.meta import (
    DEFAULT_TOLERANCE_S,
    EPISODES_DIR,
    EPISODES_JSONL,
    INFO_PATH,
    MAX_EPISODES,
    MAX_FILES,
    MAX_JSONL_BYTES,
    MAX_JSONL_LINE,
    MAX_TASK_BYTES,
    MAX_TASKS,
    TASKS_JSONL,
    TASKS_PATH,
    EpisodeMeta,
    Info,
    MetaError,
    episode_columns,
    episode_of,
    episode_of_v2,
    file_offsets,
    parse_info,
    safe_path,
)
from episerve_server.storage.lerobot.readers import (
    TASK_INDEX,
    TASK_KEY,
    ParquetReader,
    TaskReader,
)
from episerve_server.storage.lerobot.video import VideoReader
from episerve_server.storage.listed_once import ListedOnce, episode_name, file_problem
from episerve_server.storage.store import CountingStore, Refused

log = logging.getLogger(__name__)

#: The one entry a refused dataset lists, broken with its reason (it has no episodes).
REFUSED_ENTRY = "lerobot_dataset"
#: The column LeRobot finds a row's video frame by.
TIMESTAMP = "timestamp"
#: Under what the episode-state ledger counts the root's listing (kept with the root).
LISTING = "(meta/episodes)"
#: An episode's kept metadata (EpisodeMeta, its name and data path), and one more per video
#: (its VideoSpan, path and tuple): 1,060 bytes an episode of two videos measured with
#: tracemalloc.
META_BYTES = 640
VIDEO_SPAN_BYTES = 256


class LeRobotSource(ListedOnce):
    """The episodes of one LeRobot root (a local folder), loaded once at the first scan:
    a ``storage.sources.Source``."""

    layout = "LeRobot"
    refused_name, what, listing = REFUSED_ENTRY, "LeRobot dataset", LISTING
    load_errors = (MetaError, FileProblem, Refused, OSError, pa.ArrowException, LimitExceeded)

    def __init__(self, store: CountingStore, local: ConfinedLocalStore, *,
                 tolerance_s: float = DEFAULT_TOLERANCE_S,
                 state: EpisodeState | None = None) -> None:
        super().__init__(state)
        self.store = store
        self.files = OpenFiles(local)
        self.tolerance_s = tolerance_s
        self.info: Info | None = None
        self.episodes: dict[str, EpisodeMeta | str] = {}  # name -> metadata, or why broken
        self.tasks: dict[int, str] = {}
        self._offsets: dict[str, int] = {}
        self._data: dict[str, asyncio.Future[tuple[int, frozenset[str]]]] = {}

    def _forget(self) -> None:
        self.episodes = {}

    def _names(self) -> set[str]:
        return set(self.episodes)

    async def exists(self, name: str) -> bool:
        return name in self.episodes

    async def open(self, name: str, *, serving: bool = False, sizes: str = "") -> Episode:
        """One episode; ``BrokenEpisodeError`` says why it cannot be served."""
        try:
            return await self._open(name)
        except MetaError as exc:
            raise BrokenEpisodeError(str(exc), episode=name) from exc

    async def _load(self) -> None:
        cap = self.store.max_metadata_bytes
        buf = await self.store.get(INFO_PATH, default_buffer_prototype(), max_bytes=cap)
        if buf is None:
            raise MetaError(f"{INFO_PATH} is missing")
        info = self.info = parse_info(buf.to_bytes())
        if info.v2:
            await self._load_v2(info)
            return
        self.tasks = await self._tasks()
        rows: list[dict[str, Any]] = []
        columns = dict.fromkeys(episode_columns(info), "number")
        for path in await self._episode_files():
            got = await self.files.run(lambda p=path: self.files.rows(  # type: ignore[misc]
                p, columns, MAX_EPISODES - len(rows)))
            n = len(next(iter(got.values()), []))
            if self.state is not None:  # each row is kept as an episode's metadata
                videos = sum(f.kind == "video" for f in info.features.values())
                self.state.kept(LISTING).charge(
                    path, n * (META_BYTES + VIDEO_SPAN_BYTES * videos),
                    f"the listing of {n} episodes with {videos} videos each")
            rows.extend({c: got[c][k] for c in got} for k in range(n))
        good: list[EpisodeMeta] = []
        for k, row in enumerate(rows):
            index = row.get("episode_index")
            name = episode_name(index) if isinstance(index, int) and 0 <= index < 10**8 \
                else f"episode_row_{k:06d}"
            try:
                meta = episode_of(row, info)
            except MetaError as exc:
                self.episodes[name] = f"meta/episodes row of {name}: {exc}"
                continue
            self._add(name, meta, "meta/episodes", good)
        self._offsets = file_offsets(good)

    async def _load_v2(self, info: Info) -> None:
        """A v2.x listing: ``meta/tasks.jsonl`` and ``meta/episodes.jsonl``."""
        self.tasks = {}
        for k, line in enumerate(await self._jsonl(TASKS_JSONL, MAX_TASKS, required=False)):
            index, text = (line.get("task_index"), line.get("task")) \
                if isinstance(line, dict) else (None, None)
            if isinstance(index, bool) or not isinstance(index, int) \
                    or not isinstance(text, str) or len(text.encode()) > MAX_TASK_BYTES:
                raise MetaError(f"{TASKS_JSONL} line {k + 1}: a task must be an int "
                                f"'task_index' and a 'task' text of at most {MAX_TASK_BYTES} "
                                "bytes")
            self.tasks[index] = text
        lines = await self._jsonl(EPISODES_JSONL, MAX_EPISODES)
        if self.state is not None:
            videos = sum(f.kind == "video" for f in info.features.values())
            self.state.kept(LISTING).charge(
                EPISODES_JSONL, len(lines) * (META_BYTES + VIDEO_SPAN_BYTES * videos),
                f"the listing of {len(lines)} episodes with {videos} videos each")
        good: list[EpisodeMeta] = []
        first = 0
        for k, line in enumerate(lines):
            index = line.get("episode_index") if isinstance(line, dict) else None
            name = episode_name(index) if isinstance(index, int) and 0 <= index < 10**8 \
                else f"episode_row_{k:06d}"
            try:
                meta = episode_of_v2(line, info, first)
            except MetaError as exc:
                self.episodes[name] = f"{EPISODES_JSONL} line {k + 1} ({name}): {exc}"
                continue
            first += meta.length
            self._add(name, meta, EPISODES_JSONL, good)
        self._offsets = file_offsets(good)

    def _add(self, name: str, meta: EpisodeMeta, listing: str,
             good: list[EpisodeMeta]) -> None:
        """A listed episode kept; one listed twice is broken, saying so."""
        if name in self.episodes:
            self.episodes[name] = f"{listing} lists {name} more than once"
            return
        self.episodes[name] = meta
        good.append(meta)

    async def _jsonl(self, path: str, max_lines: int, *, required: bool = True
                     ) -> list[Any]:
        """A JSON-lines metadata file, read whole (at most ``MAX_JSONL_BYTES``)."""
        buf = await self.store.get(path, default_buffer_prototype(), max_bytes=MAX_JSONL_BYTES)
        if buf is None:
            if required:
                raise MetaError(f"{path} is missing")
            return []
        out: list[Any] = []
        for k, line in enumerate(buf.to_bytes().splitlines()):
            if not line.strip():
                continue
            if len(out) >= max_lines or len(line) > MAX_JSONL_LINE:
                raise MetaError(f"{path}: more than {max_lines} lines, or line {k + 1} over "
                                f"{MAX_JSONL_LINE} bytes")
            try:
                out.append(json.loads(line))
            except (ValueError, RecursionError) as exc:
                raise MetaError(f"{path} line {k + 1} is not JSON ({type(exc).__name__})"
                                ) from None
        return out

    async def _episode_files(self) -> list[str]:
        paths = []
        async for chunk in self.store.list_dir(EPISODES_DIR):
            if chunk.startswith("chunk-"):
                async for name in self.store.list_dir(f"{EPISODES_DIR}/{chunk}"):
                    if name.startswith("file-") and name.endswith(".parquet"):
                        paths.append(safe_path(f"{EPISODES_DIR}/{chunk}/{name}"))
                    if len(paths) > MAX_FILES:
                        raise MetaError(f"{EPISODES_DIR} holds more than {MAX_FILES} files")
        if not paths:
            raise MetaError(f"{EPISODES_DIR} holds no chunk-*/file-*.parquet")
        return sorted(paths)

    async def _tasks(self) -> dict[int, str]:
        def read() -> dict[str, list[Any]]:
            text = "task" if "task" in self.files.names(TASKS_PATH) else "__index_level_0__"
            return self.files.rows(TASKS_PATH, {"task_index": "number", text: "text"},
                                   MAX_TASKS, MAX_TASK_BYTES)

        try:
            got = await self.files.run(read)
        except FileNotFoundError:
            return {}
        texts = got.get("task", got.get("__index_level_0__"))
        if texts is None or "task_index" not in got:
            raise MetaError(f"{TASKS_PATH} must have columns 'task_index' and 'task' (or a "
                            "task index)")
        out = {}
        for index, text in zip(got["task_index"], texts):
            if not isinstance(index, int) or not isinstance(text, str) \
                    or len(text.encode()) > MAX_TASK_BYTES:
                raise MetaError(f"{TASKS_PATH}: task {index!r} must be an int index and a "
                                f"text of at most {MAX_TASK_BYTES} bytes")
            out[index] = text
        return out

    async def _open(self, name: str) -> Episode:
        """One episode; ``MetaError`` or a file problem says why it cannot be served."""
        if self.problem:
            raise MetaError(self.refusal())
        info = self.info
        meta = self.episodes.get(name)
        if info is None or meta is None:
            raise MetaError(f"{name!r} is not listed in {EPISODES_DIR}")
        if isinstance(meta, str):
            raise MetaError(meta)
        rows, columns = await self._data_file(meta.data_path)
        if info.v2 and rows != meta.length:
            raise MetaError(f"{EPISODES_JSONL} gives {name} {meta.length} frames, but its data "
                            f"file {meta.data_path!r} holds {rows} rows")
        row0 = meta.from_index - self._offsets[meta.data_path]
        if row0 + meta.length > rows:
            raise MetaError(f"rows {row0}..{row0 + meta.length} of {meta.data_path!r} were "
                            f"asked for (dataset_from_index={meta.from_index}, "
                            f"length={meta.length}), but it holds {rows}")
        opened = Episode(name, meta.length, info.fps, info.robot_type, {}, {})
        features: dict[str, Any] = {}
        for key, feature in info.features.items():
            if feature.kind != "numeric":
                continue
            if key not in columns:
                opened.problems[key] = f"{meta.data_path!r} has no column {key!r}"
                continue
            opened.readers[key] = ParquetReader(name, feature, self.files, meta.data_path,
                                                row0, meta.length)
            features[key] = {"dtype": feature.dtype, "shape": list(feature.shape)}
        for key, span in meta.videos:
            feature = info.features[key]
            if not await self.store.exists(span.path):
                opened.problems[key] = f"video file {span.path!r} is missing"
                continue
            identity = await asyncio.to_thread(self.files.identity, span.path)
            opened.readers[key] = VideoReader(name, feature, self.files, span, meta.length,
                                              info.fps, self.tolerance_s, self.store.stats,
                                              identity)
            features[key] = {"dtype": "video", "shape": list(feature.shape)}
        if meta.videos and TIMESTAMP in opened.readers:
            await self._check_timestamps(opened, meta.data_path, row0)
        if TASK_INDEX in columns:
            opened.readers[TASK_KEY] = TaskReader(name, self.files, meta.data_path, row0,
                                                  meta.length, self.tasks)
        # LeRobot's episode index and the global index of its first frame
        # (``dataset_from_index``): a LeRobot-layout sample's ``episode_index`` and ``index``.
        opened.attrs = {"features": features, "lerobot_episode_index": meta.index,
                        "lerobot_from_index": meta.from_index}
        digest = hashlib.sha256(json.dumps(
            [repr(meta), info.raw_features, rows], sort_keys=True, default=str).encode())
        opened.content_hash = digest.hexdigest()[:16]
        return opened

    async def _check_timestamps(self, opened: Episode, path: str, row0: int) -> None:
        """LeRobot finds a row's video frame by the row's ``timestamp`` column; the daemon by
        ``frame_index / fps``. Where they disagree by more than ``tolerance_s`` the two would
        serve different images, so the episode is refused (listed broken, naming the row and
        both times) rather than served another frame's image silently. The column is read
        once, at open; it has the episode's real rows, not a declared count."""
        reader = opened.readers[TIMESTAMP]
        n = math.ceil(reader.info.rows / reader.info.chunk_rows)
        if n == 0:
            return
        try:
            chunks = await reader.fetch(0, n - 1)
        except DataLossError as exc:  # this episode's column cannot be read: it is broken
            opened.problems[TIMESTAMP] = exc.message
            return
        got = np.concatenate([np.asarray(c).reshape(-1) for c in chunks])[:reader.info.rows]
        # r / fps as the column stores it (float32 as LeRobot writes it; float64 kept so)
        want = (np.arange(reader.info.rows) / opened.fps).astype(got.dtype)
        off = np.flatnonzero(~(np.abs(got.astype(np.float64) - want) <= self.tolerance_s))
        if len(off):
            r = int(off[0])
            opened.problems[TIMESTAMP] = (
                f"row {r} of the episode (row {row0 + r} of {path!r}) has timestamp "
                f"{float(got[r])!r} s, but frame {r} at {opened.fps:g} fps is at "
                f"{float(want[r])!r} s ({len(off)} rows differ by more than tolerance_s="
                f"{self.tolerance_s!r}): LeRobot finds a frame's image by its timestamp, so "
                "the video frames served would not be LeRobot's")

    async def _data_file(self, path: str) -> tuple[int, frozenset[str]]:
        """A data file's row count and columns, read once (concurrent opens share it)."""
        fut = self._data.get(path)
        if fut is None:
            fut = self._data[path] = asyncio.ensure_future(self.files.run(
                lambda: self.files.shape_of(path)))
        try:
            return await asyncio.shield(fut)
        except (FileProblem, Refused, OSError, pa.ArrowException) as exc:
            raise MetaError(f"data file {path!r}: {file_problem(exc)}") from exc
