"""Inner chunks of v3 shards: each shard's index is read once and kept."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from episerve_server.core.cache import Chunk
from episerve_server.core.ledger import SHARD_INDEX_OVERHEAD
from episerve_server.storage.readers.base import (
    ChunkReader,
    RunPlan,
    ShardVanished,
    episode_exists,
)
from episerve_server.storage.readers.decode import ArrayInfo, Decoder, Raw
from episerve_server.storage.store import ByteGet, CountingStore

EMPTY = 2**64 - 1  # an index entry of a chunk that is not stored


@dataclass(frozen=True, slots=True)
class _ShardPart:
    """The chunks of one run that lie in one shard: their index entries (None: fill) and
    where their bytes are among the run's requests (``first`` < 0: the shard is all fill)."""

    key: str
    first: int
    merged: bool  # one ranged read for all of them
    entries: list[tuple[int, int] | None]


class ShardedReader(ChunkReader):
    """Inner chunks of v3 shards, located through each shard's index, read once and kept."""

    def __init__(self, info: ArrayInfo, decoder: Decoder, store: CountingStore,
                 key_of: Callable[[int], str], per_shard: int, at_end: bool,
                 index_dtype: str, index_crc: bool) -> None:
        super().__init__(info, decoder)
        self.store, self.key_of, self.per_shard = store, key_of, per_shard
        self.at_end, self.index_dtype, self.index_crc = at_end, index_dtype, index_crc
        self._index: dict[int, asyncio.Future[np.ndarray | None]] = {}

    @property
    def shard_bound(self) -> int:
        """The largest shard object accepted: every inner chunk at its bound, and the index."""
        return self.per_shard * self.info.raw_bound + 16 * self.per_shard + 4

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        out: list[Raw | Chunk] = []
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
        key = self.key_of(shard)
        entries = self._entries(key, lo, index[lo - base : hi - base + 1].tolist())
        present = [e is not None for e in entries]
        spans = [e for e in entries if e is not None]
        if not spans:
            return [None] * (hi - lo + 1)
        contiguous = all(b[0] == a[0] + a[1] for a, b in itertools.pairwise(spans))
        proto, cap = default_buffer_prototype(), self.shard_bound
        if contiguous:
            start, stop = spans[0][0], spans[-1][0] + spans[-1][1]
            buf = await self.store.get(key, proto, RangeByteRequest(start, stop), max_bytes=cap)
            blob = self._require(buf, key, stop - start)
            parts = [blob[o - start : o + n - start] for o, n in spans]
        else:
            bufs = await asyncio.gather(
                *(self.store.get(key, proto, RangeByteRequest(o, o + n), max_bytes=cap)
                  for o, n in spans)
            )
            parts = [self._require(b, key, n) for b, (_, n) in zip(bufs, spans)]
        it = iter(parts)
        return [next(it) if p else None for p in present]

    batched = True

    async def plan(self, first: int, last: int) -> RunPlan:
        """One ranged read per run of chunks contiguous in their shard, else one per chunk;
        the sizes are known from the shard index before anything is read."""
        shards = range(first // self.per_shard, last // self.per_shard + 1)
        indexes = await asyncio.gather(*(self._shard_index(s) for s in shards))
        return self._plan(first, last, dict(zip(shards, indexes)))

    def plan_now(self, first: int, last: int) -> RunPlan | None:
        indexes: dict[int, np.ndarray | None] = {}
        for shard in range(first // self.per_shard, last // self.per_shard + 1):
            fut = self._index.get(shard)
            if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
                return None
            indexes[shard] = fut.result()
        return self._plan(first, last, indexes)

    def _plan(self, first: int, last: int, indexes: dict[int, np.ndarray | None]) -> RunPlan:
        requests: list[ByteGet] = []
        layout: list[_ShardPart] = []
        known = 0
        for shard in range(first // self.per_shard, last // self.per_shard + 1):
            lo = max(first, shard * self.per_shard)
            hi = min(last, (shard + 1) * self.per_shard - 1)
            index = indexes[shard]
            if index is None:  # the whole shard is fill
                layout.append(_ShardPart("", -1, False, [None] * (hi - lo + 1)))
                continue
            base, key = shard * self.per_shard, self.key_of(shard)
            entries = self._entries(key, lo, index[lo - base : hi - base + 1].tolist())
            spans = [e for e in entries if e is not None]
            known += sum(n for _, n in spans)
            cap = self.shard_bound
            merged = bool(spans) and all(
                b[0] == a[0] + a[1] for a, b in itertools.pairwise(spans))
            layout.append(_ShardPart(key, len(requests), merged, entries))
            if merged:
                stop = spans[-1][0] + spans[-1][1]
                requests.append((key, RangeByteRequest(spans[0][0], stop), cap))
            else:
                requests.extend((key, RangeByteRequest(o, o + n), cap) for o, n in spans)
        return RunPlan(requests, lambda bufs: self._split(layout, bufs), known)

    def _split(self, layout: list[_ShardPart], bufs: list[bytes | None]) -> list[Raw]:
        out: list[Raw] = []
        for part in layout:
            spans = [e for e in part.entries if e is not None]
            if part.first < 0 or not spans:
                out.extend([None] * len(part.entries))
                continue
            if part.merged:
                start = spans[0][0]
                blob = self._require(bufs[part.first], part.key,
                                     spans[-1][0] + spans[-1][1] - start)
                pieces = [blob[o - start : o + n - start] for o, n in spans]
            else:
                pieces = [self._require(bufs[part.first + k], part.key, n)
                          for k, (_, n) in enumerate(spans)]
            it = iter(pieces)
            out.extend(next(it) if e is not None else None for e in part.entries)
        return out

    def _entries(self, key: str, lo: int, rows: list[list[int]]) -> list[tuple[int, int] | None]:
        """Index entries (offset, length) of chunks lo.., checked before anything is fetched:
        EMPTY is fill; a length over the raw-chunk bound or an end past 2**63 is refused."""
        out: list[tuple[int, int] | None] = []
        bound = self.info.raw_bound
        for k, (offset, length) in enumerate(rows):
            if offset == EMPTY and length == EMPTY:
                out.append(None)
                continue
            where = f"shard {key!r} index entry of chunk {lo + k}"
            if length > bound:
                raise self.loss(f"{where} declares {length} bytes, over the bound of {bound} "
                                "(chunk rows x feature x item size, plus compression slack)")
            if offset + length >= 2**63:
                raise self.loss(f"{where} points past the end of any file "
                                f"(offset {offset!r}, length {length!r})")
            out.append((offset, length))
        return out

    def _require(self, buf: Any, key: str, nbytes: int) -> bytes:
        if buf is None:
            raise ShardVanished(f"shard {key!r} of episode {self.info.episode!r} is gone")
        data = buf if isinstance(buf, bytes) else buf.to_bytes()
        if len(data) != nbytes:
            raise self.loss(f"shard {key!r} returned {len(data)} bytes, expected {nbytes}")
        return bytes(data)

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
        buf = await self.store.get_index(self.key_of(shard), default_buffer_prototype(), rng,
                                         max_bytes=self.shard_bound)
        if buf is None:  # all fill, or the episode is gone: asked once per shard
            if not await episode_exists(self.store, self.info.episode):
                raise ShardVanished(f"episode {self.info.episode!r} is gone")
            self.keep(SHARD_INDEX_OVERHEAD, f"the note that shard {self.key_of(shard)!r} "
                      "is all fill")
            return None
        data = buf.to_bytes()
        if len(data) != nbytes:
            raise self.loss(f"shard index of {self.key_of(shard)!r} is truncated")
        if self.index_crc:
            try:
                data = bytes(numcodecs.CRC32C().decode(data))
            except Exception as exc:
                raise self.loss(f"the index of shard {self.key_of(shard)!r} fails its "
                                f"checksum ({exc})") from exc
        # kept while the episode is served: charged to the episode state first
        self.keep(SHARD_INDEX_OVERHEAD + len(data), f"the chunk index of shard "
                  f"{self.key_of(shard)!r} ({self.per_shard} chunks)")
        return np.frombuffer(data, dtype=self.index_dtype).reshape(self.per_shard, 2)
