"""The batch read planner (docs/ARCHITECTURE.md).

A batch is planned as a whole: every window of every sample is computed, windows are
grouped by (episode, zarr key), the chunks they touch are looked up in the cache, the
missing ones are fetched in merged runs (one store call per run), and the outputs are
assembled with one vectorized gather per output key over clamped row indices.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from episerve_proto.contract import ACTION_KEYS
from episerve_proto.errors import (
    DataLossError,
    FrameOutOfRange,
    InvalidArgument,
    ShortArrayError,
    Unavailable,
)
from episerve_server.core.cache import ChunkCache
from episerve_server.core.framecache import ChunkKey
from episerve_server.core.keymap import Keymap, Rule
from episerve_server.core.result import BatchResult
from episerve_server.core.spans import cutoff_ends
from episerve_server.core.stats import Stats
from episerve_server.core.windows import Window, window
from episerve_server.plan.assemble import (
    PACK,
    Batch,
    Empty,
    Table,
    assemble,
    distinct,
    empty32,
    gather_cached,
)
from episerve_server.plan.checks import Budget, check_keys, output_bytes
from episerve_server.plan.compiled import Compiled, Warm
from episerve_server.plan.misses import Fetcher, Need
from episerve_server.plan.options import ReadOptions, too_big
from episerve_server.storage.annotations import load_spans
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers import ChunkReader

MAX_CHECKED_KEYMAPS = 64
# Gathers this large run in a worker thread (a few ms on the loop below it); smaller ones
# run on the loop, where the thread hop would cost more than the copy.
GATHER_OFFLOAD_BYTES = 4 << 20


DEFAULT_OPTIONS = ReadOptions()


class Planner:
    def __init__(self, catalog: Catalog, cache: ChunkCache, stats: Stats, *,
                 fetch_limit: int = 64, offload_bytes: int = 1 << 20) -> None:
        self.catalog, self.cache, self.stats = catalog, cache, stats
        self.offload_bytes = offload_bytes
        self.fetcher = Fetcher(catalog, cache, stats, limit=fetch_limit,
                               offload_bytes=offload_bytes)
        # Per keymap: the episodes already checked against it (a keymap x episode check
        # runs once, not on every batch). Bounded; an episode reopened is checked again.
        self._checked: OrderedDict[Keymap, dict[str, Episode]] = OrderedDict()
        self.compiled = Compiled(catalog, cache)
        #: False: every batch takes the general path (the differential test's reference).
        self.use_compiled = True

    async def read(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
                   options: ReadOptions = DEFAULT_OPTIONS) -> BatchResult:
        if not samples:
            raise InvalidArgument("a read needs at least one sample")
        # The compiled plan is chosen before anything changes, so either path leaves the
        # same answer, LRU state and counters.
        warm = self.compiled.plan(keymap, samples, options) if self.use_compiled else None
        if warm is not None:
            return await self._read_warm(warm, keymap, samples, options)
        batch = self._resolve(keymap, samples)
        out_bytes, empty = await self._admit(keymap, batch, options, len(samples))
        return await self._read_general(keymap, samples, options, batch, out_bytes, empty)

    async def _admit(self, keymap: Keymap, batch: Batch, options: ReadOptions,
                     n: int) -> tuple[int, Empty]:
        """The size checks, the admission hook and the arena, before building anything."""
        out_bytes = output_bytes(keymap, batch, options.all_masks)
        return out_bytes, await self._admit_bytes(out_bytes, keymap, options, n)

    async def _admit_bytes(self, out_bytes: int, keymap: Keymap, options: ReadOptions,
                           n: int) -> Empty:
        if options.max_response_bytes and out_bytes > options.max_response_bytes:
            raise too_big(out_bytes, options.max_response_bytes, n)
        if options.admit is not None:
            options.admit(out_bytes)
        if options.arena is not None:
            await options.arena.open(out_bytes, len(keymap))
            return options.arena.empty
        return empty32

    async def _read_warm(self, warm: Warm, keymap: Keymap, samples: Sequence[tuple[str, int]],
                         options: ReadOptions) -> BatchResult:
        empty = await self._admit_bytes(warm.out_bytes, keymap, options, len(samples))
        if not self.compiled.still_valid(warm):  # the cache changed during the await
            again = self.compiled.plan(keymap, samples, options)
            if again is None:
                batch = self._resolve(keymap, samples)
                return await self._read_general(keymap, samples, options, batch,
                                                warm.out_bytes, empty)
            warm = again
        budget = Budget(options.max_response_bytes, warm.out_bytes, len(samples))
        distinct = self.compiled.stamp(warm, budget if options.max_response_bytes else None)
        if warm.out_bytes >= GATHER_OFFLOAD_BYTES:  # a large gather runs off the event loop
            self.cache.hold()
            try:
                arrays = await asyncio.to_thread(self.compiled.gather, warm, empty,
                                                 options.arena, True)
            finally:
                self.cache.unhold()
        else:
            arrays = self.compiled.gather(warm, empty, options.arena)
        result = self.compiled.result(warm, keymap, arrays, distinct, options.all_masks)
        if options.max_response_bytes and result.nbytes > options.max_response_bytes:
            raise too_big(result.nbytes, options.max_response_bytes, len(samples))
        for h in self.compiled.episodes_first_seen(warm):
            self.stats.episodes[h].read_rpcs += 1
        self.stats.samples_read += len(samples)
        return result

    async def _read_general(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
                            options: ReadOptions, batch: Batch, out_bytes: int,
                            empty: Empty) -> BatchResult:
        spans = await self._spans(keymap, batch, options)
        windows = self._windows(keymap, batch, spans, options)
        tables = {key: self._table(key, keymap, batch, windows) for key in sorted(keymap.zarr_keys)}
        budget = Budget(options.max_response_bytes, out_bytes, len(samples))
        self._lookup(tables, batch)
        offload = out_bytes >= GATHER_OFFLOAD_BYTES
        if offload:  # a large gather runs off the event loop
            self.cache.hold()
            try:
                partial = await asyncio.to_thread(
                    gather_cached, keymap, batch, windows, tables, self.cache.slab_data, empty)
            finally:
                self.cache.unhold()
        else:
            partial = gather_cached(keymap, batch, windows, tables, self.cache.slab_data,
                                    empty)
        await self._load(tables, batch, budget, recheck=offload)
        # Only rows of fetched chunks are still to gather: a warm batch is assembled here.
        pending = any(p.pending is not None for p in partial.values())
        result: BatchResult = await self._offload(
            out_bytes if pending else 0, assemble, keymap, batch, windows, tables, spans, partial,
            options.all_masks,
        )
        if options.max_response_bytes and result.nbytes > options.max_response_bytes:
            raise too_big(result.nbytes, options.max_response_bytes, len(samples))
        for e in batch.episodes:
            self.stats.episodes[e.hash].read_rpcs += 1
        self.stats.samples_read += len(samples)
        return result

    def uncached(self, keymap: Keymap, samples: Sequence[tuple[str, int]],
                 frames: list[ChunkKey] | None = None) -> list[Need]:
        """The chunks a read of ``samples`` would fetch now: neither cached nor in flight
        (for prefetch hints; the annotation cutoff only shortens windows, so it is left
        out); ``frames``, if given, is extended with every frame chunk the read uses,
        cached or not. Raises as a read would for a sample it cannot serve. Counts no
        hits."""
        batch = self._resolve(keymap, samples)
        windows = self._windows(keymap, batch, {}, ReadOptions())
        uids = self.cache.uids([e.hash for e in batch.episodes])
        out: list[Need] = []
        for key in sorted(keymap.zarr_keys):
            table = self._table(key, keymap, batch, windows)
            ep_pos, chunk = np.divmod(table.packed, PACK)
            if table.reader_of[0].info.is_bytes:
                keys = [(batch.episodes[p].hash, key, c)
                        for p, c in zip(ep_pos.tolist(), chunk.tolist())]
                if frames is not None:
                    frames.extend(keys)
                missing = [j for j, k in enumerate(keys) if not self.cache.has_frames(k)]
            else:
                slab, _ = self.cache.lookup(key, uids[ep_pos], chunk)
                missing = np.flatnonzero(slab < 0).tolist()
            for j in missing:
                need = Need(table.reader_of[int(ep_pos[j])], int(chunk[j]))
                if not self.fetcher.in_flight(need.id):
                    out.append(need)
        return out

    # -- planning ---------------------------------------------------------------------------

    def _resolve(self, keymap: Keymap, samples: Sequence[tuple[str, int]]) -> Batch:
        position: dict[str, int] = {}
        episodes: list[Episode] = []
        checked = self._checked.get(keymap)
        if checked is None:
            checked = self._checked[keymap] = {}
            while len(self._checked) > MAX_CHECKED_KEYMAPS:
                self._checked.popitem(last=False)
        ep = np.empty(len(samples), np.int64)
        frame = np.empty(len(samples), np.int64)
        for b, (episode_id, f) in enumerate(samples):
            pos = position.get(episode_id)
            if pos is None:
                episode = self.catalog.lookup(episode_id)
                if checked.get(episode_id) is not episode:
                    check_keys(keymap, episode)
                    checked[episode_id] = episode
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
        return Batch(episodes, ep, frame, total, fps)

    async def _spans(self, keymap: Keymap, batch: Batch,
                     options: ReadOptions) -> dict[str, list[list[Any]]]:
        """Annotation spans per annotation key (and the cutoff's), per episode position."""
        keys = set(keymap.annotation_keys)
        if options.annotation_cutoff and keymap.action_mask_entry is not None:
            keys.add("annotations")  # the cutoff shortens horizon windows of action keys
        out: dict[str, list[list[Any]]] = {}
        for key in sorted(keys):
            out[key] = list(await asyncio.gather(
                *(load_spans(e, key, self._fetch_raw) for e in batch.episodes)
            ))
        return out

    def _windows(self, keymap: Keymap, batch: Batch, spans: dict[str, list[list[Any]]],
                 options: ReadOptions) -> dict[str, Window]:
        cut = None
        if options.annotation_cutoff and "annotations" in spans:
            cut = cutoff_ends(spans["annotations"], batch.ep, batch.frame, batch.total)
        out: dict[str, Window] = {}
        for e in keymap:
            if e.rule is Rule.ANNOTATION:
                continue
            use_cut = cut if e.key_type == ACTION_KEYS else None
            out[e.name] = window(e, batch.frame, batch.total, batch.fps, use_cut)
        return out

    def _table(self, key: str, keymap: Keymap, batch: Batch,
               windows: dict[str, Window]) -> Table:
        readers = [e.readers[key] for e in batch.episodes]
        infos = [r.info for r in readers]
        first = infos[0]
        if any(i.feature != first.feature or i.is_bytes != first.is_bytes for i in infos):
            seen = {(i.feature, i.is_bytes): i.episode for i in infos}
            raise InvalidArgument(
                f"key {key!r} has different feature shapes in one batch: "
                + ", ".join(f"episode {ep!r}: {s!r}" for (s, _), ep in sorted(seen.items())),
                episode=first.episode, key=key,
            )
        rows_cap = np.fromiter([i.rows for i in infos], np.int64, len(infos))
        chunk_rows = np.fromiter([i.chunk_rows for i in infos], np.int64, len(infos))
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
        uniform = bool(chunk_rows.min() == chunk_rows.max())
        per_row = int(chunk_rows[0]) if uniform else chunk_rows[eps]
        packed = distinct(eps * PACK + rows // per_row)
        # the distinct rows: camera keys send each distinct frame once
        needed = distinct(eps * PACK + rows) if first.is_bytes else None
        return Table(readers, chunk_rows, packed, [None] * len(packed), needed,
                     uniform_rows=uniform)

    # -- fetching ---------------------------------------------------------------------------

    def _lookup(self, tables: dict[str, Table], batch: Batch) -> None:
        """Find every numeric chunk of the batch in the cache: a few numpy calls per key."""
        uids = None
        for key, table in tables.items():
            if table.reader_of[0].info.is_bytes:
                continue
            if uids is None:
                uids = self.cache.uids([e.hash for e in batch.episodes])
            ep_pos, chunk = np.divmod(table.packed, PACK)
            table.slab, table.slot = self.cache.lookup(key, uids[ep_pos], chunk)
            hits = int((table.slab >= 0).sum())
            self.cache.count(hits, len(table.packed) - hits)

    async def _load(self, tables: dict[str, Table], batch: Batch, budget: Budget,
                    recheck: bool = False) -> None:
        """Fill every chunk the cache lacks, through the fetcher: one job for the batch,
        and chunks other reads are already fetching taken from their jobs. ``recheck``:
        the cache was looked up before an await, so chunks may have arrived since."""
        needs: list[Need] = []
        where: list[tuple[Table, int]] = []
        for key, table in tables.items():
            if not table.reader_of[0].info.is_bytes:
                missing = np.flatnonzero(table.slab < 0)
                if recheck and missing.size:
                    missing = self._recheck(key, table, batch, missing)
                for j in missing.tolist():
                    ep_pos, chunk = divmod(int(table.packed[j]), int(PACK))
                    needs.append(Need(table.reader_of[ep_pos], chunk))
                    where.append((table, j))
                continue
            for j, pk in enumerate(table.packed.tolist()):
                ep_pos, chunk = divmod(pk, int(PACK))
                hit = self.cache.get((batch.episodes[ep_pos].hash, key, chunk))
                if hit is None:
                    needs.append(Need(table.reader_of[ep_pos], chunk))
                    where.append((table, j))
                else:
                    table.chunks[j] = hit
                    budget.add(sum(len(b) for b in hit))
        if not needs:
            return
        fetched = await self.fetcher.get(needs, budget.add)
        for (table, j), got in zip(where, fetched):
            table.chunks[j] = got

    def _recheck(self, key: str, table: Table, batch: Batch,
                 missing: np.ndarray) -> np.ndarray:
        """Chunks stored by other reads since the lookup are copied, not fetched again."""
        ep_pos, chunk = np.divmod(table.packed[missing], PACK)
        uids = self.cache.uids([e.hash for e in batch.episodes])
        slab, slot = self.cache.lookup(key, uids[ep_pos], chunk)
        found = slab >= 0
        for j, sid, sl in zip(missing[found].tolist(), slab[found].tolist(),
                              slot[found].tolist()):
            table.chunks[j] = self.cache.slab_data(sid)[sl].copy()
        return missing[~found]

    async def _fetch_raw(self, reader: ChunkReader, first: int, last: int) -> list[Any]:
        """Raw chunks for the annotation loader (decoded there, a few chunks at a time)."""
        async with self.fetcher.slot():
            try:
                raws = await reader.fetch(first, last)
            except FileNotFoundError as exc:
                await self.fetcher.check_present(reader)
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

    async def fetch_chunks(self, reader: ChunkReader, first: int, last: int) -> list[Any]:
        """Raw chunks [first, last] of one array, under the same store limit and counters
        as a Read's fetches (the statistics pass reads through here)."""
        return await self._fetch_raw(reader, first, last)

    async def _offload(self, nbytes: int, fn: Any, *args: Any) -> Any:
        if nbytes >= self.offload_bytes:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)


def _key_rows(key: str, keymap: Keymap, batch: Batch,
              windows: dict[str, Window]) -> tuple[np.ndarray, np.ndarray]:
    eps, rows = [], []
    for e in keymap:
        if e.zarr_key == key and e.name in windows:
            w = windows[e.name].rows  # (B, W)
            eps.append(np.repeat(batch.ep, w.shape[1]))
            rows.append(w.ravel())
    if len(rows) == 1:
        return eps[0], rows[0]
    return np.concatenate(eps), np.concatenate(rows)
