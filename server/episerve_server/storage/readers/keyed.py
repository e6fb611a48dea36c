"""One store object per chunk: v3 unsharded and v2."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from zarr.core.buffer import default_buffer_prototype

from episerve_server.core.cache import Chunk
from episerve_server.storage.readers.base import ChunkReader, RunPlan
from episerve_server.storage.readers.decode import ArrayInfo, Decoder, Raw
from episerve_server.storage.store import CountingStore


class KeyedReader(ChunkReader):
    """One store object per chunk: v3 unsharded and v2. An object larger than the array's
    raw-chunk bound is refused by its size, before it is read."""

    def __init__(self, info: ArrayInfo, decoder: Decoder, store: CountingStore,
                 key_of: Callable[[int], str]) -> None:
        super().__init__(info, decoder)
        self.store = store
        self.key_of = key_of

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        proto, cap = default_buffer_prototype(), self.info.raw_bound
        bufs = await asyncio.gather(
            *(self.store.get(self.key_of(c), proto, max_bytes=cap)
              for c in range(first, last + 1))
        )
        return [None if b is None else b.to_bytes() for b in bufs]

    batched = True

    async def plan(self, first: int, last: int) -> RunPlan:
        return self.plan_now(first, last)

    def plan_now(self, first: int, last: int) -> RunPlan:
        cap = self.info.raw_bound
        return RunPlan([(self.key_of(c), None, cap) for c in range(first, last + 1)], _same)


def _same(raws: list[bytes | None]) -> list[bytes | None]:
    return raws
