"""The open files of a LeRobot dataset: parquet files and mp4 containers, kept open (a
bounded LRU each), read in a small pool of worker threads, never on the event loop.

Every file is opened through the confined store (a regular file whose real path is under
the root, within a size cap). A parquet file's footer length is checked before pyarrow
parses it; a column's type is checked from the schema, and a read's decoded size from the
row groups' row counts, value counts and uncompressed sizes, before a row group is read;
metadata files are decoded in batches sized from the footer, under a total. A video
container is opened with FFmpeg's pixel limit and its stream's size checked before a frame
is decoded. One lock per open file: pyarrow and PyAV objects are not shared between threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from episerve_server.storage.confined_root import ConfinedLocalStore
from episerve_server.storage.lerobot.columns import (
    FileProblem,
    check_texts,
    decoded_bytes,
    numeric_field,
    row_bound,
    text_field,
)
from episerve_server.storage.lerobot.pages import page_sizes

T = TypeVar("T")
#: Open files kept per kind; the least recently used is closed past this.
MAX_OPEN_PARQUET = 32
MAX_OPEN_VIDEOS = 16  # containers: a file may have DECODE_THREADS open
MAX_PARQUET_BYTES = 4 << 30  # one parquet data file on disk (read in row groups, never whole)
MAX_META_PARQUET_BYTES = 256 << 20  # meta/episodes and meta/tasks files (read whole)
MAX_VIDEO_BYTES = 64 << 30  # one mp4 file on disk (decoded in GOPs, never whole)
MAX_FOOTER_BYTES = 16 << 20  # a parquet footer (its schema and row-group index)
MAX_READ_BYTES = 512 << 20  # the decoded column of the row groups one read touches
#: Metadata files (meta/episodes, meta/tasks) are decoded in batches of at most this many
#: rows and bytes (bounded from the footer before the batch is read), under a total.
META_BATCH_ROWS = 65_536
META_BATCH_BYTES = 8 << 20
MAX_META_DECODED_BYTES = 64 << 20
#: The most pixels a decoder may allocate for one video frame, whatever is declared.
MAX_VIDEO_PIXELS = 2**25 + 2**21
DECODE_THREADS = 2


class _Open:
    def __init__(self, obj: Any, raw: pa.NativeFile | None = None) -> None:
        self.obj, self.lock = obj, threading.Lock()
        self.raw = raw  # the same file, for reading page headers
        self.pages: dict[tuple[int, int], int] = {}  # (group, column) -> pages decompressed

    def close(self) -> None:
        close = getattr(self.obj, "close", None)
        if close is not None:
            close()
        if self.raw is not None:
            self.raw.close()


class OpenFiles:
    """Open parquet files and video containers of one root, and the pool reading them."""

    def __init__(self, store: ConfinedLocalStore) -> None:
        self.store = store
        self._pool: ThreadPoolExecutor | None = None
        self._parquet: OrderedDict[str, _Open] = OrderedDict()
        self._videos: OrderedDict[str, _Open] = OrderedDict()
        self._guard = threading.Lock()

    async def run(self, work: Callable[[], T]) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="lerobot")
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        with self._guard:
            for table in (self._parquet, self._videos):
                while table:
                    table.popitem()[1].close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # -- opening (worker threads) -------------------------------------------------------

    def _get(self, table: OrderedDict[str, _Open], limit: int, key: str,
             make: Callable[[BinaryIO], _Open], cap: int, path: str = "") -> _Open:
        """The open file kept under ``key`` (``path``, or ``path`` and a slot), opened from
        ``path`` (default: ``key``) if it is not kept."""
        path = path or key
        with self._guard:
            found = table.get(key)
            if found is not None:
                table.move_to_end(key)
                return found
        # Checked on the descriptor opened; the library then opens that same file through
        # /proc/self/fd (its own descriptor, native reads) and the checked one is closed.
        with self.store.open_sync(path, cap) as handle, _about(path):
            opened = make(handle)
        with self._guard:
            if key in table:  # opened meanwhile by another thread: keep the first
                table.move_to_end(key)
                with contextlib.suppress(Exception):
                    opened.close()
                return table[key]
            table[key] = opened
            while len(table) > limit:
                _, old = table.popitem(last=False)
                with old.lock:  # not while another thread reads it
                    old.close()
        return opened

    def parquet(self, path: str, cap: int = MAX_PARQUET_BYTES) -> _Open:
        return self._get(self._parquet, MAX_OPEN_PARQUET, path, _parquet_file, cap)

    @contextlib.contextmanager
    def video(self, path: str, size: tuple[int, int]) -> Iterator[Any]:
        """A container of ``path``, held by this thread until the block ends: one nobody
        holds, else a new one while the file has fewer than ``DECODE_THREADS`` open (so the
        decode threads can read one file at once, an episode each), else the first, once
        free. A container is opened with frames of more than ``size``'s pixels refused by
        FFmpeg itself, and its stream's size checked."""
        import av

        limit = {"max_pixels": str(pixel_limit(size))}

        def make(handle: BinaryIO) -> _Open:
            try:
                # The limit reaches the decoders avformat_find_stream_info opens to probe a
                # stream: a frame larger than declared is not decoded even there.
                container = av.open(_reopened(handle), mode="r", options=limit)
            except av.FFmpegError as exc:
                raise FileProblem(f"is not a video container PyAV can open ({exc})") from exc
            try:
                self.checked_stream(container, "", size)
            except BaseException:
                container.close()
                raise
            return _Open(container)

        held = None
        with self._guard:
            for k in range(DECODE_THREADS):
                found = self._videos.get(f"{path}\0{k}")
                if found is not None and found.lock.acquire(blocking=False):
                    self._videos.move_to_end(f"{path}\0{k}")
                    held = found
                    break
            else:
                free = [k for k in range(DECODE_THREADS) if f"{path}\0{k}" not in self._videos]
        if held is None:
            slot = f"{path}\0{free[0] if free else 0}"
            held = self._get(self._videos, MAX_OPEN_VIDEOS, slot, make, MAX_VIDEO_BYTES,
                             path)
            held.lock.acquire()
        try:
            yield held.obj
        finally:
            held.lock.release()

    @staticmethod
    def checked_stream(container: Any, path: str, size: tuple[int, int]) -> Any:
        """The container's first video stream, its size from the headers (what the decoder
        will allocate) checked against ``size`` (H, W), its decoder limited to that many
        pixels: before any frame of it is decoded."""
        import av

        name = f"{path!r} " if path else ""
        try:
            stream = container.streams.video[0]
        except IndexError:
            raise FileProblem(f"{name}has no video stream") from None
        ctx = stream.codec_context
        if ctx is None:
            raise FileProblem(f"{name}has a video stream no decoder here can read")
        h, w = size
        got = (int(ctx.height), int(ctx.width))
        if got != (0, 0) and got != (h, w):  # (0: unknown before decoding; bounded below)
            raise FileProblem(f"{name}has a video stream of {got[0]}x{got[1]} (HxW), but "
                              f"info.json declares {h}x{w}")
        if not ctx.is_open:
            try:
                ctx.options = {"max_pixels": str(pixel_limit(size))}
            except av.FFmpegError as exc:
                raise FileProblem(f"{name}cannot be decoded ({exc})") from exc
        return stream

    def identity(self, path: str) -> str:
        """What changes when the file ``path`` is rewritten: its size, mtime and inode (not
        followed out of the root; "" when it cannot be seen)."""
        real = os.path.realpath(os.path.join(self.store.root, path))
        if not self.store.inside(real):
            return ""
        try:
            st = os.stat(real)
        except OSError:
            return ""
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}"

    # -- reading (worker threads) -------------------------------------------------------

    def shape_of(self, path: str) -> tuple[int, frozenset[str]]:
        """A parquet file's row count and column names (from its footer)."""
        opened = self.parquet(path)
        with opened.lock:
            pf: pq.ParquetFile = opened.obj
            return int(pf.metadata.num_rows), frozenset(pf.schema_arrow.names)

    def column(self, path: str, column: str, start: int, stop: int,
               shape: tuple[int, ...]) -> np.ndarray:
        """Rows [start, stop) of ``column`` as float32 ``(stop - start, *shape)``, reading
        only the row groups they lie in."""
        opened = self.parquet(path)
        with opened.lock, _about(path):
            pf: pq.ParquetFile = opened.obj
            groups, first = _groups(pf.metadata, start, stop)
            if pf.schema_arrow.get_field_index(column) < 0:
                raise FileProblem(f"has no column {column!r}")
            numeric_field(pf.schema_arrow.field(column))
            per_row = 8 * math.prod(shape) if shape else 8
            held = sum(pf.metadata.row_group(g).num_rows for g in groups) * per_row
            stored = _stored_bytes(pf.metadata, groups, column)
            if max(held, stored) > MAX_READ_BYTES:
                raise FileProblem(f"rows {start}..{stop} lie in row groups of "
                                  f"{max(held, stored)} bytes of {column!r} decoded, more "
                                  f"than {MAX_READ_BYTES}")
            _check_pages(opened, groups, {column}, MAX_READ_BYTES)
            table = pf.read_row_groups(groups, columns=[column], use_threads=False)
        values = table.column(0).slice(start - first, stop - start)
        with _about(path):
            return _to_float(values, stop - start, shape, column)

    def names(self, path: str) -> frozenset[str]:
        """A metadata parquet file's column names (from its footer)."""
        opened = self.parquet(path, MAX_META_PARQUET_BYTES)
        with opened.lock:
            return frozenset(opened.obj.schema_arrow.names)

    def rows(self, path: str, columns: Mapping[str, str], max_rows: int,
             max_text_bytes: int = 0) -> dict[str, list[Any]]:
        """The given columns (name -> ``"number"`` or ``"text"``) of a whole metadata parquet
        file, as Python lists; those it lacks are left out. Each column's type is checked
        from the schema, then rows are decoded in batches whose decoded size is bounded
        from the footer, under ``MAX_META_DECODED_BYTES`` in all and ``max_text_bytes`` a
        text, each batch checked before it becomes Python objects."""
        opened = self.parquet(path, MAX_META_PARQUET_BYTES)
        with opened.lock, _about(path):
            pf: pq.ParquetFile = opened.obj
            if pf.metadata.num_rows > max_rows:
                raise FileProblem(f"holds {pf.metadata.num_rows} rows, more than {max_rows}")
            schema = pf.schema_arrow
            wanted = {c: kind for c, kind in columns.items() if schema.get_field_index(c) >= 0}
            for c, kind in wanted.items():
                (text_field if kind == "text" else numeric_field)(schema.field(c))
            got: dict[str, list[Any]] = {c: [] for c in wanted}
            if not wanted:
                return got
            budget = MAX_META_DECODED_BYTES
            per_row = row_bound(pf.metadata, wanted, budget)
            _check_pages(opened, list(range(pf.metadata.num_row_groups)), set(wanted), budget)
            batch = max(1, min(META_BATCH_ROWS, META_BATCH_BYTES // per_row))
            for part in pf.iter_batches(batch_size=batch, columns=list(wanted),
                                        use_threads=False):
                budget -= sum(decoded_bytes(part.column(c)) for c in wanted)
                if budget < 0:
                    raise FileProblem(f"decodes to more than {MAX_META_DECODED_BYTES} bytes "
                                      f"of columns {sorted(wanted)}")
                for c in wanted:
                    values = part.column(c)
                    if wanted[c] == "text":
                        check_texts(values, c, max_text_bytes)
                    got[c].extend(values.to_pylist())
        return got


def pixel_limit(size: tuple[int, int]) -> int:
    """FFmpeg's ``max_pixels`` for frames declared ``size`` (H, W): the declared pixels with
    room for the padding decoders allocate (widths aligned to 64, heights to 32), and 2**16
    more (the mpeg4 decoder asks 53,760 for a 33x47 frame; h264, hevc, av1 and mpeg4 ask
    exactly H x W at 480x640 and 1080x1920)."""
    h, w = size
    return min((h + 32) * (w + 64) + 2**16, MAX_VIDEO_PIXELS)


@contextlib.contextmanager
def _about(path: str) -> Iterator[None]:
    """Problems of reading ``path`` as ``FileProblem`` naming it (a missing file stays
    ``FileNotFoundError``)."""
    try:
        yield
    except FileProblem as exc:
        if str(exc).startswith(repr(path)):
            raise
        raise FileProblem(f"{path!r} {exc}") from exc
    except pa.ArrowException as exc:
        raise FileProblem(f"{path!r} cannot be read ({str(exc)[:300]})") from exc


def _reopened(handle: BinaryIO) -> str:
    """A path that opens the very file ``handle`` has open, wherever it was moved since."""
    return f"/proc/self/fd/{handle.fileno()}"


def _parquet_file(handle: BinaryIO) -> _Open:
    handle.seek(0, 2)
    size = handle.tell()
    if size < 12:
        raise FileProblem(f"is {size} bytes, too short for a parquet file")
    handle.seek(size - 8)
    length, magic = struct.unpack("<I4s", handle.read(8))
    if magic != b"PAR1":
        raise FileProblem("is not a parquet file (no PAR1 trailer)")
    if length > min(MAX_FOOTER_BYTES, size - 12):
        raise FileProblem(f"declares a footer of {length} bytes, over the bound of "
                          f"{min(MAX_FOOTER_BYTES, size - 12)}")
    try:
        return _Open(pq.ParquetFile(pa.OSFile(_reopened(handle))), pa.OSFile(_reopened(handle)))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise FileProblem(f"is not a readable parquet file ({exc})") from exc


def _check_pages(opened: _Open, groups: list[int], columns: set[str], cap: int) -> None:
    """The page headers of ``columns``' chunks in ``groups``: what their pages decompress
    to, at most ``cap`` in all (each chunk walked once per open file)."""
    meta: pq.FileMetaData = opened.obj.metadata
    raw = opened.raw
    assert raw is not None
    total = 0
    for g in groups:
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            name = chunk.path_in_schema
            if not any(name == col or name.startswith(col + ".") for col in columns):
                continue
            if (g, c) not in opened.pages:
                starts = [o for o in (chunk.dictionary_page_offset, chunk.data_page_offset)
                          if o is not None and o > 0]
                if not starts:
                    raise FileProblem(f"column {name!r} has no page offsets in row group {g}")
                sizes = page_sizes(lambda pos, n: raw.read_at(n, pos), min(starts),
                                   int(chunk.total_compressed_size))
                opened.pages[g, c] = sum(sizes)
            total += opened.pages[g, c]
            if total > cap:
                raise FileProblem(f"column {name!r} has pages that decompress to {total} "
                                  f"bytes in the row groups read, more than {cap}")


def _stored_bytes(meta: pq.FileMetaData, groups: list[int], column: str) -> int:
    """What ``column``'s chunks of ``groups`` decode to at most, from the footer's value
    counts (8 bytes a value) and uncompressed sizes (what the pages decompress to): a row
    holding more values than its feature's shape shows here, before anything is read,
    whatever the encoding (a dictionary of one value takes a few bytes stored, and any
    number decoded)."""
    total = 0
    for g in groups:
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            path = chunk.path_in_schema  # "observation.state.list.element" for a list
            if path == column or path.startswith(column + "."):  # (may over-count: safe)
                total += max(8 * int(chunk.num_values), int(chunk.total_uncompressed_size), 0)
    return total


def _groups(meta: pq.FileMetaData, start: int, stop: int) -> tuple[list[int], int]:
    """The row groups holding rows [start, stop), and the first row of the first one."""
    groups, first, at = [], -1, 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if at < stop and at + n > start:
            groups.append(g)
            first = at if first < 0 else first
        at += n
    if at < stop or not groups:
        raise FileProblem(f"holds {at} rows; rows {start}..{stop} were asked for")
    return groups, first


def _to_float(values: pa.ChunkedArray, n: int, shape: tuple[int, ...],
              column: str) -> np.ndarray:
    arr = values.combine_chunks()
    if arr.null_count:
        raise FileProblem(f"column {column!r} holds {arr.null_count} nulls in the rows read")
    while pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type) \
            or pa.types.is_large_list(arr.type):
        arr = arr.flatten()
        if arr.null_count:
            raise FileProblem(f"column {column!r} holds nulls in the rows read")
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)
            or pa.types.is_boolean(arr.type)):
        raise FileProblem(f"column {column!r} holds {arr.type}, not numbers")
    want = n * math.prod(shape)
    if len(arr) != want:
        raise FileProblem(f"column {column!r} holds {len(arr)} values in {n} rows, expected "
                          f"{want} (shape {list(shape)} per row)")
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(n, *shape)
