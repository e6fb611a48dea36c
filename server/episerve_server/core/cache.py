"""The chunk cache: decoded numeric chunks and raw JPEG bytes under a byte budget (LRU)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeAlias

import numpy as np

from episerve_server.core.stats import Stats

ChunkKey: TypeAlias = tuple[str, str, int]
Chunk: TypeAlias = np.ndarray | list[bytes]


def chunk_nbytes(chunk: Chunk) -> int:
    if isinstance(chunk, np.ndarray):
        return int(chunk.nbytes)
    return sum(len(b) for b in chunk) + 64 * len(chunk)


class ChunkCache:
    """LRU over (episode, key, chunk index). A budget of 0 turns it off."""

    def __init__(self, budget_bytes: int, stats: Stats) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.stats = stats
        self._entries: OrderedDict[ChunkKey, tuple[Chunk, int]] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def get(self, key: ChunkKey) -> Chunk | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.cache_misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.cache_hits += 1
        return entry[0]

    def put(self, key: ChunkKey, chunk: Chunk) -> None:
        if not self.enabled:
            return
        size = chunk_nbytes(chunk)
        if size > self.budget_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[key] = (chunk, size)
        self._bytes += size
        while self._bytes > self.budget_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted
            self.stats.cache_evictions += 1
        self._sync_gauges()

    def drop_episode(self, episode: str) -> None:
        for key in [k for k in self._entries if k[0] == episode]:
            self._bytes -= self._entries.pop(key)[1]
        self._sync_gauges()

    def _sync_gauges(self) -> None:
        self.stats.cache_bytes = self._bytes
        self.stats.cache_entries = len(self._entries)
