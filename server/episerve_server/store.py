"""Opening a dataset root as a zarr store, wrapped so every request is counted."""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Iterable
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from .stats import Stats

METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"})


class CountingStore(WrapperStore[Store]):
    """Counts metadata documents and data reads separately; optionally adds latency.

    ``latency_s`` exists for fault tests that need slow storage.
    """

    def __init__(self, store: Store, stats: Stats | None = None, latency_s: float = 0.0) -> None:
        super().__init__(store)
        self.stats = stats if stats is not None else Stats()
        self.latency_s = latency_s

    def _with_store(self, store: Store) -> CountingStore:
        return type(self)(store, self.stats, self.latency_s)

    def _count(self, key: str) -> None:
        if posixpath.basename(key) in METADATA_NAMES:
            self.stats.metadata_requests += 1
        else:
            self.stats.store_reads += 1

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        self._count(key)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return await self._store.get(key, prototype, byte_range)

    async def get_index(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """A shard-index read: a metadata hop, counted as one."""
        self.stats.metadata_requests += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        for key, _ in key_ranges:
            self._count(key)
        return await self._store.get_partial_values(prototype, key_ranges)


def open_root(
    root: str, *, stats: Stats, storage_options: dict[str, Any] | None = None
) -> CountingStore:
    """A read-only store for a local folder or an fsspec URL such as ``s3://bucket/prefix``."""
    if "://" in root and not root.startswith("file://"):
        inner: Store = FsspecStore.from_url(
            root, storage_options=storage_options or {}, read_only=True
        )
    else:
        inner = LocalStore(root.removeprefix("file://"), read_only=True)
    return CountingStore(inner, stats)
