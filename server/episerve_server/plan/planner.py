"""The batch read planner (SPEC section 3).

A batch is planned as a whole: every window of every sample is computed, windows are
grouped by (episode, zarr key), the chunks they touch are looked up in the cache, the
missing ones are fetched in merged runs (one store call per run), and the outputs are
assembled with one vectorized gather per output key over clamped row indices.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_server.core.cache import Chunk, ChunkCache
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.core.stats import Stats
from episerve_server.core.windows import Window, window
from episerve_server.errors import (
    DataLossError,
    EpisodeNotFound,
    FrameOutOfRange,
    InvalidArgument,
    KeymapError,
    ResponseTooLarge,
    ShortArrayError,
    Unavailable,
)
from episerve_server.storage.annotations import cutoff_ends, load_spans, texts_at
from episerve_server.storage.catalog import Catalog, Episode
from episerve_server.storage.readers import ChunkReader, Raw, decode_chunk, episode_exists

_M = np.int64(1 << 32)  # packs (episode position, chunk or row) into one sortable int64


@dataclass(frozen=True, slots=True)
class ReadOptions:
    annotation_cutoff: bool = False
    max_response_bytes: int = 0  # 0: no limit


@dataclass(frozen=True, slots=True)
class _Batch:
    episodes: list[Episode]  # distinct, in first-seen order
    ep: np.ndarray  # (B,) position in ``episodes``
    frame: np.ndarray  # (B,) int64
    total: np.ndarray  # (B,) int64
    fps: np.ndarray  # (B,) float64


@dataclass(slots=True)
class _Table:
    """The chunks one zarr key needs over the batch, by packed (episode, chunk) key."""

    reader_of: list[ChunkReader]  # per episode position
    chunk_rows: np.ndarray  # per episode position
    packed: np.ndarray  # sorted distinct packed keys
    chunks: list[Chunk | None]
    rows: np.ndarray  # sorted distinct packed (episode, row) keys this key needs
    staging: Any = None  # numeric: the chunks concatenated; bytes: the distinct frames
    starts: Any = None  # numeric: first staging row of each chunk


class Planner:
    def __init__(self, catalog: Catalog, cache: ChunkCache, stats: Stats, *,
                 fetch_limit: int = 64, offload_bytes: int = 1 << 20) -> None:
        self.catalog, self.cache, self.stats = catalog, cache, stats
        self.offload_bytes = offload_bytes
        self._fetch_limit = fetch_limit
        self._sem: asyncio.Semaphore | None = None

    async def read(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
                   options: ReadOptions = ReadOptions()) -> BatchResult:
        if not samples:
            raise InvalidArgument("a read needs at least one sample")
        batch = self._resolve(keymap, samples)
        out_bytes = _output_bytes(keymap, batch)  # refuse before building anything large
        if options.max_response_bytes and out_bytes > options.max_response_bytes:
            raise _too_big(out_bytes, options.max_response_bytes, len(samples))
        spans = await self._spans(keymap, batch, options)
        windows = self._windows(keymap, batch, spans, options)
        tables = {key: self._table(key, keymap, batch, windows) for key in sorted(keymap.zarr_keys)}
        await self._load(tables, batch)
        result: BatchResult = await self._offload(
            out_bytes, _assemble, keymap, batch, windows, tables, spans
        )
        if options.max_response_bytes and result.nbytes > options.max_response_bytes:
            raise _too_big(result.nbytes, options.max_response_bytes, len(samples))
        for e in batch.episodes:
            self.stats.episodes[e.hash].read_rpcs += 1
        self.stats.samples_read += len(samples)
        return result

    # -- planning ---------------------------------------------------------------------------

    def _resolve(self, keymap: Keymap, samples: Sequence[tuple[str, int]]) -> _Batch:
        position: dict[str, int] = {}
        episodes: list[Episode] = []
        ep = np.empty(len(samples), np.int64)
        frame = np.empty(len(samples), np.int64)
        for b, (episode_id, f) in enumerate(samples):
            pos = position.get(episode_id)
            if pos is None:
                episode = self.catalog.lookup(episode_id)
                _check_keys(keymap, episode)
                pos = position[episode_id] = len(episodes)
                episodes.append(episode)
            e = episodes[pos]
            if isinstance(f, bool) or not isinstance(f, int | np.integer) \
                    or not 0 <= f < e.total_frames:
                raise FrameOutOfRange(
                    f"episode {e.hash!r}: frame {f!r} is outside [0, {e.total_frames})",
                    episode=e.hash,
                )
            ep[b], frame[b] = pos, f
        total = np.array([e.total_frames for e in episodes], np.int64)[ep]
        fps = np.array([e.fps for e in episodes], np.float64)[ep]
        return _Batch(episodes, ep, frame, total, fps)

    async def _spans(self, keymap: Keymap, batch: _Batch,
                     options: ReadOptions) -> dict[str, list[list[Any]]]:
        """Annotation spans per annotation key (and the cutoff's), per episode position."""
        keys = {e.zarr_key for e in keymap if e.rule is Rule.ANNOTATION}
        if options.annotation_cutoff and any(
            e.key_type == "action_keys" and e.rule is Rule.HORIZON for e in keymap
        ):
            keys.add("annotations")
        out: dict[str, list[list[Any]]] = {}
        for key in sorted(keys):
            out[key] = list(await asyncio.gather(
                *(load_spans(e, key, self._fetch_raw) for e in batch.episodes)
            ))
        return out

    def _windows(self, keymap: Keymap, batch: _Batch, spans: dict[str, list[list[Any]]],
                 options: ReadOptions) -> dict[str, Window]:
        cut = None
        if options.annotation_cutoff and "annotations" in spans:
            cut = cutoff_ends(spans["annotations"], batch.ep, batch.frame, batch.total)
        out: dict[str, Window] = {}
        for e in keymap:
            if e.rule is Rule.ANNOTATION:
                continue
            use_cut = cut if e.key_type == "action_keys" else None
            out[e.name] = window(e, batch.frame, batch.total, batch.fps, use_cut)
        return out

    def _table(self, key: str, keymap: Keymap, batch: _Batch,
               windows: dict[str, Window]) -> _Table:
        readers = [e.readers[key] for e in batch.episodes]
        shapes = {(r.info.feature, r.info.is_bytes) for r in readers}
        if len(shapes) > 1:
            seen = {(r.info.feature, r.info.is_bytes): r.info.episode for r in readers}
            raise InvalidArgument(
                f"key {key!r} has different feature shapes in one batch: "
                + ", ".join(f"episode {ep!r}: {s!r}" for (s, _), ep in sorted(seen.items())),
                episode=readers[0].info.episode, key=key,
            )
        rows_cap = np.array([r.info.rows for r in readers], np.int64)
        chunk_rows = np.array([r.info.chunk_rows for r in readers], np.int64)
        eps, rows = _key_rows(key, keymap, batch, windows)
        short = rows >= rows_cap[eps]
        if short.any():
            k = int(np.argmax(short))
            e = batch.episodes[int(eps[k])]
            raise ShortArrayError(
                f"episode {e.hash!r} key {key!r}: the array holds {int(rows_cap[eps[k]])} rows "
                f"but a window needs row {int(rows[k])} (total_frames={e.total_frames})",
                episode=e.hash, key=key,
            )
        packed = np.unique(eps * _M + rows // chunk_rows[eps])
        return _Table(readers, chunk_rows, packed, [None] * len(packed), np.unique(eps * _M + rows))

    # -- fetching ---------------------------------------------------------------------------

    async def _load(self, tables: dict[str, _Table], batch: _Batch) -> None:
        jobs: list[tuple[str, _Table, int, int]] = []  # key, table, first pos, last pos
        for key, table in tables.items():
            missing = []
            for j, pk in enumerate(table.packed.tolist()):
                ep_pos, chunk = divmod(pk, int(_M))
                hit = self.cache.get((batch.episodes[ep_pos].hash, key, chunk))
                if hit is None:
                    missing.append(j)
                else:
                    table.chunks[j] = hit
            for first, last in _runs(missing, table.packed):
                jobs.append((key, table, first, last))
        if not jobs:
            return
        fetched = await asyncio.gather(*(self._fetch(t, a, b) for _, t, a, b in jobs))
        work = [(t, j, raw) for (_, t, a, _), raws in zip(jobs, fetched)
                for j, raw in zip(range(a, a + len(raws)), raws)]
        keys = [key for (key, _, a, _), raws in zip(jobs, fetched) for _ in raws]
        nbytes = sum(len(r) for _, _, r in work if isinstance(r, bytes))
        decoded = await self._offload(nbytes, _decode_all, work)
        for key, (table, j, _), chunk in zip(keys, work, decoded):
            table.chunks[j] = chunk
            ep_pos, chunk_id = divmod(int(table.packed[j]), int(_M))
            self.cache.put((batch.episodes[ep_pos].hash, key, chunk_id), chunk)

    async def _fetch(self, table: _Table, first: int, last: int) -> list[Raw | Chunk]:
        ep_pos, c0 = divmod(int(table.packed[first]), int(_M))
        c1 = int(table.packed[last]) % int(_M)
        reader = table.reader_of[ep_pos]
        raws = await self._fetch_raw(reader, c0, c1)
        unknown = {c0 + k for k, r in enumerate(raws) if r is None} - reader.absent
        if unknown:  # for one-object chunks, missing may mean deleted: check once per chunk
            await self._check_present(reader)
            reader.absent |= unknown
        return raws

    async def _fetch_raw(self, reader: ChunkReader, first: int, last: int) -> list[Any]:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._fetch_limit)
        async with self._sem:
            try:
                raws = await reader.fetch(first, last)
            except FileNotFoundError as exc:
                await self._check_present(reader)
                info = reader.info
                raise DataLossError(
                    f"episode {info.episode!r} key {info.name!r}: data went missing "
                    f"({exc})", episode=info.episode, key=info.name,
                ) from exc
            except (OSError, TimeoutError) as exc:
                info = reader.info
                raise Unavailable(
                    f"episode {info.episode!r} key {info.name!r}: storage read failed "
                    f"({type(exc).__name__}: {exc})", episode=info.episode, key=info.name,
                ) from exc
        self.stats.episodes[reader.info.episode].chunks_fetched += len(raws)
        self.stats.chunks_fetched += len(raws)
        self.stats.bytes_fetched += sum(len(r) for r in raws if isinstance(r, bytes))
        return raws

    async def _check_present(self, reader: ChunkReader) -> None:
        """Missing data may mean the episode folder was deleted: then drop it, NOT_FOUND."""
        episode = reader.info.episode
        if await episode_exists(self.catalog.store, episode):
            return
        self.catalog.drop(episode)
        raise EpisodeNotFound(
            f"episode {episode!r} was removed from the dataset while being served",
            episode=episode, key=reader.info.name,
        )

    async def _offload(self, nbytes: int, fn: Any, *args: Any) -> Any:
        if nbytes >= self.offload_bytes:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)


def _output_bytes(keymap: Keymap, batch: _Batch) -> int:
    """Bytes of the numeric outputs and frame indexes, known before any window is built."""
    total = 0
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            continue
        info = batch.episodes[0].readers[e.zarr_key].info
        per_row = 4 if info.is_bytes else 4 * int(np.prod(info.feature))
        total += len(batch.ep) * e.length * per_row
    return total


def _check_keys(keymap: Keymap, episode: Episode) -> None:
    for e in keymap:
        reader = episode.readers.get(e.zarr_key)
        if reader is None:
            why = episode.problems.get(e.zarr_key, "it has no such array")
            raise KeymapError(
                f"output key {e.name!r}: episode {episode.hash!r} cannot serve zarr_key "
                f"{e.zarr_key!r} ({why})", episode=episode.hash, key=e.zarr_key,
            )
        if e.rule is Rule.ANNOTATION and not reader.info.is_bytes:
            raise KeymapError(
                f"output key {e.name!r}: annotation_keys needs an array of JSON annotations, "
                f"but {e.zarr_key!r} in episode {episode.hash!r} holds numbers",
                episode=episode.hash, key=e.zarr_key,
            )


def _key_rows(key: str, keymap: Keymap, batch: _Batch,
              windows: dict[str, Window]) -> tuple[np.ndarray, np.ndarray]:
    eps, rows = [], []
    for e in keymap:
        if e.zarr_key == key and e.name in windows:
            w = windows[e.name].rows
            eps.append(np.broadcast_to(batch.ep[:, None], w.shape).ravel())
            rows.append(w.ravel())
    return np.concatenate(eps), np.concatenate(rows)


def _runs(missing: list[int], packed: np.ndarray) -> list[tuple[int, int]]:
    """Runs of missing positions whose chunks are consecutive in one episode."""
    runs: list[tuple[int, int]] = []
    for j in missing:
        if runs and runs[-1][1] == j - 1 and packed[j] == packed[j - 1] + 1:
            runs[-1] = (runs[-1][0], j)
        else:
            runs.append((j, j))
    return runs


def _decode_all(work: list[tuple[_Table, int, Any]]) -> list[Chunk]:
    out = []
    for table, j, raw in work:
        ep_pos, chunk = divmod(int(table.packed[j]), int(_M))
        out.append(decode_chunk(table.reader_of[ep_pos], raw, chunk))
    return out


def _too_big(nbytes: int, limit: int, batch: int) -> ResponseTooLarge:
    fit = max(1, batch * limit // max(nbytes, 1))
    return ResponseTooLarge(
        f"the response would be {nbytes} bytes, over the limit of {limit} bytes; "
        f"split the batch into requests of at most {fit} samples"
    )


def _assemble(keymap: Keymap, batch: _Batch, windows: dict[str, Window],
              tables: dict[str, _Table], spans: dict[str, list[list[Any]]]) -> BatchResult:
    arrays: dict[str, np.ndarray] = {}
    images: dict[str, ImageColumn] = {}
    frames: dict[str, list[bytes]] = {}
    texts: dict[str, list[list[str]]] = {}
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            texts[e.name] = texts_at(spans[e.zarr_key], batch.ep, batch.frame)
            continue
        table, w = tables[e.zarr_key], windows[e.name]
        if table.reader_of[0].info.is_bytes:
            images[e.name] = _image_column(e, w, table, batch, frames)
        else:
            arrays[e.name] = _gather(w.rows if e.time_axis else w.rows[:, 0], table, batch)
    _masks(keymap, windows, arrays)
    return BatchResult(
        episodes=[batch.episodes[p].hash for p in batch.ep.tolist()],
        frame_index=batch.frame.copy(),
        fps=batch.fps.astype(np.float32),
        embodiments=[batch.episodes[p].embodiment for p in batch.ep.tolist()],
        arrays=arrays, images=images, frames=frames, texts=texts,
    )


def _batch_shaped(batch: _Batch, rows: np.ndarray) -> np.ndarray:
    return np.broadcast_to(batch.ep.reshape(-1, *([1] * (rows.ndim - 1))), rows.shape)


def _gather(rows: np.ndarray, table: _Table, batch: _Batch) -> np.ndarray:
    """One fancy-indexed copy: the output rows, from the key's chunks, padding by clamping."""
    if table.staging is None:
        chunks: list[np.ndarray] = table.chunks  # type: ignore[assignment]
        sizes = np.fromiter((len(ch) for ch in chunks), np.int64, len(chunks))
        table.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        table.staging = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    eps = _batch_shaped(batch, rows)
    c = table.chunk_rows[eps]
    pos = np.searchsorted(table.packed, eps * _M + rows // c)
    return table.staging[table.starts[pos] + rows % c]  # type: ignore[no-any-return]


def _image_column(e: KeySpec, w: Window, table: _Table, batch: _Batch,
                  frames: dict[str, list[bytes]]) -> ImageColumn:
    """Camera outputs index the key's distinct frames, so each frame is sent once."""
    if table.staging is None:
        table.staging = frames[e.zarr_key] = _distinct_frames(table)
    rows = w.rows if e.time_axis else w.rows[:, 0]
    key = _batch_shaped(batch, rows) * _M + rows
    return ImageColumn(e.zarr_key, np.searchsorted(table.rows, key).astype(np.int32))


def _distinct_frames(table: _Table) -> list[bytes]:
    eps, rows = np.divmod(table.rows, _M)
    c = table.chunk_rows[eps]
    pos = np.searchsorted(table.packed, eps * _M + rows // c)
    within = rows % c
    chunks: list[Any] = table.chunks
    return [chunks[p][r] for p, r in zip(pos.tolist(), within.tolist())]


def _masks(keymap: Keymap, windows: dict[str, Window], arrays: dict[str, np.ndarray]) -> None:
    action = keymap.action_mask_entry
    if action is not None:
        arrays["action_pad_mask"] = windows[action.name].mask.astype(np.float32)  # type: ignore[union-attr]
    proprio = keymap.proprio_mask_entry
    if proprio is not None:
        arrays["proprio_history_mask"] = windows[proprio.name].mask.astype(np.float32)  # type: ignore[union-attr]
    for e in keymap:
        if e.key_type == "camera_keys" and e.rule is Rule.HISTORY:
            arrays[f"{e.name}_mask"] = windows[e.name].mask.astype(np.float32)  # type: ignore[union-attr]

