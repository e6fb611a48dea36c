"""Inner chunks of v3 shards: each shard's index is read once and kept."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numcodecs
import numpy as np
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from episerve_proto.errors import DataLossError
from episerve_server.storage.readers.base import ChunkReader, ShardVanished, episode_exists
from episerve_server.storage.readers.decode import ArrayInfo, Decoder, Raw
from episerve_server.storage.store import CountingStore

EMPTY = 2**64 - 1  # an index entry of a chunk that is not stored


class ShardedReader(ChunkReader):
    """Inner chunks of v3 shards, located through each shard's index, read once and kept."""

    def __init__(self, info: ArrayInfo, decoder: Decoder, store: CountingStore,
                 key_of: Callable[[int], str], per_shard: int, at_end: bool,
                 index_dtype: str, index_crc: bool) -> None:
        super().__init__(info, decoder)
        self.store, self.key_of, self.per_shard = store, key_of, per_shard
        self.at_end, self.index_dtype, self.index_crc = at_end, index_dtype, index_crc
        self._index: dict[int, asyncio.Future[np.ndarray | None]] = {}

    async def fetch(self, first: int, last: int) -> list[Raw]:
        out: list[Raw] = []
        for shard in range(first // self.per_shard, last // self.per_shard + 1):
            lo = max(first, shard * self.per_shard)
            hi = min(last, (shard + 1) * self.per_shard - 1)
            out.extend(await self._fetch_in_shard(shard, lo, hi))
        return out

    async def _fetch_in_shard(self, shard: int, lo: int, hi: int) -> list[Raw]:
        index = await self._shard_index(shard)
        if index is None:
            return [None] * (hi - lo + 1)
        base = shard * self.per_shard
        spans = index[lo - base : hi - base + 1]
        present = spans[:, 0] != EMPTY
        if not present.any():
            return [None] * (hi - lo + 1)
        offsets, lengths = spans[present, 0], spans[present, 1]
        contiguous = bool(np.all(offsets[1:] == offsets[:-1] + lengths[:-1]))
        key = self.key_of(shard)
        proto = default_buffer_prototype()
        if contiguous:
            start, stop = int(offsets[0]), int(offsets[-1] + lengths[-1])
            buf = await self.store.get(key, proto, RangeByteRequest(start, stop))
            blob = self._require(buf, key, stop - start)
            parts = [blob[int(o) - start : int(o + n) - start] for o, n in zip(offsets, lengths)]
        else:
            bufs = await asyncio.gather(
                *(self.store.get(key, proto, RangeByteRequest(int(o), int(o + n)))
                  for o, n in zip(offsets, lengths))
            )
            parts = [self._require(b, key, int(n)) for b, n in zip(bufs, lengths)]
        it = iter(parts)
        return [next(it) if p else None for p in present]

    def _require(self, buf: Any, key: str, nbytes: int) -> bytes:
        if buf is None:
            raise ShardVanished(f"shard {key!r} of episode {self.info.episode!r} is gone")
        data = buf.to_bytes()
        if len(data) != nbytes:
            raise self._loss(f"shard {key!r} returned {len(data)} bytes, expected {nbytes}")
        return bytes(data)

    def _loss(self, what: str) -> DataLossError:
        info = self.info
        return DataLossError(f"episode {info.episode!r} key {info.name!r}: {what}",
                             episode=info.episode, key=info.name)

    async def _shard_index(self, shard: int) -> np.ndarray | None:
        fut = self._index.get(shard)
        if fut is None:
            fut = asyncio.ensure_future(self._load_index(shard))
            self._index[shard] = fut
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if fut.done():
                self._index.pop(shard, None)
            raise

    async def _load_index(self, shard: int) -> np.ndarray | None:
        nbytes = 16 * self.per_shard + (4 if self.index_crc else 0)
        rng = SuffixByteRequest(nbytes) if self.at_end else RangeByteRequest(0, nbytes)
        buf = await self.store.get_index(self.key_of(shard), default_buffer_prototype(), rng)
        if buf is None:  # all fill, or the episode is gone: asked once per shard
            if not await episode_exists(self.store, self.info.episode):
                raise ShardVanished(f"episode {self.info.episode!r} is gone")
            return None
        data = buf.to_bytes()
        if len(data) != nbytes:
            raise self._loss(f"shard index of {self.key_of(shard)!r} is truncated")
        if self.index_crc:
            try:
                data = bytes(numcodecs.CRC32C().decode(data))
            except Exception as exc:
                raise self._loss(f"shard index checksum failed ({exc})") from exc
        return np.frombuffer(data, dtype=self.index_dtype).reshape(self.per_shard, 2)
