"""A store that answers as an object store would: every request waits ``latency_s`` first.

Used when the daemon runs with the hidden ``--inject-latency-s`` flag (tests and
benchmarks that need slow storage). The wait is per request and requests overlap, as on
S3: ten concurrent requests take one latency, not ten; a batch of ranged reads issued
together (``get_many``) is that many requests in flight at once, so it waits one latency
too. The wait counts toward ``--store-timeout-s``, since the counting store above times
the whole call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import WrapperStore

from episerve_server.storage.confined_root import ByteGet, ConfinedLocalStore


class LatencyStore(WrapperStore[Store]):
    """Delays every request to the wrapped store by ``latency_s`` seconds."""

    def __init__(self, store: Store, latency_s: float) -> None:
        if not latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s!r}")
        super().__init__(store)
        self.latency_s = latency_s
        self.requests = 0  # requests seen, each delayed once

    def _with_store(self, store: Store) -> LatencyStore:
        return type(self)(store, self.latency_s)

    async def _wait(self, n: int = 1) -> None:
        self.requests += n
        if self.latency_s:
            await asyncio.sleep(self.latency_s)

    @property
    def sized(self) -> bool:
        """Whether ``get`` takes ``max_bytes`` (a confined local store underneath)."""
        inner = self._store
        return isinstance(inner, ConfinedLocalStore) or (
            isinstance(inner, LatencyStore) and inner.sized)

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None, *,
                  max_bytes: int | None = None) -> Buffer | None:
        await self._wait()
        if self.sized:
            inner: ConfinedLocalStore | LatencyStore = self._store  # type: ignore[assignment]
            return await inner.get(key, prototype, byte_range, max_bytes=max_bytes)
        return await self._store.get(key, prototype, byte_range)

    async def get_many(self, requests: Sequence[ByteGet]) -> list[bytes | None]:
        """``len(requests)`` requests in flight together: one latency."""
        await self._wait(len(requests))
        inner = self._store
        if isinstance(inner, ConfinedLocalStore | LatencyStore):
            return await inner.get_many(requests)
        proto = default_buffer_prototype()
        bufs = await asyncio.gather(*(inner.get(key, proto, rng) for key, rng, _ in requests))
        return [None if b is None else b.to_bytes() for b in bufs]

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        await self._wait()
        return await self._store.exists(key)

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        await self._wait()
        async for entry in self._store.list_dir(prefix):
            yield entry

