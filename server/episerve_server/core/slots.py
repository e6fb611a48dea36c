"""The chunk cache's numeric storage: slabs of slots and the per-key slot tables.

A slab holds float32 chunks of one shape in one reserved anonymous mapping (memory is
committed as slots are written and given back when a slot is released); each slot carries
its LRU stamp and the table position that owns it. A slot table maps (episode uid, chunk)
of one zarr key to a slot through one flat array, so a batch resolves all of a key's chunks
with a few array operations. ``cache.ChunkCache`` decides what lives here and when it goes.
"""

from __future__ import annotations

import mmap

import numpy as np

MAX_TABLE_CHUNKS = 1 << 22  # chunks of one (episode, key) the slot table will index
_PAGE = mmap.PAGESIZE


#: Bytes of bookkeeping per slot besides its data: its stamp, owner table and position, a
#: place on the free stack, and its scratch word (int64, int32, int64, int64, int64).
SLOT_BOOKKEEPING = 36


def _reserved(count: int, dtype: type[np.generic]) -> np.ndarray:
    """``count`` values in a reserved anonymous mapping: pages are committed only where
    written, so an array sized for every slot a slab could hold costs what is used."""
    itemsize = np.dtype(dtype).itemsize
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) \
        | getattr(mmap, "MAP_NORESERVE", 0)
    return np.frombuffer(mmap.mmap(-1, max(1, count * itemsize), flags=flags), dtype,
                         count=count)


class Slab:
    """Slots for float32 chunks of one shape, backed by a reserved anonymous mapping.

    A slot costs ``cost`` bytes: its data and ``SLOT_BOOKKEEPING``. Its bookkeeping is made
    as slots are first used (``allocated`` grows; the arrays are views of reserved mappings,
    so they never move), so a slab of tiny chunks holds memory in proportion to what it
    caches, not to the slots its budget could hold (a key of one-value chunks under a 32 MiB
    budget had 8M slots' bookkeeping, 480 MiB, made up front)."""

    def __init__(self, shape: tuple[int, ...], capacity: int) -> None:
        self.shape = shape
        self.slot_bytes = int(np.prod(shape)) * 4
        self.cost = self.slot_bytes + SLOT_BOOKKEEPING
        self.capacity = capacity
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) \
            | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, max(1, capacity * self.slot_bytes), flags=flags)
        self.data = np.frombuffer(self._map, np.float32,
                                  count=capacity * int(np.prod(shape))).reshape(capacity, *shape)
        self._stamp = _reserved(capacity, np.int64)  # -1: free
        self._owner_table = _reserved(capacity, np.int32)
        self._owner_pos = _reserved(capacity, np.int64)
        self._scratch = _reserved(capacity, np.int64)
        self._stack = _reserved(capacity, np.int64)  # free slots, the next on top
        self._free = 0  # slots on the stack
        self.allocated = 0  # slots whose bookkeeping is made: [0, allocated)

    @property
    def stamp(self) -> np.ndarray:
        return self._stamp[:self.allocated]

    @property
    def owner_table(self) -> np.ndarray:
        return self._owner_table[:self.allocated]

    @property
    def owner_pos(self) -> np.ndarray:
        return self._owner_pos[:self.allocated]

    @property
    def scratch(self) -> np.ndarray:
        """One int64 per slot, for counting distinct slots."""
        return self._scratch[:self.allocated]

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (at most ``free``): released ones first, then new ones, lowest
        first, so memory grows in order."""
        if n > self._free:
            self._grow(n - self._free)
        out = self._stack[self._free - n: self._free][::-1].copy()
        self._free -= n
        return out

    def _grow(self, need: int) -> None:
        """Make the bookkeeping of ``need`` more slots (fewer if the slab is full), and put
        them under the free stack's released slots."""
        new = min(self.capacity, self.allocated + need)
        fresh = np.arange(new - 1, self.allocated - 1, -1, dtype=np.int64)
        k = len(fresh)
        self._stamp[self.allocated:new] = -1
        self._owner_table[self.allocated:new] = -1
        self._owner_pos[self.allocated:new] = -1
        self._stack[k: k + self._free] = self._stack[:self._free].copy()
        self._stack[:k] = fresh
        self._free += k
        self.allocated = new

    @property
    def free(self) -> int:
        return self._free + self.capacity - self.allocated

    def release(self, slots: np.ndarray) -> None:
        self._stamp[slots] = -1
        self._owner_table[slots] = -1
        self._stack[self._free: self._free + len(slots)] = slots
        self._free += len(slots)
        madvise = getattr(self._map, "madvise", None)
        if madvise is None or self.slot_bytes < 2 * _PAGE:
            return
        for s in slots.tolist():  # give the memory back: evicted slots are not resident
            start = -(-(s * self.slot_bytes) // _PAGE) * _PAGE
            stop = ((s + 1) * self.slot_bytes // _PAGE) * _PAGE
            if stop > start:
                madvise(mmap.MADV_DONTNEED, start, stop - start)


class SlotTable:
    """(episode uid, chunk) -> (slab, slot) for one zarr key."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.base = np.full(16, -1, np.int64)  # per uid: start in ``flat``; -1 unregistered
        self.size = np.zeros(16, np.int64)  # per uid: chunks indexed
        self.slab = np.full(16, -1, np.int64)  # per uid: its chunks' slab
        self.flat = np.full(1024, -1, np.int64)
        self.used = 0

    def ensure(self, uid: int, n_chunks: int, slab: int,
               max_len: int | None = None) -> tuple[bool, int, int]:
        """Index ``n_chunks`` chunks of ``uid``; returns (ok, old start, new start): a uid
        indexed before with fewer chunks moves to a new region, and its slots' owners with it.
        ``flat`` grows by doubling, but never past ``max_len`` entries."""
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
            grow, least = max(n_chunks, len(self.flat)), self.used + n_chunks - len(self.flat)
            if max_len is not None:
                grow = max(min(grow, max_len - len(self.flat)), least)
            self.flat = np.concatenate([self.flat, np.full(grow, -1, np.int64)])
        start = self.used
        self.flat[start: start + len(old)] = old
        if old_start >= 0:
            self.flat[old_start: old_start + len(old)] = -1
        self.base[uid], self.size[uid], self.slab[uid] = start, n_chunks, slab
        self.used += n_chunks
        return True, old_start, start

    @property
    def live(self) -> int:
        """Entries of the uids indexed now (the rest of ``used`` is left behind by moves
        and forgotten uids)."""
        return int(self.size[self.base >= 0].sum())

    def compact(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Move the indexed uids' regions together, dropping what moves and forgotten uids
        left behind; returns, per region holding slots, (its slab, those slots, their new
        positions), for the slots' owners to follow."""
        uids = np.flatnonzero(self.base >= 0)
        total = int(self.size[uids].sum())
        flat = np.full(max(1024, 2 * total), -1, np.int64)
        moved: list[tuple[int, np.ndarray, np.ndarray]] = []
        pos = 0
        for uid in uids.tolist():
            start, n = int(self.base[uid]), int(self.size[uid])
            region = self.flat[start: start + n]
            flat[pos: pos + n] = region
            held = np.flatnonzero(region >= 0)
            if held.size:
                moved.append((int(self.slab[uid]), region[held].copy(), pos + held))
            self.base[uid] = pos
            pos += n
        self.flat, self.used = flat, pos
        return moved

    def positions(self, uids: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """Flat positions of (uid, chunk) pairs; -1 where the table does not index them."""
        known = uids < len(self.base)
        base = np.where(known, self.base[np.where(known, uids, 0)], -1)
        size = np.where(known, self.size[np.where(known, uids, 0)], 0)
        ok = (base >= 0) & (chunks < size)
        return np.where(ok, base + chunks, -1)
