"""Opening a dataset root as a zarr store, wrapped so every request is counted and timed.

Local roots are a :class:`~episerve_server.storage.confined_root.ConfinedLocalStore`: only regular
files inside the root are ever read (see that module for the rule). Object-store roots
(``s3://``) are fsspec stores; a metadata document or an object over its cap is refused
there after it arrives, since the size is not known before.
"""

from __future__ import annotations

import asyncio
import hashlib
import posixpath
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore, WrapperStore

from episerve_proto.errors import Unavailable
from episerve_server.core.counters import Stats
from episerve_server.storage.confined_root import (
    DEFAULT_MAX_METADATA_BYTES,
    DEFAULT_MAX_OBJECT_BYTES,
    METADATA_NAMES,
    ByteGet,
    ConfinedLocalStore,
    NotARegularFile,
    ObjectTooLarge,
    OutsideRoot,
    Refused,
)
from episerve_server.storage.latency import LatencyStore
from episerve_server.storage.zipstore import ConfinedZipStore, is_zip_root

__all__ = [
    "METADATA_NAMES", "ByteGet", "ConfinedLocalStore", "CountingStore", "LatencyStore",
    "NotARegularFile",
    "ObjectTooLarge", "OutsideRoot", "Refused", "open_root", "split_key",
]

T = TypeVar("T")
# Matches ServerConfig.max_store_concurrency's default.
DEFAULT_MAX_CONNECTIONS = 64
# Matches ServerConfig.store_timeout_s's default.
DEFAULT_TIMEOUT_S = 30.0
#: Entries one episode's fingerprint looks at, at most (a local root).
MAX_FINGERPRINT_FILES = 65536


def transport_errors() -> tuple[type[BaseException], ...]:
    """The exceptions an object-store client raises when a connection fails (reset, refused,
    closed mid-answer): botocore's connection and HTTP-client errors and aiohttp's client
    errors. They are no ``OSError``, but mean the same as one: storage did not answer this
    time. Taken from the modules already imported (an object store imports them when it
    opens; nothing can raise them otherwise), never importing anything: this runs on the
    event loop, in an ``except`` clause, where importing botocore would stall it."""
    found: list[type[BaseException]] = []
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None:
        found += [boto.ConnectionError, boto.HTTPClientError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        found.append(aiohttp.ClientError)
    return tuple(found)


def split_key(store_key: str) -> tuple[str, str]:
    """``"ep.zarr/left.obs/c/0/0"`` -> ``("ep", "left.obs")``: the episode and the array."""
    parts = store_key.split("/")
    episode = parts[0].removesuffix(".zarr") if parts[0].endswith(".zarr") else ""
    array = parts[1] if len(parts) > 2 else ""
    return episode, array


class CountingStore(WrapperStore[Store]):
    """Counts metadata documents and data reads separately and bounds every call by
    ``timeout_s`` (``Unavailable`` on expiry).

    Slow storage for tests is a :class:`~episerve_server.storage.latency.LatencyStore`
    underneath (``open_root(latency_s=...)``); its wait counts toward the timeout, as slow
    storage would.
    """

    def __init__(self, store: Store, stats: Stats | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES) -> None:
        super().__init__(store)
        self.stats = stats if stats is not None else Stats()
        self.timeout_s = timeout_s
        self.max_metadata_bytes = max_metadata_bytes

    def _with_store(self, store: Store) -> CountingStore:
        return type(self)(store, self.stats, self.timeout_s, self.max_metadata_bytes)

    @property
    def sized(self) -> bool:
        """Whether the store underneath checks sizes before reading (a local root)."""
        inner = self._store
        return isinstance(inner, ConfinedLocalStore | ConfinedZipStore) or (
            isinstance(inner, LatencyStore) and inner.sized)

    def _count(self, key: str) -> None:
        if posixpath.basename(key) in METADATA_NAMES:
            self.stats.metadata_requests += 1
        else:
            self.stats.store_reads += 1

    async def _timed(self, call: str, key: str, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` bounded by ``timeout_s``; a timeout or a failed connection of an object
        store is ``Unavailable`` naming the key (an ``OSError`` names the key it failed on)."""
        try:
            if not self.timeout_s or self.timeout_s <= 0:
                return await work()
            return await asyncio.wait_for(work(), self.timeout_s)
        except TimeoutError as exc:
            episode, array = split_key(key)
            raise Unavailable(
                f"storage call {call}({key!r}) timed out after {self.timeout_s} s "
                "(slow or hung storage; retry later)", episode=episode, key=array,
            ) from exc
        except OSError as exc:
            if exc.filename is None:
                exc.filename = key
            raise
        except transport_errors() as exc:
            failed = getattr(exc, "episerve_key", key)
            episode, array = split_key(failed)
            raise Unavailable(
                f"storage call {call}({failed!r}) failed: the connection to storage broke "
                f"({type(exc).__name__}: {exc}); retry later", episode=episode, key=array,
            ) from exc

    async def _get(self, call: str, key: str, prototype: BufferPrototype,
                   byte_range: ByteRequest | None, max_bytes: int | None) -> Buffer | None:
        inner = self._store

        def work() -> Awaitable[Buffer | None]:
            if isinstance(inner, ConfinedLocalStore | LatencyStore | ConfinedZipStore):
                return inner.get(key, prototype, byte_range, max_bytes=max_bytes)
            return inner.get(key, prototype, byte_range)

        buf = await self._timed(call, key, work)
        if buf is not None:
            cap = max_bytes
            if cap is None and posixpath.basename(key) in METADATA_NAMES:
                cap = self.max_metadata_bytes
            if cap is not None and len(buf) > cap:
                raise ObjectTooLarge(key, f"returned {len(buf)} bytes, over the limit of {cap}")
        return buf

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None,
        *, max_bytes: int | None = None,
    ) -> Buffer | None:
        """``max_bytes`` caps the object (for local roots: its size on disk, before reading)."""
        self._count(key)
        return await self._get("get", key, prototype, byte_range, max_bytes)

    async def get_many(self, requests: Sequence[ByteGet]) -> list[bytes | None]:
        """Ranged data reads of one batch, issued together: each (key, range, cap) is one
        store read, counted and capped as ``get`` would; the whole call is bounded by
        ``timeout_s`` once. A local root reads them all in one worker thread, opening each
        file once; other stores issue them concurrently."""
        self.stats.store_reads += len(requests)
        if not requests:
            return []
        inner = self._store
        if isinstance(inner, ConfinedLocalStore | LatencyStore | ConfinedZipStore):
            out = await self._timed("get_many", requests[0][0],
                                    lambda: inner.get_many(requests))
        else:
            proto = default_buffer_prototype()
            bufs = await self._timed("get_many", requests[0][0], lambda: asyncio.gather(
                *(_keyed(key, inner.get(key, proto, rng)) for key, rng, _ in requests)))
            out = [None if b is None else b.to_bytes() for b in bufs]
        for (key, _, cap), data in zip(requests, out):
            if data is not None and len(data) > cap:
                raise ObjectTooLarge(key, f"returned {len(data)} bytes, over the limit of {cap}")
        return out

    async def get_index(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None,
        *, max_bytes: int | None = None,
    ) -> Buffer | None:
        """A shard-index read: a metadata hop, counted as one."""
        self.stats.metadata_requests += 1
        return await self._get("get_index", key, prototype, byte_range, max_bytes)

    async def exists(self, key: str) -> bool:
        self.stats.metadata_requests += 1
        return await self._timed("exists", key, lambda: self._store.exists(key))

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        async def collect() -> list[str]:
            return [entry async for entry in self._store.list_dir(prefix)]

        for entry in await self._timed("list_dir", prefix, collect):
            yield entry

    async def fingerprints(self, folders: Sequence[str]) -> list[tuple[str, str]]:
        """:meth:`fingerprint` of each folder; a local root walks them all in one worker
        thread (one thread competing with the event loop for the GIL, not one each)."""
        local = self._local()
        if local is None:
            return [await self.fingerprint(f) for f in folders]
        names = list(folders)
        return await self._timed("fingerprint", names[0] if names else "", lambda: (
            asyncio.to_thread(lambda: [local.fingerprint_sync(f, MAX_FINGERPRINT_FILES)
                                       for f in names])))

    def zip_root(self) -> ConfinedZipStore | None:
        """The zip file underneath, or None."""
        inner = self._unwrapped()
        return inner if isinstance(inner, ConfinedZipStore) else None

    def local_root(self) -> ConfinedLocalStore | None:
        """The confined local store underneath, or None for an object store."""
        return self._local()

    def _local(self) -> ConfinedLocalStore | None:
        inner = self._unwrapped()
        return inner if isinstance(inner, ConfinedLocalStore) else None

    def _unwrapped(self) -> Store:
        """The store under any added latency."""
        inner = self._store
        while isinstance(inner, LatencyStore):
            inner = inner._store
        return inner

    async def fingerprint(self, folder: str) -> tuple[str, str]:
        """Two digests of what ``folder`` serves: one that changes when anything in it is
        rewritten, and one of the stored objects' sizes for the content hash ("" when the
        store cannot tell). A local root: every file's size, mtime and inode, one walk in a
        worker thread. Another store: the bytes of the folder's own metadata documents
        (so there a rewrite is seen when the group's attributes, such as its length,
        change)."""
        local = self._local()
        if local is not None:
            return await self._timed("fingerprint", folder, lambda: asyncio.to_thread(
                local.fingerprint_sync, folder, MAX_FINGERPRINT_FILES))
        digest = hashlib.sha256()
        for doc in ("zarr.json", ".zattrs", ".zgroup"):
            key = f"{folder}/{doc}"
            self.stats.change_checks += 1  # (not a metadata request: nothing is opened)
            try:
                buf = await self._get("get", key, default_buffer_prototype(), None, None)
            except FileNotFoundError:
                buf = None
            digest.update(f"\0{doc}\0".encode())
            digest.update(b"-" if buf is None else buf.to_bytes())
        return digest.hexdigest()[:16], ""

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        return list(await asyncio.gather(
            *(self.get(key, prototype, byte_range) for key, byte_range in key_ranges)
        ))


def open_root(
    root: str,
    *,
    stats: Stats,
    storage_options: dict[str, Any] | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
    latency_s: float = 0.0,
) -> CountingStore:
    """A read-only store for a local folder, a local ``*.zip`` file or an fsspec URL such as ``s3://bucket/prefix``.

    A local folder is confined (:class:`ConfinedLocalStore`): metadata documents over
    ``max_metadata_bytes`` and other objects over ``max_object_bytes`` (unless a reader
    gives its own cap) are refused. S3 reads take the endpoint and credentials from the
    usual ``AWS_*`` variables unless ``storage_options`` say otherwise (see
    :func:`object_store_options`). ``latency_s`` puts a :class:`LatencyStore` underneath.
    """
    inner: Store
    if is_zip_root(root):  # a replay buffer saved as one zip file
        inner = ConfinedZipStore(root, max_metadata_bytes=max_metadata_bytes,
                                 max_object_bytes=max_object_bytes)
    elif "://" in root and not root.startswith("file://"):
        options = object_store_options(root, storage_options, max_connections)
        inner = FsspecStore.from_url(root, storage_options=options, read_only=True)
    else:
        inner = ConfinedLocalStore(root.removeprefix("file://"),
                                   max_metadata_bytes=max_metadata_bytes,
                                   max_object_bytes=max_object_bytes)
    if latency_s:  # slow storage for tests and benchmarks (the hidden --inject-latency-s)
        inner = LatencyStore(inner, latency_s)
    return CountingStore(inner, stats, timeout_s=timeout_s,
                         max_metadata_bytes=max_metadata_bytes)


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


async def _keyed(key: str, call: Awaitable[T]) -> T:
    """``await call``; what it raises says which key it was for (one call of a batch)."""
    try:
        return await call
    except OSError as exc:
        if exc.filename is None:
            exc.filename = key
        raise
    except Exception as exc:
        if not hasattr(exc, "episerve_key"):
            exc.episerve_key = key  # type: ignore[attr-defined]
        raise
