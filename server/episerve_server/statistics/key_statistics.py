"""``GetKeyStats``: per-key statistics over the real rows of a set of episodes.

Each (episode, key) is read once through the chunk readers, the same as a Read (cached
chunks are used; chunks fetched for statistics are not put into the chunk cache, so a pass
over the whole dataset does not evict what training reads), decoded and summarized in a
worker thread, and kept under its own byte budget (``--stats-cache-bytes``, least recently
used first): its moments and, when they fit, its values. The 1st/99th percentiles of a set
come from its tails (:mod:`episerve_server.statistics.moments`), kept per key for the last sets
asked for: a set that grows by a few episodes merges only their values into the tails of
the set it grew from. So asking again after one episode was added computes that episode.

An entry is valid for the reader it was computed from: an episode dropped, or reopened with
other content, has new readers and is computed again.

One key's plan, the reads' decoding and summary in the worker thread and the merge are
:mod:`~episerve_server.statistics.key_pass`'s.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from episerve_proto.contract import MAX_NAME_CHARS
from episerve_proto.errors import InvalidArgument, LimitExceeded, shown
from episerve_proto.keyspec import too_long
from episerve_server.core.cache import ChunkCache
from episerve_server.core.numbering import Numbering
from episerve_server.plan.planner import Planner
from episerve_server.statistics.key_pass import (
    KeyPlan,
    RawChunk,
    feed_all,
    numeric_reader,
    summarize_all,
)
from episerve_server.statistics.moments import (
    KeyStats,
    Moments,
    TailBuilder,
    Tails,
    combine,
    tail_room,
)
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.episode import Episode
from episerve_server.storage.readers import ChunkReader

T = TypeVar("T")

#: Keys one request may ask for.
MAX_KEYS = 256
#: Tails kept per key (for that many different episode sets).
TAILS_PER_KEY = 4
#: Episodes computed at once; each is read and then summarized in one worker thread.
EPISODE_CONCURRENCY = 8
#: Worker threads decoding and summarizing for statistics at once.
STATS_THREADS = 1
#: Decoded bytes of one block of an episode's rows: a longer episode is read in blocks.
BLOCK_BYTES = 32 << 20
#: Chunks of one block, whatever their size: each costs a fetch and its bookkeeping (an
#: array of one-value chunks would otherwise make blocks of 8M of them).
BLOCK_CHUNKS = 1 << 14
#: The tails of one key may take at most this many bytes (about 4% of its values).
MAX_TAILS_BYTES = 512 << 20
DEFAULT_STATS_CACHE_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class _Part:
    """One (episode, key): its moments and, when it fits the budget, its (F, T) values."""

    token: int
    moments: Moments
    values: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.moments.nbytes + (0 if self.values is None else int(self.values.nbytes))


@dataclass(frozen=True, slots=True)
class _TailsEntry:
    members: dict[str, int]  # episode -> token of the part it holds
    tails: Tails
    moments: Moments  # of the whole set

    @property
    def nbytes(self) -> int:
        return self.tails.nbytes + 100 * len(self.members)


class KeyStatsEngine:
    """Computes and caches statistics; one per daemon, used on the event loop."""

    def __init__(self, catalog: Catalog, planner: Planner, cache: ChunkCache,
                 budget_bytes: int = DEFAULT_STATS_CACHE_BYTES) -> None:
        self.catalog, self.planner, self.cache = catalog, planner, cache
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[tuple[str, str, Any], _Part | _TailsEntry] = OrderedDict()
        self._bytes = 0
        self._of_episode: dict[str, set[tuple[str, str, Any]]] = {}
        self._tails_of: dict[str, list[tuple[str, str, Any]]] = {}
        self._token: Numbering[ChunkReader] = Numbering(weakref.WeakKeyDictionary())
        self._serial = 0
        self._lock = asyncio.Lock()
        self._cpu: asyncio.Semaphore | None = None
        self.rpcs = self.parts_computed = self.parts_cached = 0

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, one at a time: several CPU-bound threads at once
        make the event loop wait for the GIL behind each of them in turn (8 at once kept
        health waiting 170 ms; one alone costs the loop a few ms at most)."""
        if self._cpu is None:
            self._cpu = asyncio.Semaphore(STATS_THREADS)
        async with self._cpu:
            return await asyncio.to_thread(fn, *args)

    def counters(self) -> dict[str, int]:
        return {"key_stats_rpcs": self.rpcs, "key_stats_parts_computed": self.parts_computed,
                "key_stats_parts_cached": self.parts_cached, "key_stats_cache_bytes": self._bytes}

    # -- the request ------------------------------------------------------------------------

    async def compute(self, keys: Sequence[str], episodes: Sequence[str]) -> list[KeyStats]:
        """Statistics per key (in the order asked) over ``episodes`` (empty: every healthy
        episode of the catalog)."""
        keys = _checked_keys(keys)
        chosen = self._episodes(episodes)
        async with self._lock:
            self.rpcs += 1
            n = sum(e.total_frames for e in chosen)
            plans = [self._plan(key, chosen, n) for key in keys]
            await self._read_missing(plans, chosen)
            out = await self._in_thread(lambda: [plan.finish() for plan in plans])
            for plan in plans:
                self._keep_tails(plan)
            return out

    def _episodes(self, wanted: Sequence[str]) -> list[Episode]:
        if not wanted:
            chosen = self.catalog.healthy()
            if not chosen:
                raise InvalidArgument("the daemon serves no episodes to compute statistics of")
            return chosen
        if len(wanted) > len(self.catalog.episodes) + len(self.catalog.broken):
            raise LimitExceeded(
                f"{len(wanted)} episodes asked for, more than the {len(self.catalog.episodes)} "
                "the daemon serves")
        seen: set[str] = set()
        chosen = []
        for h in wanted:
            if h in seen:
                raise InvalidArgument(f"episode {shown(h)} is listed twice", episode=h)
            seen.add(h)
            chosen.append(self.catalog.lookup(h))
        return sorted(chosen, key=lambda e: e.hash)

    def _plan(self, key: str, chosen: list[Episode], n: int) -> KeyPlan:
        readers = [numeric_reader(e, key) for e in chosen]
        features = {r.info.feature for r in readers}
        if len(features) > 1:
            seen = {r.info.feature: r.info.episode for r in readers}
            raise InvalidArgument(
                f"key {key!r} has different feature shapes: "
                + ", ".join(f"episode {ep!r}: {f!r}" for f, ep in sorted(seen.items())),
                episode=readers[0].info.episode, key=key)
        feature = readers[0].info.feature
        tokens = {e.hash: self._token(r) for e, r in zip(chosen, readers)}
        size = math.prod(feature)
        start = self._best_tails(key, tokens, n)
        members = start.members if start is not None else {}
        room = start.tails.room if start is not None else tail_room(n)
        if (room[0] + room[1]) * size * 4 > MAX_TAILS_BYTES:
            raise LimitExceeded(
                f"key {key!r}: percentiles over {n} rows of {size} values need "
                f"{(room[0] + room[1]) * size * 4} bytes of tails, over the limit of "
                f"{MAX_TAILS_BYTES}; ask for fewer episodes at a time", key=key)
        builder = TailBuilder(size, room, start.tails if start is not None else None)
        plan = KeyPlan(key, feature, chosen, readers, tokens, builder)
        # Episodes in the tails' set are in their moments too: only the others are looked at.
        added = [e for e in chosen if e.hash not in members]
        if start is not None:
            plan.base, plan.added = start.moments, [e.hash for e in added]
        for e in added:
            part = self._get(("e", e.hash, key))
            if isinstance(part, _Part) and part.token == tokens[e.hash]:
                self.parts_cached += 1
                plan.moments[e.hash] = part.moments
                if part.values is None:
                    plan.to_read.add(e.hash)
                else:
                    plan.cached_values.append(part.values)
            else:
                plan.to_read.add(e.hash)
        return plan

    def _best_tails(self, key: str, tokens: dict[str, int], n: int) -> _TailsEntry | None:
        best = None
        for lru_key in self._tails_of.get(key, []):
            entry = self._lru.get(lru_key)
            if not isinstance(entry, _TailsEntry) or not entry.tails.covers(n):
                continue
            if not entry.members.items() <= tokens.items():
                continue
            if best is None or entry.tails.count > best.tails.count:
                best = entry
                self._lru.move_to_end(lru_key)
        return best

    async def _read_missing(self, plans: list[KeyPlan], chosen: list[Episode]) -> None:
        for plan in plans:  # values cached in parts go into the tails first, in a thread
            if plan.cached_values:
                await self._in_thread(feed_all, plan.builder, plan.cached_values)
                plan.cached_values = []
        sem = asyncio.Semaphore(EPISODE_CONCURRENCY)

        async def one(e: Episode, mine: list[KeyPlan]) -> None:
            async with sem:
                await self._read_episode(e, mine)

        work = [(e, [p for p in plans if e.hash in p.to_read]) for e in chosen]
        tasks = [asyncio.ensure_future(one(e, mine)) for e, mine in work if mine]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _read_episode(self, e: Episode, plans: list[KeyPlan]) -> None:
        """Every key of one episode: in rounds of one block per key, each round's chunks
        fetched at once and summarized in one worker thread."""
        todo = []  # plan, reader, block ranges, whether the values are kept
        for plan in plans:
            reader = e.readers[plan.key]
            size = math.prod(plan.feature) * 4
            n_chunks = -(-e.total_frames // reader.info.chunk_rows)
            step = min(BLOCK_CHUNKS,
                       max(1, BLOCK_BYTES // max(1, reader.info.chunk_rows * size)))
            # (a range, not a list: an episode may declare 10^8 chunks of 32 MiB)
            ranges = _Blocks(n_chunks, step)
            todo.append((plan, reader, ranges, e.total_frames * size <= self.budget_bytes))
        blocks: list[list[tuple[Moments, np.ndarray]]] = [[] for _ in todo]
        for k in range(max(len(ranges) for _, _, ranges, _ in todo)):
            now = [(j, t) for j, t in enumerate(todo) if k < len(t[2])]
            fetched = await asyncio.gather(*(self._chunks(e, reader, *ranges[k])
                                             for _, (_, reader, ranges, _) in now))
            done = await self._in_thread(summarize_all, [
                (reader, chunks, ranges[k][0], e.total_frames, plan.builder)
                for (_, (plan, reader, ranges, _)), chunks in zip(now, fetched)])
            for (j, (_, _, _, keep)), (part_moments, part_values) in zip(now, done):
                blocks[j].append((part_moments,
                                  part_values if keep else np.empty((0, 0), np.float32)))
        for (plan, _, _, keep), mine in zip(todo, blocks):
            moments = combine([m for m, _ in mine]) if len(mine) > 1 else mine[0][0]
            values: np.ndarray | None = None
            if keep:
                values = mine[0][1] if len(mine) == 1 else \
                    np.concatenate([v for _, v in mine], axis=1)
            plan.moments[e.hash] = moments
            self.parts_computed += 1
            self._put(("e", e.hash, plan.key), _Part(plan.tokens[e.hash], moments, values))

    async def _chunks(self, e: Episode, reader: ChunkReader, c0: int, c1: int) -> list[Any]:
        """Chunks c0..c1 of one array: cached ones copied now, the others fetched raw."""
        ids = np.arange(c0, c1 + 1, dtype=np.int64)
        uid = self.cache.uid(e.hash)
        slab, slot = self.cache.lookup(reader.info.name, np.full(len(ids), uid), ids)
        out: list[Any] = [None] * len(ids)
        for j in np.flatnonzero(slab >= 0).tolist():
            out[j] = self.cache.slab_data(int(slab[j]))[int(slot[j])].copy()
        missing = [j for j in range(len(ids)) if out[j] is None]
        self.cache.count(len(ids) - len(missing), len(missing))
        runs: list[tuple[int, int]] = []
        for j in missing:
            if runs and runs[-1][1] == j - 1:
                runs[-1] = (runs[-1][0], j)
            else:
                runs.append((j, j))
        fetched = await asyncio.gather(
            *(self.planner.fetcher.fetch_raw(reader, c0 + a, c0 + b) for a, b in runs))
        for (a, _), raws in zip(runs, fetched):
            for k, raw in enumerate(raws):
                out[a + k] = RawChunk(raw)
        return out

    # -- the cache --------------------------------------------------------------------------

    def _get(self, lru_key: tuple[str, str, Any]) -> _Part | _TailsEntry | None:
        entry = self._lru.get(lru_key)
        if entry is not None:
            self._lru.move_to_end(lru_key)
        return entry

    def _put(self, lru_key: tuple[str, str, Any], entry: _Part | _TailsEntry) -> None:
        self._pop(lru_key)
        if entry.nbytes > self.budget_bytes:
            return
        self._lru[lru_key] = entry
        self._bytes += entry.nbytes
        if lru_key[0] == "e":
            self._of_episode.setdefault(lru_key[1], set()).add(lru_key)
        else:
            self._tails_of.setdefault(lru_key[1], []).append(lru_key)
        while self._bytes > self.budget_bytes:
            self._pop(next(iter(self._lru)))

    def _pop(self, lru_key: tuple[str, str, Any]) -> None:
        entry = self._lru.pop(lru_key, None)
        if entry is None:
            return
        self._bytes -= entry.nbytes
        if lru_key[0] == "e":
            self._of_episode.get(lru_key[1], set()).discard(lru_key)
        else:
            self._tails_of[lru_key[1]].remove(lru_key)

    def _keep_tails(self, plan: KeyPlan) -> None:
        assert plan.result_tails is not None
        mine = self._tails_of.get(plan.key, [])
        for lru_key in list(mine):  # the same set asked again: the new tails replace it
            entry = self._lru.get(lru_key)
            if isinstance(entry, _TailsEntry) and entry.members == plan.tokens:
                self._pop(lru_key)
        while len(self._tails_of.get(plan.key, [])) >= TAILS_PER_KEY:
            self._pop(self._tails_of[plan.key][0])
        self._serial += 1
        assert plan.result_moments is not None
        self._put(("t", plan.key, self._serial),
                  _TailsEntry(plan.tokens, plan.result_tails, plan.result_moments))

    def drop_episode(self, episode: str) -> None:
        """Forget an episode's parts and every set's tails that hold it."""
        for lru_key in list(self._of_episode.pop(episode, set())):
            self._pop(lru_key)
        for keys in list(self._tails_of.values()):
            for lru_key in list(keys):
                entry = self._lru.get(lru_key)
                if isinstance(entry, _TailsEntry) and episode in entry.members:
                    self._pop(lru_key)


def _checked_keys(keys: Sequence[str]) -> list[str]:
    if not keys:
        raise InvalidArgument("GetKeyStats needs at least one key")
    if len(keys) > MAX_KEYS:
        raise LimitExceeded(f"{len(keys)} keys asked for, over the limit of {MAX_KEYS}")
    seen: set[str] = set()
    for key in keys:
        why = too_long("key", key)
        if why is not None:
            raise InvalidArgument(why, key=key[:MAX_NAME_CHARS])
        if key in seen:
            raise InvalidArgument(f"key {key!r} is listed twice", key=key)
        seen.add(key)
    return list(keys)


class _Blocks:
    """Blocks of ``step`` chunks over ``n`` chunks, the k-th as ``(first, last)``, made
    when asked for (a sequence of ``ceil(n / step)`` of them, none kept)."""

    def __init__(self, n: int, step: int) -> None:
        self.n, self.step = n, step

    def __len__(self) -> int:
        return -(-self.n // self.step)

    def __getitem__(self, k: int) -> tuple[int, int]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        c0 = k * self.step
        return c0, min(self.n, c0 + self.step) - 1
