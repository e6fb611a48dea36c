"""Chunk readers over a LeRobot episode: a numeric feature's rows from its parquet file and
the task texts as annotation spans (a video feature's frames: :mod:`.video`).

They are ``ChunkReader``s like the zarr readers, so the planner, the single-flight fetcher
and the chunk cache treat them alike: a chunk is ``chunk_rows`` rows of the episode, a run
of touched chunks is one read (one set of row groups; one seek and one pass of decoding for
video), and decoded chunks are cached once for every client.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from episerve_server.core.cache import Chunk
from episerve_server.core.spans import MAX_SPANS
from episerve_server.storage.lerobot.columns import FileProblem
from episerve_server.storage.lerobot.files import OpenFiles
from episerve_server.storage.lerobot.meta import MAX_TASK_BYTES, Feature
from episerve_server.storage.readers import ArrayInfo, ChunkReader, Decoder, Raw
from episerve_server.storage.readers.bounds import MAX_CHUNK_BYTES
from episerve_server.storage.store import Refused

NUMERIC_CHUNK_ROWS = 256
TASK_KEY = "task"
TASK_INDEX = "task_index"


def _no_decoder(info: ArrayInfo) -> Decoder:
    return Decoder(info, (), np.dtype("float32"), 0)


class LeRobotReader(ChunkReader):
    #: its share of a LeRobot episode measured with tracemalloc (6.6 KiB for ten features)
    kept_bytes = 512

    def __init__(self, info: ArrayInfo, files: OpenFiles) -> None:
        super().__init__(info, _no_decoder(info))
        self.files = files

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        return (await self.fetch_runs([(first, last)]))[0]

    async def fetch_runs(self, runs: Sequence[tuple[int, int]]) -> list[list[Raw | Chunk]]:
        try:
            return await self._fetch_runs(runs)
        except Refused as exc:
            raise self.loss(f"file {exc.key!r} refused: {exc.why}") from exc
        except FileProblem as exc:
            raise self.loss(str(exc)) from exc
        except FileNotFoundError as exc:
            raise self.loss(f"file {exc.filename!r} is missing") from exc
        except (OSError, pa.ArrowException) as exc:  # a corrupt page or row group
            raise self.loss(f"read failed ({type(exc).__name__}: {str(exc)[:300]})") from exc

    async def _fetch_runs(self, runs: Sequence[tuple[int, int]]) -> list[list[Raw | Chunk]]:
        return list(await asyncio.gather(*(self._fetch(first, last) for first, last in runs)))

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        raise NotImplementedError

    def _rows(self, first: int, last: int) -> tuple[int, int]:
        c = self.info.chunk_rows
        return first * c, min((last + 1) * c, self.info.rows)


class ParquetReader(LeRobotReader):
    """A numeric feature: rows ``[row0, row0 + length)`` of ``column`` in one data file."""

    def __init__(self, episode: str, feature: Feature, files: OpenFiles, path: str,
                 row0: int, length: int) -> None:
        shape = feature.shape
        per_row = 4 * math.prod(shape)
        chunk = max(1, min(NUMERIC_CHUNK_ROWS, MAX_CHUNK_BYTES // per_row))
        super().__init__(ArrayInfo(episode, feature.name, length, chunk, shape, False, 4), files)
        self.path, self.row0 = path, row0

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        start, stop = self._rows(first, last)
        info, path, row0 = self.info, self.path, self.row0
        block = await self.files.run(lambda: self.files.column(
            path, info.name, row0 + start, row0 + stop, info.feature))
        return [_padded(block[k * info.chunk_rows: (k + 1) * info.chunk_rows], info)
                for k in range(last - first + 1)]


def _padded(rows: np.ndarray, info: ArrayInfo) -> np.ndarray:
    if len(rows) == info.chunk_rows:
        return rows
    pad = np.zeros((info.chunk_rows - len(rows), *info.feature), np.float32)
    return np.concatenate([rows, pad])


class TaskReader(LeRobotReader):
    """The episode's tasks as annotation spans (``{text, start_idx, end_idx}``, one per run
    of frames with the same ``task_index``), from the data file's ``task_index`` column: one
    chunk, read once per episode by the span loader."""

    def __init__(self, episode: str, files: OpenFiles, path: str, row0: int, length: int,
                 tasks: Mapping[int, str]) -> None:
        rows = min(length, MAX_SPANS)
        super().__init__(ArrayInfo(episode, TASK_KEY, rows, rows, (), True, 1, MAX_TASK_BYTES),
                         files)
        self.path, self.row0, self.length, self.tasks = path, row0, length, tasks

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        path, row0, length = self.path, self.row0, self.length
        index = await self.files.run(lambda: self.files.column(
            path, TASK_INDEX, row0, row0 + length, ()))
        return [self._spans(index.astype(np.int64))]

    def _spans(self, index: np.ndarray) -> list[bytes]:
        starts = np.flatnonzero(np.diff(index, prepend=index[0] - 1))
        if len(starts) > self.info.rows:
            raise self.loss(f"{len(starts)} runs of task_index, more than {self.info.rows}")
        items = []
        for k, start in enumerate(starts.tolist()):
            end = int(starts[k + 1]) if k + 1 < len(starts) else len(index)
            task = int(index[start])
            text = self.tasks.get(task)
            if text is None:
                raise self.loss(f"frame {start} has task_index {task}, which "
                                "meta/tasks.parquet does not list")
            items.append(json.dumps({"text": text, "start_idx": start, "end_idx": end}).encode())
        return items + [b""] * (self.info.rows - len(items))
