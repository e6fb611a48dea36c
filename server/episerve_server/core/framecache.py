"""The chunk cache's frame bytes: per chunk key a list of ``bytes``, with each chunk's
recency kept in arrays, as the slabs keep their slots'.

A chunk has a number (``fid``) for as long as it is cached; by that number the arrays hold
its stamp (the cache clock at its last store or hit, what eviction compares with the
slabs' stamps), its order (a count of every store and hit of a frame chunk: the order of
the least recently used first) and its bytes. A batch's hits are then two array
assignments, however many chunks it takes, where a linked list moved each chunk to its
end one at a time; eviction partitions the orders instead of walking that list.

A chunk may be *kept* (``kept``): a read to come wants it (a prefetch hint named it).
Eviction takes kept chunks only once every other frame chunk is gone.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

ChunkKey: TypeAlias = tuple[str, str, int]

_FID = operator.itemgetter(2)
FIRST_ROOM = 64  # chunks the arrays hold before they first grow (they double)


class FrameChunks:
    def __init__(self) -> None:
        #: chunk key -> [frames, their bytes as charged, fid]: a list, so a caller holding
        #: one (``ChunkCache.frames_found``) sees what a later store or hit did to it
        self.entries: dict[ChunkKey, list[Any]] = {}
        self._of_episode: dict[str, set[ChunkKey]] = {}  # so a drop costs that episode's
        self.stamp = np.full(FIRST_ROOM, -1, np.int64)  # -1: the fid is free
        self.order = np.zeros(FIRST_ROOM, np.int64)
        self.nbytes = np.zeros(FIRST_ROOM, np.int64)
        self.payload = np.zeros(FIRST_ROOM, np.int64)  # the frames' own bytes
        self.kept = np.zeros(FIRST_ROOM, bool)  # wanted by a read to come
        self._key: list[ChunkKey | None] = [None] * FIRST_ROOM
        self._free = list(range(FIRST_ROOM - 1, -1, -1))
        self._count = 0  # stores and hits so far: the last one's order

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: ChunkKey, frames: list[bytes], nbytes: int, clock: int,
            kept: bool = False) -> None:
        """Keep a chunk that is not kept yet, the most recent one, stamped ``clock``
        (``nbytes``: what it is charged, its frames' bytes and an overhead per frame;
        ``kept``: a read to come wants it)."""
        if not self._free:
            self._grow()
        fid = self._free.pop()
        self._count += 1
        self.stamp[fid], self.order[fid], self.nbytes[fid] = clock, self._count, nbytes
        self.payload[fid] = sum(map(len, frames))
        self.kept[fid] = kept
        self._key[fid] = key
        self.entries[key] = [frames, nbytes, fid]
        self._of_episode.setdefault(key[0], set()).add(key)

    def remove(self, key: ChunkKey) -> list[Any] | None:
        """Forget a chunk; its entry, or None if it was not kept."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._release(entry[2])
            mine = self._of_episode.get(key[0])
            if mine is not None:
                mine.discard(key)
        return entry

    def drop_episode(self, episode: str) -> tuple[int, int]:
        """Forget an episode's chunks: (how many, their bytes)."""
        gone = nbytes = 0
        for key in self._of_episode.pop(episode, set()):
            entry = self.entries.pop(key, None)
            if entry is not None:
                self._release(entry[2])
                gone, nbytes = gone + 1, nbytes + entry[1]
        return gone, nbytes

    @staticmethod
    def fids(entries: list[list[Any]]) -> np.ndarray:
        return np.fromiter(map(_FID, entries), np.int64, len(entries))

    def touch(self, fids: np.ndarray, clock: int) -> None:
        """Hits, in this order: the chunks ``fids`` (kept ones, each once) are stamped
        ``clock``, ``clock + 1`` and so on, and become the most recent, the last one most."""
        n = len(fids)
        self.stamp[fids] = np.arange(clock, clock + n, dtype=np.int64)
        self.order[fids] = np.arange(self._count + 1, self._count + 1 + n, dtype=np.int64)
        self._count += n

    def touch_one(self, entry: list[Any], clock: int) -> None:
        fid = entry[2]
        self._count += 1
        self.stamp[fid], self.order[fid] = clock, self._count

    def mark(self, keys: Sequence[ChunkKey], kept: bool) -> None:
        """Mark the cached chunks of ``keys`` as wanted by a read to come, or no longer."""
        fids = [entry[2] for entry in map(self.entries.get, keys) if entry is not None]
        if fids:
            self.kept[np.array(fids, np.int64)] = kept

    def kept_bytes(self) -> int:
        return int(self.nbytes[self.kept].sum())

    def oldest(self, nbytes: int) -> np.ndarray:
        """The fids of the chunks eviction takes first, the fewest whose bytes reach
        ``nbytes`` (all of them if they do not): the least recently used of those no read
        to come wants, oldest first, then, if they are not enough, of the wanted ones."""
        live = np.flatnonzero(self.stamp >= 0)
        wanted = self.kept[live]
        if not wanted.any():
            return self._lru(live, nbytes)
        first = self._lru(live[~wanted], nbytes)
        short = nbytes - int(self.nbytes[first].sum())
        if short <= 0:
            return first
        return np.concatenate([first, self._lru(live[wanted], short)])

    def _lru(self, live: np.ndarray, nbytes: int) -> np.ndarray:
        """Of the chunks ``live``, the least recently used, oldest first, the fewest whose
        bytes reach ``nbytes``. One pass finds them and partitions their orders (as the
        slabs' eviction does); only the partition is sorted, widened until it covers
        ``nbytes``, so the sort grows with what goes."""
        k = min(len(live), FIRST_ROOM)
        while k:
            part = live if k == len(live) else live[np.argpartition(self.order[live], k - 1)[:k]]
            part = part[np.argsort(self.order[part])]
            reach = np.cumsum(self.nbytes[part])
            if reach[-1] >= nbytes or k == len(live):
                return part[: int(np.searchsorted(reach, nbytes)) + 1]
            k = min(len(live), 4 * k)
        return live

    def items(self, fids: np.ndarray) -> list[tuple[ChunkKey, list[bytes]]]:
        """The kept chunks ``fids``: (key, frames) each."""
        out = []
        for fid in fids.tolist():
            key = self._key[fid]
            if key is not None:
                out.append((key, self.entries[key][0]))
        return out

    def evict(self, fids: np.ndarray) -> int:
        """Forget the chunks ``fids`` (from ``oldest``); returns their bytes."""
        nbytes = 0
        for fid in fids.tolist():
            key = self._key[fid]
            if key is not None:
                nbytes += self.remove(key)[1]  # type: ignore[index]
        return nbytes

    def state(self) -> list[tuple[ChunkKey, int, int, int]]:
        """Each kept chunk, least recent first: (key, bytes, stamp, order) (for tests)."""
        fids = [e[2] for e in self.entries.values()]
        rows = [(k, int(self.nbytes[f]), int(self.stamp[f]), int(self.order[f]))
                for k, f in zip(self.entries, fids)]
        return sorted(rows, key=lambda row: row[3])

    def _release(self, fid: int) -> None:
        self.stamp[fid] = -1
        self.kept[fid] = False
        self._key[fid] = None
        self._free.append(fid)

    def _grow(self) -> None:
        n = len(self.stamp)
        self.stamp = np.concatenate([self.stamp, np.full(n, -1, np.int64)])
        self.order = np.concatenate([self.order, np.zeros(n, np.int64)])
        self.nbytes = np.concatenate([self.nbytes, np.zeros(n, np.int64)])
        self.payload = np.concatenate([self.payload, np.zeros(n, np.int64)])
        self.kept = np.concatenate([self.kept, np.zeros(n, bool)])
        self._key.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))
