"""Opening a dataset root as a zarr store, wrapped so every request is counted."""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Iterable
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from episerve_server.core.stats import Stats

# Matches ServerConfig.max_store_concurrency's default.
DEFAULT_MAX_CONNECTIONS = 64
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

    async def exists(self, key: str) -> bool:
        self.stats.metadata_requests += 1
        return await self._store.exists(key)

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
    root: str,
    *,
    stats: Stats,
    storage_options: dict[str, Any] | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> CountingStore:
    """A read-only store for a local folder or an fsspec URL such as ``s3://bucket/prefix``.

    S3 reads take the endpoint and credentials from the usual ``AWS_*`` variables unless
    ``storage_options`` say otherwise (see :func:`object_store_options`).
    """
    if "://" in root and not root.startswith("file://"):
        options = object_store_options(root, storage_options, max_connections)
        inner: Store = FsspecStore.from_url(root, storage_options=options, read_only=True)
    else:
        inner = LocalStore(root.removeprefix("file://"), read_only=True)
    return CountingStore(inner, stats)


def object_store_options(root: str, storage_options: dict[str, Any] | None,
                         max_connections: int = DEFAULT_MAX_CONNECTIONS) -> dict[str, Any]:
    """fsspec options for ``root``: the caller's, over the daemon's defaults.

    - No listings cache: fsspec keeps directory listings forever by default, so a rescan
      would never see an episode uploaded after the first listing.
    - No shared instance: fsspec hands out one cached filesystem per set of options, bound
      to the event loop that made it; a store opened on another loop must get its own.
    - S3: a connection pool as large as the daemon's store concurrency (botocore's default
      of 10 would queue the planner's concurrent chunk reads behind each other).
    """
    options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    if root.split("://", 1)[0] in {"s3", "s3a"}:
        options["config_kwargs"] = {"max_pool_connections": max_connections}
    for key, value in (storage_options or {}).items():
        if isinstance(value, dict) and isinstance(options.get(key), dict):
            options[key] = {**options[key], **value}
        else:
            options[key] = value
    return options
