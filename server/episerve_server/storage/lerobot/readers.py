"""Chunk readers over a LeRobot episode: a numeric feature's rows from its parquet file, a
video feature's frames decoded from its mp4 file, and the task texts as annotation spans.

They are ``ChunkReader``s like the zarr readers, so the planner, the single-flight fetcher
and the chunk cache treat them alike: a chunk is ``chunk_rows`` rows of the episode, a run
of touched chunks is one read (one set of row groups; one seek and one pass of decoding for
video), and decoded chunks are cached once for every client.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from episerve_proto import rawframe
from episerve_server.core.cache import Chunk
from episerve_server.core.spans import MAX_SPANS
from episerve_server.core.stats import Stats
from episerve_server.storage.lerobot.files import FileProblem, OpenFiles
from episerve_server.storage.lerobot.meta import MAX_TASK_BYTES, Feature, VideoSpan
from episerve_server.storage.readers import ArrayInfo, ChunkReader, Decoder, Raw
from episerve_server.storage.readers.bounds import MAX_CHUNK_BYTES
from episerve_server.storage.store import Refused

NUMERIC_CHUNK_ROWS = 256
VIDEO_CHUNK_ROWS = 8
#: The most frames one video read may decode (from the keyframe before its first frame):
#: a GOP longer than this is refused rather than decoded without end.
MAX_DECODED_FRAMES = 4096
TASK_KEY = "task"
TASK_INDEX = "task_index"


def _no_decoder(info: ArrayInfo) -> Decoder:
    return Decoder(info, (), np.dtype("float32"), 0)


class _LeRobotReader(ChunkReader):
    def __init__(self, info: ArrayInfo, files: OpenFiles) -> None:
        super().__init__(info, _no_decoder(info))
        self.files = files

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        try:
            return await self._fetch(first, last)
        except Refused as exc:
            raise self.loss(f"file {exc.key!r} refused: {exc.why}") from exc
        except FileProblem as exc:
            raise self.loss(str(exc)) from exc
        except FileNotFoundError as exc:
            raise self.loss(f"file {exc.filename!r} is missing") from exc
        except (OSError, pa.ArrowException) as exc:  # a corrupt page or row group
            raise self.loss(f"read failed ({type(exc).__name__}: {str(exc)[:300]})") from exc

    def _rows(self, first: int, last: int) -> tuple[int, int]:
        c = self.info.chunk_rows
        return first * c, min((last + 1) * c, self.info.rows)


class ParquetReader(_LeRobotReader):
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


class TaskReader(_LeRobotReader):
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


class VideoReader(_LeRobotReader):
    """A video feature: frame ``r`` of the episode is the decoded frame nearest to
    ``from_s + r / fps`` in the mp4 file, if one is strictly within ``tolerance_s``."""

    def __init__(self, episode: str, feature: Feature, files: OpenFiles, span: VideoSpan,
                 length: int, fps: float, tolerance_s: float, stats: Stats) -> None:
        h, w, _ = feature.shape
        super().__init__(ArrayInfo(episode, feature.name, length, VIDEO_CHUNK_ROWS, (), True,
                                   1, rawframe.HEADER_BYTES + h * w * 3), files)
        self.span, self.fps, self.tolerance_s, self.size = span, fps, tolerance_s, (h, w)
        self.stats = stats

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        start, stop = self._rows(first, last)
        frames, decoded = await self.files.run(lambda: self._decode(start, stop))
        self.stats.video_frames_decoded += decoded  # (on the loop, as every counter)
        c = self.info.chunk_rows
        out: list[Raw | Chunk] = []
        for k in range(last - first + 1):
            part = frames[k * c: (k + 1) * c]
            out.append(part + [b""] * (c - len(part)))
        return out

    def _decode(self, start: int, stop: int) -> tuple[list[bytes], int]:
        """Frames [start, stop): one seek to the keyframe before the first, one pass; and
        how many frames were converted to RGB."""
        targets = [self.span.from_s + r / self.fps for r in range(start, stop)]
        opened = self.files.video(self.span.path)
        with opened.lock:
            found = self._scan(opened.obj, targets)
        out = []
        for r, t in zip(range(start, stop), targets):
            best = min(found, key=lambda f: abs(f[0] - t), default=None)
            if best is None or not abs(best[0] - t) < self.tolerance_s:
                near = "no frame was decoded" if best is None else \
                    f"the nearest frame is at {best[0]!r} s"
                raise self.loss(f"frame {r}: no video frame within tolerance_s="
                                f"{self.tolerance_s!r} of timestamp {t!r} s in "
                                f"{self.span.path!r} ({near})")
            out.append(best[1])
        return out, len(found)

    def _scan(self, container: Any, targets: list[float]) -> list[tuple[float, bytes]]:
        import av

        tol = self.tolerance_s
        lo, hi = targets[0] - tol, targets[-1] + tol
        try:
            stream = container.streams.video[0]
        except IndexError:
            raise FileProblem(f"{self.span.path!r} has no video stream") from None
        base = stream.time_base
        found: list[tuple[float, bytes]] = []
        try:
            container.seek(max(0, int(lo / base)), stream=stream, backward=True,
                           any_frame=False)
            for n, frame in enumerate(container.decode(stream)):
                if n >= MAX_DECODED_FRAMES:
                    raise FileProblem(f"{self.span.path!r}: more than {MAX_DECODED_FRAMES} "
                                      f"frames decoded to reach {hi!r} s")
                ts = frame.time
                if ts is None or ts < lo:
                    continue
                if ts > hi:
                    break
                found.append((float(ts), self._pixels(frame)))
        except av.FFmpegError as exc:
            raise FileProblem(f"{self.span.path!r} cannot be decoded ({exc})") from exc
        return found

    def _pixels(self, frame: Any) -> bytes:
        h, w = self.size
        if (frame.height, frame.width) != (h, w):
            raise FileProblem(f"{self.span.path!r}: a frame is {frame.height}x{frame.width} "
                              f"(HxW), but info.json declares {h}x{w}")
        rgb = frame.to_ndarray(format="rgb24")
        return rawframe.pack(h, w, rgb.tobytes())
