"""The chunk cache: decoded numeric chunks and raw frame bytes under one byte budget (LRU).

Numeric chunks live in slabs, one per chunk shape: a slab is one preallocated array of
slots (reserved, not committed: memory is committed as slots are written and released
when a slot is evicted), so a batch finds and gathers all of a key's chunks with a few
numpy calls, whatever their number. Per zarr key, a slot table maps (episode uid, chunk)
to a slot with one array index. Frame bytes (lists of ``bytes``) are kept by chunk key,
their recency in arrays like the slabs' (``framecache``).

Recency is one clock for both kinds: every hit and every store stamps its chunks, and
eviction takes the least recently stamped chunks first, numeric or bytes, until the
budget holds. The scalar ``get``/``put`` and the batched ``lookup``/``store`` share it.
The slabs and slot tables themselves are in ``slots``.

**One store keeps at most half the budget of frames**: a batch that decoded more than
that keeps its last frames, and what earlier batches kept stays.

**Frames a read to come wants** (``want``: the frame chunks a prefetch hint names) are kept
ahead of the rest: eviction takes them last, and a frame chunk no such read wants is not
kept at all when keeping it would evict one that is wanted (it is served, and counted in
``frames_not_cached``). A hint's frames stay wanted until ``WANTED_HINTS`` later hints have
come, or for ``WANTED_S`` seconds, whichever is first.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import numpy as np

from episerve_server.core.counters import Stats
from episerve_server.core.framecache import ChunkKey, FrameChunks
from episerve_server.core.kernel import CORE, CoreLoops
from episerve_server.core.numbering import Numbering
from episerve_server.core.slots import SLOT_BOOKKEEPING, Slab, SlotTable

Chunk: TypeAlias = np.ndarray | list[bytes]
#: Told the frame chunks the cache lets go (evicted, or not kept): (key, frames) each.
EvictHook: TypeAlias = Callable[[list[tuple[ChunkKey, list[bytes]]]], None]

BYTES_OVERHEAD = 64  # per frame: the bytes object and its list slot
_FRAMES = operator.itemgetter(0)  # of a frame chunk's entry
#: The slot tables may always hold this many entries, whatever the budget.
INDEX_MIN_ENTRIES = 1 << 16
MAX_SLABS = 32  # distinct numeric chunk shapes cached; chunks of further shapes are not
#: A prefetch hint's frames are wanted until this many later hints have come (a sampler
#: hints a batch a few batches ahead of its read), or for this long.
WANTED_HINTS = 8
WANTED_S = 30.0


def chunk_nbytes(chunk: Chunk) -> int:
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes) + SLOT_BOOKKEEPING  # its slot's bookkeeping too
    return sum(len(b) for b in chunk) + BYTES_OVERHEAD * len(chunk)


def _last_within(items: list[tuple[ChunkKey, list[bytes], int]], limit: int,
                 keep_one: bool = False
                 ) -> tuple[list[tuple[ChunkKey, list[bytes], int]],
                            list[tuple[ChunkKey, list[bytes], int]]]:
    """(the first ones, the last ones whose sizes add up to at most ``limit``; with
    ``keep_one``, at least the last one)."""
    total, k = 0, len(items)
    while k and total + items[k - 1][2] <= limit:
        total += items[k - 1][2]
        k -= 1
    if keep_one and k == len(items) and items:
        k -= 1
    return items[:k], items[k:]


class ChunkCache:
    """LRU over (episode, key, chunk) under a byte budget. A budget of 0 turns it off."""

    def __init__(self, budget_bytes: int, stats: Stats, loops: CoreLoops = CORE) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        #: Entries the slot tables may hold together (8 bytes each): a quarter of the budget.
        self.index_limit = max(INDEX_MIN_ENTRIES, budget_bytes // 32)
        self.stats = stats
        self.loops = loops
        self._clock = 0
        self._bytes = 0
        self._entries = 0
        self._uids: Numbering[str] = Numbering()
        self._tables: dict[str, SlotTable] = {}
        self._table_list: list[SlotTable] = []
        self._slabs: list[Slab] = []
        self._slab_of: dict[tuple[int, ...], int] = {}
        self._frames = FrameChunks()
        self._wanted: dict[ChunkKey, int] = {}  # frame chunk -> hints wanting it
        self._hinted: deque[tuple[float, list[ChunkKey]]] = deque()  # (when, its chunks)
        #: told the frame chunks evicted or not kept (the spill tier), if set
        self.on_evict: EvictHook | None = None
        self._holds = 0  # gathers running in worker threads: slots are not reused meanwhile
        self._deferred: list[tuple[Slab, np.ndarray]] = []
        #: Slots reads keep while they fetch the rest of their batch (``pin``), with how many
        #: reads keep each; one evicted meanwhile is handed out again only once unpinned.
        self._pins: dict[tuple[int, int], int] = {}
        self._unpinned_later: set[tuple[int, int]] = set()
        #: Bumped by every change of what is cached (a plan made before an await checks it).
        self.version = 0
        self.drops = 0  # episodes dropped (their uids are gone)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def room(self) -> int:
        """Bytes the cache can take before it must evict."""
        return max(0, self.budget_bytes - self._bytes)

    # -- identities ---------------------------------------------------------------------------

    def uid(self, episode: str) -> int:
        return self._uids(episode)

    def uids(self, episodes: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.uid(e) for e in episodes), np.int64, len(episodes))

    def _table(self, key: str) -> SlotTable:
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = SlotTable(len(self._table_list))
            self._table_list.append(table)
        return table

    def _slab(self, shape: tuple[int, ...]) -> int:
        sid = self._slab_of.get(shape)
        if sid is None:
            slot_bytes = int(np.prod(shape)) * 4
            if len(self._slabs) >= MAX_SLABS or slot_bytes + SLOT_BOOKKEEPING > self.budget_bytes:
                return -1
            try:  # a slot costs its data and its bookkeeping, both within the budget
                slab = Slab(shape, self.budget_bytes // (slot_bytes + SLOT_BOOKKEEPING))
            except (OSError, ValueError, MemoryError):
                return -1  # the reservation was refused (strict overcommit): not cached
            sid = self._slab_of[shape] = len(self._slabs)
            self._slabs.append(slab)
        return sid

    def slab_data(self, slab: int) -> np.ndarray:
        return self._slabs[slab].data

    def slab_rows(self) -> list[int]:
        """Rows per slot of each slab (its chunks' rows)."""
        return [s.shape[0] for s in self._slabs]

    # -- direct access for the read plan (plan/locate.py) ---------------------------------------

    def known_uid(self, episode: str) -> int:
        """The episode's uid, or -1 if it has none (nothing of it was ever cached)."""
        return self._uids.table.get(episode, -1)

    def slot_table(self, key: str) -> SlotTable | None:
        return self._tables.get(key) if self.enabled else None

    def stamp_slabs(self, items: Sequence[tuple[int, Sequence[np.ndarray]]]) -> int:
        """What ``lookup`` does to chunks all found, per (slab, slots) in turn (repeats
        allowed): one tick of the clock each, its slots stamped with it; one kernel call.
        Returns how many distinct slots were stamped; the caller counts the hits
        (``count``)."""
        slabs = self._slabs
        got = self.loops.stamp_keys(tuple((slabs[sid].stamp, slots, slabs[sid].scratch)
                                      for sid, slots in items), self._clock + 1)
        if got < 0:
            raise RuntimeError("a slot outside its slab was stamped")
        self._clock += len(items)
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

    def _index_room(self, table: SlotTable, uid: int, n_chunks: int) -> int:
        """Whether ``table`` may index ``n_chunks`` chunks of ``uid``. A table indexes an
        episode's array by its declared chunk count (8 bytes each), so what the tables hold
        follows what files declare: all of them together stay within ``index_limit``
        entries (a quarter of the budget's bytes), and a table whose space is mostly left
        behind (by moves and dropped episodes) is compacted first. An array past the limit
        is read every time instead of cached. Returns the entries ``table`` may still grow
        by, or -1 when it cannot index them."""
        if uid < len(table.base) and table.base[uid] >= 0 and table.size[uid] >= n_chunks:
            return 0  # indexed already: nothing grows
        if table.used + n_chunks <= len(table.flat):
            return 0  # fits the table as it is
        if table.used - table.live >= table.live:
            for sid, slots, positions in table.compact():
                self._slabs[sid].owner_pos[slots] = positions
            self.version += 1  # positions moved: plans made before are stale
        held = sum(len(t.flat) for t in self._table_list)
        need = max(0, table.used + n_chunks - len(table.flat))
        if held + need > self.index_limit:
            self.stats.cache_index_refused += 1
            return -1
        return self.index_limit - held

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

    def find(self, key: str, uids: np.ndarray,
             chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slab, slot) per (uid, chunk), -1 where missing (a uid of -1 has none); nothing
        is stamped or counted (``stamp_slabs`` does that for what a read uses)."""
        table = self._tables.get(key)
        if table is None or not self.enabled:
            none = np.full(uids.shape, -1, np.int64)
            return none, none
        pos = table.positions(np.maximum(uids, 0), chunks)
        pos[uids < 0] = -1
        slot = np.where(pos >= 0, table.flat[np.maximum(pos, 0)], -1)
        slab = np.where(slot >= 0, table.slab[np.where(pos >= 0, uids, 0)], -1)
        return slab.astype(np.int64), slot

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
        # slab, uid, chunk, data: positions are found when placed, since a later chunk may
        # move regions (its uid's growing, or a compaction of the table)
        placed: list[tuple[int, int, int, np.ndarray]] = []
        for uid, n_chunks, chunk, data in chunks:
            sid = self._slab(tuple(data.shape))
            if sid < 0:
                continue
            room = self._index_room(table, uid, max(n_chunks, chunk + 1))
            if room < 0:
                continue  # indexing it would pass the index's share: not cached
            ok, old_start, new_start = table.ensure(uid, max(n_chunks, chunk + 1), sid,
                                                    len(table.flat) + room)
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
            placed.append((sid, uid, chunk, data))
        for sid in sorted({p[0] for p in placed}):
            mine = [(int(table.base[uid]) + chunk, data) for s, uid, chunk, data in placed
                    if s == sid]
            slab = self._slabs[sid]
            mine = mine[-slab.capacity:]  # more than the slab can hold: keep the last
            self._make_room(slab.cost * len(mine), sid, len(mine))
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
            self._bytes += slab.cost * len(mine)
            self._entries += len(mine)
        self._sync_gauges()
        return replaced

    def take_frames(self, keys: Sequence[ChunkKey], entries: list[list[Any]] | None = None,
                    fids: np.ndarray | None = None) -> list[list[bytes]]:
        """``get`` of cached frame chunks (distinct) in turn: each a hit with its own tick
        of the clock, no numeric branch; stamped in two array assignments. ``entries`` and
        their ``fids``, from ``frames_found`` and ``frame_ids``, save looking them up."""
        if entries is None:
            entries = list(map(self._frames.entries.__getitem__, keys))
        self._frames.touch(self._frames.fids(entries) if fids is None else fids,
                           self._clock + 1)
        self._clock += len(entries)
        self.stats.cache_hits += len(entries)
        return list(map(_FRAMES, entries))

    def frame_ids(self, entries: list[list[Any]]) -> np.ndarray:
        """The numbers of chunks found by ``frames_found`` (valid while the cache's
        ``version`` is unchanged)."""
        return self._frames.fids(entries)

    def frame_bytes(self, fids: np.ndarray) -> np.ndarray:
        """The frames' own bytes of each chunk of ``fids`` (what a response limit counts)."""
        got: np.ndarray = self._frames.payload[fids]
        return got

    def frames_found(self, keys: Sequence[ChunkKey]) -> list[list[Any] | None]:
        """Each chunk as kept, [frames, bytes, fid], or None where it is not cached.
        Nothing is stamped or counted."""
        return list(map(self._frames.entries.get, keys))

    # -- frame bytes and the scalar API -------------------------------------------------------

    def get(self, key: ChunkKey) -> Chunk | None:
        frames = self._frames.entries.get(key)
        if frames is not None:
            self._clock += 1
            self._frames.touch_one(frames, self._clock)
            self.stats.cache_hits += 1
            return cast(list[bytes], frames[0])
        episode, name, chunk = key
        uid = self._uids.table.get(episode)
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
        return key in self._frames.entries

    def put(self, key: ChunkKey, chunk: Chunk) -> None:
        if isinstance(chunk, np.ndarray):
            if self.enabled and chunk_nbytes(chunk) <= self.budget_bytes:
                episode, name, index = key
                self.store(name, self.uid(episode), index + 1, index, chunk)
            return
        self.put_frames([(key, chunk)])

    def want(self, keys: Sequence[ChunkKey]) -> None:
        """Frame chunks a read to come uses (a prefetch hint's): kept ahead of the others
        until ``WANTED_HINTS`` later hints have come or ``WANTED_S`` have passed."""
        if not self.enabled:
            return
        mine = list(dict.fromkeys(keys))
        self._hinted.append((time.monotonic(), mine))
        for key in mine:
            self._wanted[key] = self._wanted.get(key, 0) + 1
        self._frames.mark(mine, True)
        self._forget_wanted()

    def frame_items(self) -> list[tuple[ChunkKey, list[bytes]]]:
        """Every frame chunk kept: (key, frames) each."""
        return [(key, entry[0]) for key, entry in self._frames.entries.items()]

    def wanted(self, key: ChunkKey) -> bool:
        return key in self._wanted

    def _forget_wanted(self) -> None:
        """Hints past ``WANTED_HINTS`` or older than ``WANTED_S``: their frames are no longer
        wanted (unless a later hint wants them too)."""
        expired = time.monotonic() - WANTED_S
        while self._hinted and (len(self._hinted) > WANTED_HINTS
                                or self._hinted[0][0] < expired):
            gone = []
            for key in self._hinted.popleft()[1]:
                left = self._wanted.pop(key) - 1
                if left:
                    self._wanted[key] = left
                else:
                    gone.append(key)
            self._frames.mark(gone, False)

    def put_frames(self, items: Sequence[tuple[ChunkKey, list[bytes]]]) -> int:
        """Keep chunks of frame bytes; room for them is made in one eviction pass. Chunks
        no read to come wants are kept only as far as they fit beside those that are
        wanted, and one store keeps at most half the budget (its last chunks; a single
        chunk up to the whole budget), so a batch that decoded more than the cache can
        hold does not push out everything earlier batches kept. Returns how many were
        already cached (replaced: a chunk fetched twice)."""
        if not self.enabled:
            return 0
        replaced = 0
        fits = [(k, c, chunk_nbytes(c)) for k, c in items]
        fits = [(k, c, n) for k, c, n in fits if n <= self.budget_bytes]
        for key, _, _ in fits:
            old = self._frames.remove(key)
            if old is not None:
                self._bytes -= old[1]
                self._entries -= 1
                replaced += 1
        wanted = self._wanted
        let_go: list[tuple[ChunkKey, list[bytes], int]] = []
        if wanted:
            self._forget_wanted()
            ahead = [item for item in fits if item[0] in wanted]
            rest = [item for item in fits if item[0] not in wanted]
            room = self.budget_bytes - self._frames.kept_bytes() - sum(n for *_, n in ahead)
            # served, not kept: keeping them would push out a wanted one
            let_go, rest = _last_within(rest, room)
            fits = rest + ahead
        # one store keeps at most half the budget (its last chunks), a single chunk whole
        over, fits = _last_within(fits, self.budget_bytes // 2, keep_one=True)
        let_go += over
        if let_go:
            self.stats.frames_not_cached += len(let_go)
            if self.on_evict is not None:
                self.on_evict([(k, c) for k, c, _ in let_go])
        if not fits:
            return replaced
        self._make_room(sum(n for _, _, n in fits))
        self._clock += 1
        for key, chunk, size in fits:
            self._frames.add(key, list(chunk), size, self._clock, key in wanted)
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
                k = min(len(live), -(-deficit // slab.cost))
                if k:
                    pick = live[np.argpartition(slab.stamp[live], k - 1)[:k]]
                    stamps.append(slab.stamp[pick])
                    owners.append((sid, pick))
            oldest = self._frames.oldest(deficit)
            frame_sizes = self._frames.nbytes[oldest]
            # wanted frames go after every slot: last in the merge, in ``oldest``'s order
            frame_stamps = np.where(self._frames.kept[oldest], np.iinfo(np.int64).max,
                                    self._frames.stamp[oldest])
            kinds = [np.full(len(st), i, np.int64) for i, st in enumerate(stamps)]
            all_stamps = np.concatenate([*stamps, frame_stamps])
            all_kinds = np.concatenate([*kinds, np.full(len(frame_stamps), -1, np.int64)])
            all_index = np.concatenate([*(np.arange(len(st)) for st in stamps),
                                        np.arange(len(frame_stamps))])
            sizes = np.concatenate([*(np.full(len(st), self._slabs[sid].cost, np.int64)
                                      for st, (sid, _) in zip(stamps, owners)),
                                    frame_sizes])
            order = np.argsort(all_stamps, kind="stable")
            n = int(np.searchsorted(np.cumsum(sizes[order]), deficit)) + 1
            chosen = order[:n]
            frames_out = int((all_kinds[chosen] == -1).sum())
            if frames_out:
                if self.on_evict is not None:
                    self.on_evict(self._frames.items(oldest[:frames_out]))
                self._bytes -= self._frames.evict(oldest[:frames_out])
                self._entries -= frames_out
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
        self._bytes -= slab.cost * len(live)
        self._entries -= len(live)
        if self._pins:
            kept = np.fromiter(((sid, s) in self._pins for s in live.tolist()), np.bool_,
                               len(live))
            if kept.any():  # gone for lookups and eviction; handed out once unpinned
                self._unpinned_later.update((sid, s) for s in live[kept].tolist())
                slab.stamp[live[kept]] = -1
                live = live[~kept]
        self._free_slots(slab, live)
        self._sync_gauges()

    def _free_slots(self, slab: Slab, live: np.ndarray) -> None:
        if self._holds:
            self._deferred.append((slab, live))
            slab.stamp[live] = -1  # gone for lookups and eviction; reused after the hold
        else:
            slab.release(live)

    def pin(self, items: Sequence[tuple[int, int]]) -> None:
        """Keep each (slab, slot) of ``items`` from being handed out again, evicted or not,
        until ``unpin``: a read's found chunks while it fetches the rest of its batch. What
        a pinned slot holds stays readable; its bytes leave the budget when it is evicted."""
        for item in items:
            self._pins[item] = self._pins.get(item, 0) + 1

    def unpin(self, items: Sequence[tuple[int, int]]) -> None:
        """Undo ``pin`` of ``items``; a slot evicted meanwhile is free once no read keeps it."""
        freed: dict[int, list[int]] = {}
        for item in items:
            left = self._pins[item] - 1
            if left:
                self._pins[item] = left
                continue
            del self._pins[item]
            if item in self._unpinned_later:
                self._unpinned_later.discard(item)
                freed.setdefault(item[0], []).append(item[1])
        for sid, slots in freed.items():
            self._free_slots(self._slabs[sid], np.array(slots, np.int64))

    def drop_episode(self, episode: str) -> None:
        """Forget one episode's chunks; costs what that episode holds, not the cache."""
        gone, nbytes = self._frames.drop_episode(episode)
        self._bytes -= nbytes
        self._entries -= gone
        uid = self._uids.table.pop(episode, None)
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
        self.stats.cache_index_bytes = 8 * sum(len(t.flat) for t in self._table_list)

    def __getstate__(self) -> Any:  # the slabs are memory maps: a cache is never pickled
        raise TypeError("a ChunkCache cannot be pickled")
