"""The chunk cache: decoded numeric chunks and raw frame bytes under one byte budget (LRU).

Numeric chunks live in slabs, one per chunk shape: a slab is one preallocated array of
slots (reserved, not committed: memory is committed as slots are written and released
when a slot is evicted), so a batch finds and gathers all of a key's chunks with a few
numpy calls, whatever their number. Per zarr key, a slot table maps (episode uid, chunk)
to a slot with one array index. Frame bytes (lists of ``bytes``) stay in an ordered dict.

Recency is one clock for both kinds: every hit and every store stamps its chunks, and
eviction takes the least recently stamped chunks first, numeric or bytes, until the
budget holds. The scalar ``get``/``put`` and the batched ``lookup``/``store`` share it.

One job, the cache and its eviction, hence its length.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

from episerve_server.core import kernel
from episerve_server.core.stats import Stats

ChunkKey: TypeAlias = tuple[str, str, int]
Chunk: TypeAlias = np.ndarray | list[bytes]

BYTES_OVERHEAD = 64  # per frame: the bytes object and its list slot
MAX_SLABS = 32  # distinct numeric chunk shapes cached; chunks of further shapes are not
MAX_TABLE_CHUNKS = 1 << 22  # chunks of one (episode, key) the slot table will index
_PAGE = mmap.PAGESIZE


def chunk_nbytes(chunk: Chunk) -> int:
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes)
    return sum(len(b) for b in chunk) + BYTES_OVERHEAD * len(chunk)


class _Slab:
    """Slots for float32 chunks of one shape, backed by a reserved anonymous mapping."""

    def __init__(self, shape: tuple[int, ...], capacity: int) -> None:
        self.shape = shape
        self.slot_bytes = int(np.prod(shape)) * 4
        self.capacity = capacity
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) \
            | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, max(1, capacity * self.slot_bytes), flags=flags)
        self.data = np.frombuffer(self._map, np.float32,
                                  count=capacity * int(np.prod(shape))).reshape(capacity, *shape)
        self.stamp = np.full(capacity, -1, np.int64)  # -1: free
        self.owner_table = np.full(capacity, -1, np.int32)
        self.owner_pos = np.full(capacity, -1, np.int64)
        self._scratch: np.ndarray | None = None
        self._free = list(range(capacity - 1, -1, -1))  # low slots first: memory grows in order

    def take(self, n: int) -> np.ndarray:
        out = np.array(self._free[-n:][::-1], np.int64) if n else np.empty(0, np.int64)
        del self._free[len(self._free) - n:]
        return out

    @property
    def scratch(self) -> np.ndarray:
        """One int64 per slot, for counting distinct slots (made on first use)."""
        if self._scratch is None:
            self._scratch = np.zeros(self.capacity, np.int64)
        return self._scratch

    @property
    def free(self) -> int:
        return len(self._free)

    def release(self, slots: np.ndarray) -> None:
        self.stamp[slots] = -1
        self.owner_table[slots] = -1
        self._free.extend(slots.tolist())
        madvise = getattr(self._map, "madvise", None)
        if madvise is None or self.slot_bytes < 2 * _PAGE:
            return
        for s in slots.tolist():  # give the memory back: evicted slots are not resident
            start = -(-(s * self.slot_bytes) // _PAGE) * _PAGE
            stop = ((s + 1) * self.slot_bytes // _PAGE) * _PAGE
            if stop > start:
                madvise(mmap.MADV_DONTNEED, start, stop - start)


class _Table:
    """(episode uid, chunk) -> (slab, slot) for one zarr key."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.base = np.full(16, -1, np.int64)  # per uid: start in ``flat``; -1 unregistered
        self.size = np.zeros(16, np.int64)  # per uid: chunks indexed
        self.slab = np.full(16, -1, np.int64)  # per uid: its chunks' slab
        self.flat = np.full(1024, -1, np.int64)
        self.used = 0

    def ensure(self, uid: int, n_chunks: int, slab: int) -> tuple[bool, int, int]:
        """Index ``n_chunks`` chunks of ``uid``; returns (ok, old start, new start): a uid
        indexed before with fewer chunks moves to a new region, and its slots' owners with it."""
        if uid >= len(self.base):
            grow = max(uid + 1, 2 * len(self.base)) - len(self.base)
            self.base = np.concatenate([self.base, np.full(grow, -1, np.int64)])
            self.size = np.concatenate([self.size, np.zeros(grow, np.int64)])
            self.slab = np.concatenate([self.slab, np.full(grow, -1, np.int64)])
        if self.base[uid] >= 0 and self.size[uid] >= n_chunks:
            return bool(self.slab[uid] == slab), -1, -1
        if n_chunks > MAX_TABLE_CHUNKS or (self.base[uid] >= 0 and self.slab[uid] != slab):
            return False, -1, -1
        old_start = int(self.base[uid])
        old = self.flat[old_start: old_start + self.size[uid]] \
            if old_start >= 0 else np.empty(0, np.int64)
        if self.used + n_chunks > len(self.flat):
            self.flat = np.concatenate(
                [self.flat, np.full(max(n_chunks, len(self.flat)), -1, np.int64)])
        start = self.used
        self.flat[start: start + len(old)] = old
        if old_start >= 0:
            self.flat[old_start: old_start + len(old)] = -1
        self.base[uid], self.size[uid], self.slab[uid] = start, n_chunks, slab
        self.used += n_chunks
        return True, old_start, start

    def positions(self, uids: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """Flat positions of (uid, chunk) pairs; -1 where the table does not index them."""
        known = uids < len(self.base)
        base = np.where(known, self.base[np.where(known, uids, 0)], -1)
        size = np.where(known, self.size[np.where(known, uids, 0)], 0)
        ok = (base >= 0) & (chunks < size)
        return np.where(ok, base + chunks, -1)


class ChunkCache:
    """LRU over (episode, key, chunk) under a byte budget. A budget of 0 turns it off."""

    def __init__(self, budget_bytes: int, stats: Stats) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.stats = stats
        self._clock = 0
        self._bytes = 0
        self._entries = 0
        self._uids: dict[str, int] = {}
        self._next_uid = 0
        self._tables: dict[str, _Table] = {}
        self._table_list: list[_Table] = []
        self._slabs: list[_Slab] = []
        self._slab_of: dict[tuple[int, ...], int] = {}
        self._frames: OrderedDict[ChunkKey, tuple[list[bytes], int, int]] = OrderedDict()
        self._frames_of: dict[str, set[ChunkKey]] = {}  # per episode, so a drop is cheap
        self._holds = 0  # gathers running in worker threads: slots are not reused meanwhile
        self._deferred: list[tuple[_Slab, np.ndarray]] = []
        #: Bumped by every change of what is cached (a plan made before an await checks it).
        self.version = 0
        self.drops = 0  # episodes dropped (their uids are gone)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    # -- identities ---------------------------------------------------------------------------

    def uid(self, episode: str) -> int:
        uid = self._uids.get(episode)
        if uid is None:
            uid = self._uids[episode] = self._next_uid
            self._next_uid += 1
        return uid

    def uids(self, episodes: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.uid(e) for e in episodes), np.int64, len(episodes))

    def _table(self, key: str) -> _Table:
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _Table(len(self._table_list))
            self._table_list.append(table)
        return table

    def _slab(self, shape: tuple[int, ...]) -> int:
        sid = self._slab_of.get(shape)
        if sid is None:
            slot_bytes = int(np.prod(shape)) * 4
            if len(self._slabs) >= MAX_SLABS or slot_bytes > self.budget_bytes:
                return -1
            try:
                slab = _Slab(shape, self.budget_bytes // slot_bytes)
            except (OSError, ValueError, MemoryError):
                return -1  # the reservation was refused (strict overcommit): not cached
            sid = self._slab_of[shape] = len(self._slabs)
            self._slabs.append(slab)
        return sid

    def slab_data(self, slab: int) -> np.ndarray:
        return self._slabs[slab].data

    # -- direct access for the compiled read plan (plan/compiled.py) ----------------------------

    def known_uid(self, episode: str) -> int:
        """The episode's uid, or -1 if it has none (nothing of it was ever cached)."""
        return self._uids.get(episode, -1)

    def slot_table(self, key: str) -> _Table | None:
        return self._tables.get(key) if self.enabled else None

    def stamp(self, slab: int, slots: Sequence[np.ndarray]) -> int:
        """What ``lookup`` does to chunks all found in ``slab`` at ``slots`` (repeats
        allowed): one tick of the clock, the slots stamped with it. Returns how many
        distinct slots were stamped; the caller counts the hits (``count``)."""
        self._clock += 1
        s = self._slabs[slab]
        got = kernel.stamp(s.stamp, slots, self._clock, s.scratch)
        if got < 0:
            raise RuntimeError(f"a slot outside slab {slab} was stamped")
        return got

    def hold(self) -> None:
        """While held, no slot is handed out again: a gather in a worker thread can read
        the slots it looked up, whatever the event loop evicts or drops meanwhile."""
        self._holds += 1

    def unhold(self) -> None:
        self._holds -= 1
        if not self._holds:
            for slab, slots in self._deferred:
                slab.release(slots)
            self._deferred.clear()

    # -- numeric chunks, batched --------------------------------------------------------------

    def lookup(self, key: str, uids: np.ndarray,
               chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slab, slot) per (uid, chunk), -1 where missing; hits are stamped as used.
        The caller counts hits and misses (``count``): it knows which pairs are distinct."""
        shape = uids.shape
        table = self._tables.get(key)
        if table is None or not self.enabled:
            slot = np.full(shape, -1, np.int64)
            return slot, slot
        pos = table.positions(uids.ravel(), chunks.ravel())
        slot = np.where(pos >= 0, table.flat[np.maximum(pos, 0)], -1)
        slab = np.where(slot >= 0, table.slab[np.where(pos >= 0, uids.ravel(), 0)], -1)
        self._clock += 1
        live = slab >= 0
        if live.any():
            lo, hi = int(slab[live].min()), int(slab[live].max())
            for sid in range(lo, hi + 1):
                mine = slot[slab == sid] if lo != hi else slot[live]
                self._slabs[sid].stamp[mine] = self._clock
        slot, slab = slot.reshape(shape), slab.reshape(shape).astype(np.int64)
        return slab, slot

    def count(self, hits: int, misses: int) -> None:
        self.stats.cache_hits += hits
        self.stats.cache_misses += misses

    def store(self, key: str, uid: int, n_chunks: int, chunk: int, data: np.ndarray) -> None:
        """Keep one decoded numeric chunk of (episode uid, key)."""
        self.store_many(key, [(uid, n_chunks, chunk, data)])

    def store_many(self, key: str, chunks: Sequence[tuple[int, int, int, np.ndarray]]) -> int:
        """Keep decoded numeric chunks of one key, each (uid, chunks of that episode's array,
        chunk index, data); room for all of them is made in one eviction pass. Returns how
        many were already cached (replaced: a chunk fetched twice)."""
        if not self.enabled or not chunks:
            return 0
        replaced = 0
        table = self._table(key)
        placed: list[tuple[int, int, np.ndarray]] = []  # slab, table position, data
        for uid, n_chunks, chunk, data in chunks:
            sid = self._slab(tuple(data.shape))
            if sid < 0:
                continue
            ok, old_start, new_start = table.ensure(uid, max(n_chunks, chunk + 1), sid)
            if not ok:
                continue
            slab = self._slabs[sid]
            if old_start >= 0:  # the uid's entries moved: so do their slots' owner positions
                region = table.flat[new_start: new_start + int(table.size[uid])]
                held = np.flatnonzero(region >= 0)
                slab.owner_pos[region[held]] = new_start + held
            pos = int(table.base[uid]) + chunk
            old = int(table.flat[pos])
            if old >= 0:  # replacing: the old copy goes
                self._release(sid, np.array([old], np.int64))
                replaced += 1
            placed.append((sid, pos, data))
        for sid in sorted({p[0] for p in placed}):
            mine = [(pos, data) for s, pos, data in placed if s == sid]
            slab = self._slabs[sid]
            mine = mine[-slab.capacity:]  # more than the slab can hold: keep the last
            self._make_room(slab.slot_bytes * len(mine), sid, len(mine))
            mine = mine[len(mine) - min(len(mine), slab.free):]
            slots = slab.take(len(mine))
            if not len(mine):
                continue
            slab.data[slots] = np.stack([d for _, d in mine])
            positions = np.array([pos for pos, _ in mine], np.int64)
            self._clock += 1
            slab.stamp[slots], slab.owner_table[slots] = self._clock, table.index
            slab.owner_pos[slots] = positions
            table.flat[positions] = slots
            self._bytes += slab.slot_bytes * len(mine)
            self._entries += len(mine)
        self._sync_gauges()
        return replaced

    def take_frames(self, keys: Sequence[ChunkKey]) -> list[list[bytes]]:
        """``get`` of chunks of frame bytes all known to be cached, one after another (the
        same recency, stamps and hits), without its numeric branch."""
        frames, out = self._frames, []
        for key in keys:
            chunk, size, _ = frames[key]
            frames.move_to_end(key)
            self._clock += 1
            frames[key] = (chunk, size, self._clock)
            out.append(chunk)
        self.stats.cache_hits += len(keys)
        return out

    # -- frame bytes and the scalar API -------------------------------------------------------

    def get(self, key: ChunkKey) -> Chunk | None:
        frames = self._frames.get(key)
        if frames is not None:
            self._frames.move_to_end(key)
            self._clock += 1
            self._frames[key] = (frames[0], frames[1], self._clock)
            self.stats.cache_hits += 1
            return frames[0]
        episode, name, chunk = key
        uid = self._uids.get(episode)
        table = self._tables.get(name)
        if uid is not None and table is not None:
            slab, slot = self.lookup(name, np.array([uid]), np.array([chunk]))
            if slot[0] >= 0:
                self.stats.cache_hits += 1
                found: np.ndarray = self._slabs[int(slab[0])].data[int(slot[0])].copy()
                return found
        self.stats.cache_misses += 1
        return None

    def has_frames(self, key: ChunkKey) -> bool:
        """Whether a chunk of frame bytes is cached (not counted as a hit or a miss)."""
        return key in self._frames

    def put(self, key: ChunkKey, chunk: Chunk) -> None:
        if isinstance(chunk, np.ndarray):
            if self.enabled and chunk_nbytes(chunk) <= self.budget_bytes:
                episode, name, index = key
                self.store(name, self.uid(episode), index + 1, index, chunk)
            return
        self.put_frames([(key, chunk)])

    def put_frames(self, items: Sequence[tuple[ChunkKey, list[bytes]]]) -> int:
        """Keep chunks of frame bytes; room for all of them is made in one eviction pass.
        Returns how many were already cached (replaced: a chunk fetched twice)."""
        if not self.enabled:
            return 0
        replaced = 0
        fits = [(k, c, chunk_nbytes(c)) for k, c in items]
        fits = [(k, c, n) for k, c, n in fits if n <= self.budget_bytes]
        for key, _, _ in fits:
            old = self._frames.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
                self._entries -= 1
                replaced += 1
        while sum(n for _, _, n in fits) > self.budget_bytes:
            fits.pop(0)  # more than the whole budget: keep the last ones
        if not fits:
            return replaced
        self._make_room(sum(n for _, _, n in fits))
        self._clock += 1
        for key, chunk, size in fits:
            self._frames[key] = (list(chunk), size, self._clock)
            self._frames_of.setdefault(key[0], set()).add(key)
            self._bytes += size
            self._entries += 1
        self._sync_gauges()
        return replaced

    # -- eviction -----------------------------------------------------------------------------

    def _make_room(self, nbytes: int, slab_id: int = -1, slots: int = 0) -> None:
        """Evict least recently used chunks until ``nbytes`` more fit in the budget (and
        ``slab_id`` has ``slots`` free slots). One pass, however many chunks go."""
        deficit = self._bytes + nbytes - self.budget_bytes
        if deficit > 0 and self._entries:
            stamps: list[np.ndarray] = []
            owners: list[tuple[int, np.ndarray]] = []
            for sid, slab in enumerate(self._slabs):
                live = np.flatnonzero(slab.stamp >= 0)
                k = min(len(live), -(-deficit // slab.slot_bytes))
                if k:
                    pick = live[np.argpartition(slab.stamp[live], k - 1)[:k]]
                    stamps.append(slab.stamp[pick])
                    owners.append((sid, pick))
            frame_stamps, frame_sizes, covered = [], [], 0
            for _, size, stamp in self._frames.values():  # oldest first
                if covered >= deficit:
                    break
                frame_stamps.append(stamp)
                frame_sizes.append(size)
                covered += size
            kinds = [np.full(len(st), i, np.int64) for i, st in enumerate(stamps)]
            all_stamps = np.concatenate([*stamps, np.array(frame_stamps, np.int64)])
            all_kinds = np.concatenate([*kinds, np.full(len(frame_stamps), -1, np.int64)])
            all_index = np.concatenate([*(np.arange(len(st)) for st in stamps),
                                        np.arange(len(frame_stamps))])
            sizes = np.concatenate([*(np.full(len(st), self._slabs[sid].slot_bytes, np.int64)
                                      for st, (sid, _) in zip(stamps, owners)),
                                    np.array(frame_sizes, np.int64)])
            order = np.argsort(all_stamps, kind="stable")
            n = int(np.searchsorted(np.cumsum(sizes[order]), deficit)) + 1
            chosen = order[:n]
            frames_out = int((all_kinds[chosen] == -1).sum())
            for _ in range(frames_out):
                gone, (_, size, _) = self._frames.popitem(last=False)
                self._frames_of.get(gone[0], set()).discard(gone)
                self._bytes -= size
                self._entries -= 1
            for i, (sid, pick) in enumerate(owners):
                mine = all_index[chosen[all_kinds[chosen] == i]]
                if mine.size:
                    self._release(sid, pick[mine])
            self.stats.cache_evictions += len(chosen)
        if slab_id >= 0 and self._slabs[slab_id].free < slots:
            slab = self._slabs[slab_id]  # the slab itself is full: its oldest slots go
            live = np.flatnonzero(slab.stamp >= 0)
            k = min(len(live), slots - slab.free)
            if k:
                self._release(slab_id, live[np.argpartition(slab.stamp[live], k - 1)[:k]])
                self.stats.cache_evictions += k
        self._sync_gauges()

    def _release(self, sid: int, slots: np.ndarray) -> None:
        slab = self._slabs[sid]
        live = slots[slab.stamp[slots] >= 0]
        for t in np.unique(slab.owner_table[live]).tolist():
            mine = live[slab.owner_table[live] == t]
            flat = self._table_list[t].flat
            pos = slab.owner_pos[mine]
            flat[pos[flat[pos] == mine]] = -1
        if self._holds:
            self._deferred.append((slab, live))
            slab.stamp[live] = -1  # gone for lookups and eviction; reused after the hold
        else:
            slab.release(live)
        self._bytes -= slab.slot_bytes * len(live)
        self._entries -= len(live)
        self._sync_gauges()

    def drop_episode(self, episode: str) -> None:
        """Forget one episode's chunks; costs what that episode holds, not the cache."""
        for key in self._frames_of.pop(episode, set()):
            entry = self._frames.pop(key, None)
            if entry is None:
                continue
            self._bytes -= entry[1]
            self._entries -= 1
        uid = self._uids.pop(episode, None)
        self.drops += 1
        if uid is not None:
            for table in self._table_list:
                if uid < len(table.base) and table.base[uid] >= 0:
                    start, n = int(table.base[uid]), int(table.size[uid])
                    slots = table.flat[start: start + n]
                    held = slots[slots >= 0]
                    if held.size:
                        self._release(int(table.slab[uid]), held.copy())
                    table.base[uid] = -1
        self._sync_gauges()

    def _sync_gauges(self) -> None:
        self.version += 1
        self.stats.cache_bytes = self._bytes
        self.stats.cache_entries = self._entries

    def __getstate__(self) -> Any:  # the slabs are memory maps: a cache is never pickled
        raise TypeError("a ChunkCache cannot be pickled")
