"""Chunk-level access to one array of an episode, with no metadata request after warm-up.

zarr's own ``getitem`` re-reads a shard's index on every call and pays a thread hop per
chunk to decode. Here the index of a shard is read once (counted as a metadata hop) and
kept; a run of adjacent inner chunks is one ranged read; decoding is plain numcodecs, done
by the planner for a whole batch in one worker thread.

Layouts with a fast path: v3 sharded (index of bytes+crc32c), v3 unsharded, and v2, with
bytes/vlen-bytes and zstd/gzip/blosc/crc32c codecs. Anything else reads through zarr's
``AsyncArray.getitem``: slower but correct.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numcodecs
import numpy as np
from zarr import AsyncArray
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    ShardingCodec,
    VLenBytesCodec,
    ZstdCodec,
)
from zarr.codecs.sharding import ShardingCodecIndexLocation
from zarr.core.buffer import default_buffer_prototype
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata

from episerve_server.core.cache import Chunk
from episerve_server.errors import DataLossError
from episerve_server.storage.store import CountingStore

Raw: TypeAlias = bytes | None
EMPTY = 2**64 - 1
_BYTES_CODECS: dict[type, Callable[[], Any]] = {
    ZstdCodec: numcodecs.Zstd,
    GzipCodec: numcodecs.GZip,
    BloscCodec: numcodecs.Blosc,
    Crc32cCodec: numcodecs.CRC32C,
}


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    episode: str
    name: str
    rows: int
    chunk_rows: int
    feature: tuple[int, ...]
    is_bytes: bool


@dataclass(frozen=True, slots=True)
class Decoder:
    """Raw chunk bytes -> a chunk: float32 (chunk_rows, *feature), or a list of bytes."""

    info: ArrayInfo
    codecs: tuple[Any, ...]  # numcodecs objects, in decode order
    dtype: np.dtype[Any]
    fill: Any

    def __call__(self, raw: Raw, index: int) -> Chunk:
        shape = (self.info.chunk_rows, *self.info.feature)
        if raw is None:
            if self.info.is_bytes:
                return [bytes(self.fill or b"")] * self.info.chunk_rows
            return np.full(shape, self.fill, dtype=np.float32)
        try:
            data: Any = raw
            for codec in self.codecs:
                data = codec.decode(data)
            if self.info.is_bytes:
                items = numcodecs.VLenBytes().decode(data)
                if len(items) != self.info.chunk_rows:
                    raise ValueError(f"{len(items)} items, expected {self.info.chunk_rows}")
                return [bytes(b) for b in items]
            flat = np.frombuffer(data, dtype=self.dtype)
            if flat.size != int(np.prod(shape)):
                raise ValueError(f"{flat.size} values, expected {int(np.prod(shape))}")
            return flat.reshape(shape).astype(np.float32)
        except Exception as exc:
            raise DataLossError(
                f"episode {self.info.episode!r} key {self.info.name!r}: chunk {index} "
                f"is corrupt or undecodable ({type(exc).__name__}: {exc})",
                episode=self.info.episode,
                key=self.info.name,
            ) from exc


class ShardVanished(FileNotFoundError):
    """A shard whose index was read is gone: the episode may have been deleted."""


class ChunkReader:
    """Fetches raw chunks [first, last] of one array; ``decode`` turns them into chunks.

    A missing chunk is the fill value (zarr skips chunks equal to it), returned as None.
    """

    def __init__(self, info: ArrayInfo, decoder: Decoder) -> None:
        self.info = info
        self.decode = decoder
        #: chunks found missing and confirmed to be fill (the episode still exists)
        self.absent: set[int] = set()

    async def fetch(self, first: int, last: int) -> list[Raw]:
        raise NotImplementedError


class KeyedReader(ChunkReader):
    """One store object per chunk: v3 unsharded and v2."""

    def __init__(self, info: ArrayInfo, decoder: Decoder, store: CountingStore,
                 key_of: Callable[[int], str]) -> None:
        super().__init__(info, decoder)
        self.store = store
        self.key_of = key_of

    async def fetch(self, first: int, last: int) -> list[Raw]:
        proto = default_buffer_prototype()
        bufs = await asyncio.gather(
            *(self.store.get(self.key_of(c), proto) for c in range(first, last + 1))
        )
        return [None if b is None else b.to_bytes() for b in bufs]


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


class FallbackReader(ChunkReader):
    """Any layout zarr can read, through ``AsyncArray.getitem``, chunk-aligned."""

    def __init__(self, info: ArrayInfo, array: AsyncArray[Any],
                 on_read: Callable[[], None]) -> None:
        super().__init__(info, Decoder(info, (), np.dtype("float32"), 0))
        self.array, self.on_read = array, on_read

    async def fetch(self, first: int, last: int) -> list[Raw | Chunk]:  # type: ignore[override]
        c = self.info.chunk_rows
        self.on_read()
        try:
            rows = await self.array.getitem(slice(first * c, (last + 1) * c))
        except Exception as exc:
            raise DataLossError(
                f"episode {self.info.episode!r} key {self.info.name!r}: read of chunks "
                f"{first}..{last} failed ({type(exc).__name__}: {exc})",
                episode=self.info.episode, key=self.info.name,
            ) from exc
        block: Any = rows
        return [_pad_rows(block[k * c : (k + 1) * c], c, self.info.is_bytes)
                for k in range(last - first + 1)]


async def episode_exists(store: CountingStore, episode: str) -> bool:
    base = f"{episode}.zarr"
    return await store.exists(f"{base}/zarr.json") or await store.exists(f"{base}/.zgroup")


def _pad_rows(rows: Any, c: int, is_bytes: bool) -> Chunk:
    if is_bytes:
        items = [bytes(b) for b in rows]
        return items + [b""] * (c - len(items))
    arr = np.asarray(rows, dtype=np.float32)
    if len(arr) < c:
        arr = np.concatenate([arr, np.zeros((c - len(arr), *arr.shape[1:]), np.float32)])
    return arr


def decode_chunk(reader: ChunkReader, raw: Raw | Chunk, index: int) -> Chunk:
    """Decode a fetched chunk; a ``FallbackReader`` hands back chunks already decoded."""
    if raw is None or isinstance(raw, bytes):
        return reader.decode(raw, index)
    return raw


def build_reader(episode: str, name: str, array: AsyncArray[Any], store: CountingStore,
                 prefix: str, on_fallback_read: Callable[[], None]) -> ChunkReader:
    """Choose the fastest correct reader for ``array`` (stored under ``prefix``)."""
    meta = array.metadata
    is_bytes = array.dtype == np.dtype(object)
    shape = tuple(meta.shape)
    if not shape:
        raise ValueError("a 0-d array has no rows")
    if isinstance(meta, ArrayV3Metadata) and isinstance(meta.codecs[0], ShardingCodec) \
            and len(meta.codecs) == 1:
        return _sharded(episode, name, array, meta, store, prefix, is_bytes, on_fallback_read)
    chunks = tuple(array.chunks)
    info = ArrayInfo(episode, name, shape[0], chunks[0], shape[1:], is_bytes)
    decoder = _plain_decoder(info, meta, array)
    if decoder is None or chunks[1:] != shape[1:]:
        return FallbackReader(info, array, on_fallback_read)
    return KeyedReader(info, decoder, store, _key_fn(meta, prefix, len(shape)))


def _key_fn(
    meta: ArrayV2Metadata | ArrayV3Metadata, prefix: str, ndim: int
) -> Callable[[int], str]:
    zeros = (0,) * (ndim - 1)
    return lambda c: f"{prefix}/{meta.encode_chunk_key((c, *zeros))}"


def _sharded(episode: str, name: str, array: AsyncArray[Any], meta: ArrayV3Metadata,
             store: CountingStore, prefix: str, is_bytes: bool,
             on_fallback_read: Callable[[], None]) -> ChunkReader:
    sharding = meta.codecs[0]
    assert isinstance(sharding, ShardingCodec)
    shape, shard_shape = tuple(meta.shape), tuple(meta.chunk_grid.chunk_shape)  # type: ignore[attr-defined]
    inner = tuple(sharding.chunk_shape)
    info = ArrayInfo(episode, name, shape[0], inner[0], shape[1:], is_bytes)
    decoder = _v3_decoder(info, sharding.codecs, array)
    index_codecs = sharding.index_codecs
    plain_index = (
        isinstance(index_codecs[0], BytesCodec)
        and all(isinstance(c, Crc32cCodec) for c in index_codecs[1:])
        and len(index_codecs) <= 2
    )
    if decoder is None or not plain_index or inner[1:] != shape[1:] \
            or shard_shape[1:] != shape[1:] or shard_shape[0] % inner[0]:
        return FallbackReader(info, array, on_fallback_read)
    endian = getattr(getattr(index_codecs[0], "endian", None), "value", "little")
    return ShardedReader(
        info, decoder, store, _key_fn(meta, prefix, len(shape)),
        per_shard=shard_shape[0] // inner[0],
        at_end=sharding.index_location == ShardingCodecIndexLocation.end,
        index_dtype="<u8" if endian == "little" else ">u8",
        index_crc=len(index_codecs) == 2,
    )


def _plain_decoder(info: ArrayInfo, meta: ArrayV2Metadata | ArrayV3Metadata,
                   array: AsyncArray[Any]) -> Decoder | None:
    if isinstance(meta, ArrayV3Metadata):
        return _v3_decoder(info, meta.codecs, array)
    if meta.order != "C" and len(meta.shape) > 1:
        return None
    filters = tuple(meta.filters or ())
    if info.is_bytes != (len(filters) == 1 and isinstance(filters[0], numcodecs.VLenBytes)):
        return None
    if not info.is_bytes and filters:
        return None
    codecs = (meta.compressor,) if meta.compressor is not None else ()
    return Decoder(info, codecs, array.dtype, _fill(meta.fill_value, info))


def _v3_decoder(info: ArrayInfo, codecs: Sequence[Any], array: AsyncArray[Any]) -> Decoder | None:
    if not codecs:
        return None
    head, rest = codecs[0], codecs[1:]
    if info.is_bytes and not isinstance(head, VLenBytesCodec):
        return None
    if not info.is_bytes and not isinstance(head, BytesCodec):
        return None
    makers = [_BYTES_CODECS.get(type(c)) for c in rest]
    if any(m is None for m in makers):
        return None
    dtype = array.dtype
    if not info.is_bytes and head.endian is not None:
        dtype = dtype.newbyteorder("<" if head.endian.value == "little" else ">")
    ordered = tuple(m() for m in reversed(makers) if m is not None)
    return Decoder(info, ordered, dtype, _fill(array.metadata.fill_value, info))


def _fill(value: Any, info: ArrayInfo) -> Any:
    if info.is_bytes:
        return bytes(value) if isinstance(value, bytes | bytearray) else b""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
