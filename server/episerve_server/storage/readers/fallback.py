"""Layouts without a fast path, through ``AsyncArray.getitem``: slower, still correct, and
bounded like the fast path.

zarr decodes a zstd frame into a buffer of the size the frame declares, inflates gzip
without a limit and trusts a vlen-bytes item count. So a fallback array is read through a
copy of itself whose codec pipeline is rebuilt from bounded codecs (the same
:mod:`.bounds` steps as the fast path, each bounded by the chunk's own spec), over a store
wrapper that refuses any object larger than the array's bound by its size. An array with a
codec we cannot bound (anything but transpose, bytes, vlen-bytes, sharding with a plain
index, zstd, gzip, zlib, blosc and crc32c) is not read at all: :func:`bounded_array` says
why, and the catalog lists the array as a problem.
"""

from __future__ import annotations

import asyncio
import math
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np
from numcodecs.abc import Codec as Numcodec
from zarr import AsyncArray
from zarr.abc.codec import ArrayBytesCodec, BytesBytesCodec
from zarr.abc.store import ByteRequest, Store
from zarr.codecs import (
    BytesCodec,
    Crc32cCodec,
    ShardingCodec,
    TransposeCodec,
    VLenBytesCodec,
)
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import Buffer, BufferPrototype, NDBuffer
from zarr.core.codec_pipeline import BatchedCodecPipeline
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata
from zarr.storage import StorePath, WrapperStore

from episerve_proto.errors import DataLossError, EpiserveError
from episerve_server.core.cache import Chunk
from episerve_server.storage.readers.base import ChunkReader
from episerve_server.storage.readers.bounds import STEPS, parse_vlen, raw_bound, vlen_bound
from episerve_server.storage.readers.decode import V2_STEPS, V3_STEPS, ArrayInfo, Decoder, Raw
from episerve_server.storage.store import METADATA_NAMES, CountingStore


class FallbackReader(ChunkReader):
    """Any boundable layout zarr can read, through ``AsyncArray.getitem``, chunk-aligned."""

    def __init__(self, info: ArrayInfo, array: AsyncArray[Any],
                 on_read: Callable[[], None]) -> None:
        super().__init__(info, Decoder(info, (), np.dtype("float32"), 0))
        self.array, self.on_read = array, on_read

    async def _fetch(self, first: int, last: int) -> list[Raw | Chunk]:
        c = self.info.chunk_rows
        self.on_read()
        try:
            rows = await self.array.getitem(slice(first * c, (last + 1) * c))
        except (EpiserveError, OSError, TimeoutError):
            # A failed store read goes up as the fast paths let it, for the fetcher to
            # judge (an I/O error of the medium is data loss; anything else is transient).
            raise
        except Exception as exc:
            raise DataLossError(
                f"episode {self.info.episode!r} key {self.info.name!r}: read of chunks "
                f"{first}..{last} failed ({type(exc).__name__}: {exc})",
                episode=self.info.episode, key=self.info.name,
            ) from exc
        block: Any = rows
        return [_pad_rows(block[k * c : (k + 1) * c], c, self.info.is_bytes)
                for k in range(last - first + 1)]


def _pad_rows(rows: Any, c: int, is_bytes: bool) -> Chunk:
    if is_bytes:
        items = [bytes(b) for b in rows]
        return items + [b""] * (c - len(items))
    arr = np.asarray(rows, dtype=np.float32)
    if len(arr) < c:
        arr = np.concatenate([arr, np.zeros((c - len(arr), *arr.shape[1:]), np.float32)])
    return arr


# -- the bounded copy of an array ------------------------------------------------------------

def bounded_array(array: AsyncArray[Any], store: CountingStore, object_bytes: int,
                  max_item_bytes: int) -> AsyncArray[Any]:
    """``array`` over bounded codecs and a store capping each object at ``object_bytes``.
    ``ValueError`` names the codec when there is none we can bound."""
    meta = array.metadata
    if isinstance(meta, ArrayV3Metadata):
        codecs = _bounded_v3(meta.codecs, max_item_bytes)
    else:
        codecs = [_bounded_v2(meta, max_item_bytes)]
    capped = _CappedStore(store, object_bytes)
    copy: AsyncArray[Any] = AsyncArray(meta, StorePath(capped, array.store_path.path),
                                       array.config)
    object.__setattr__(copy, "codec_pipeline", BatchedCodecPipeline.from_codecs(codecs))
    return copy


def _unbounded(codec: object) -> ValueError:
    name = getattr(codec, "codec_id", None) or type(codec).__name__
    return ValueError(f"codec {name!r} cannot be decoded within a bound (supported: bytes, "
                      "vlen-bytes, transpose, sharding, zstd, gzip, zlib, blosc, crc32c)")


def _bounded_v3(codecs: Sequence[Any], max_item_bytes: int) -> list[Any]:
    out: list[Any] = []
    for codec in codecs:
        if isinstance(codec, TransposeCodec | BytesCodec):
            out.append(codec)
        elif isinstance(codec, VLenBytesCodec):
            out.append(_BoundedVLen(max_item_bytes))
        elif isinstance(codec, ShardingCodec):
            index = codec.index_codecs
            if not all(isinstance(c, BytesCodec | Crc32cCodec) for c in index):
                raise _unbounded(index[-1])
            out.append(ShardingCodec(chunk_shape=codec.chunk_shape,
                                     codecs=_bounded_v3(codec.codecs, max_item_bytes),
                                     index_codecs=index, index_location=codec.index_location))
        elif type(codec) in V3_STEPS:
            out.append(_BoundedStep(V3_STEPS[type(codec)], max_item_bytes))
        else:
            raise _unbounded(codec)
    return out


def _bounded_v2(meta: ArrayV2Metadata, max_item_bytes: int) -> Any:
    from zarr.codecs._v2 import V2Codec

    rows = math.prod(meta.chunks)
    is_bytes = meta.dtype.to_native_dtype() == np.dtype(object)
    decoded = vlen_bound(rows, max_item_bytes) if is_bytes else \
        rows * meta.dtype.to_native_dtype().itemsize
    filters: list[Numcodec] = []
    for f in meta.filters or ():
        if not (is_bytes and isinstance(f, numcodecs.VLenBytes)):
            raise _unbounded(f)
        filters.append(_BoundedVLenFilter(rows, max_item_bytes))
    compressor = None
    if meta.compressor is not None:
        step = V2_STEPS.get(type(meta.compressor))
        if step is None:
            raise _unbounded(meta.compressor)
        compressor = _BoundedNumcodec(step, raw_bound(decoded))
    return V2Codec(filters=tuple(filters) or None, compressor=compressor)


def _spec_bound(spec: ArraySpec, max_item_bytes: int) -> int:
    n, native = math.prod(spec.shape), spec.dtype.to_native_dtype()
    if native == np.dtype(object):
        return vlen_bound(n, max_item_bytes)
    return n * native.itemsize


@dataclass(frozen=True)
class _BoundedStep(BytesBytesCodec):
    """A bytes-to-bytes decode step, at most the chunk's bound plus slack."""

    step: str
    max_item_bytes: int
    is_fixed_size = False

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        limit = raw_bound(_spec_bound(chunk_spec, self.max_item_bytes))
        data = STEPS[self.step](chunk_bytes.to_bytes(), limit, False)
        return chunk_spec.prototype.buffer.from_bytes(data)

    def compute_encoded_size(self, _input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class _BoundedVLen(ArrayBytesCodec):
    """vlen-bytes with the item count and each item's length checked first."""

    max_item_bytes: int
    is_fixed_size = False

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        rows = math.prod(chunk_spec.shape)
        items = parse_vlen(chunk_bytes.to_bytes(), rows, self.max_item_bytes)
        arr = np.empty(rows, dtype=object)
        arr[:] = items
        return chunk_spec.prototype.nd_buffer.from_numpy_array(arr.reshape(chunk_spec.shape))

    def compute_encoded_size(self, _input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError


class _BoundedNumcodec(Numcodec):  # type: ignore[misc]
    """A v2 compressor decoded at most to ``limit`` bytes."""

    codec_id = "episerve.bounded"

    def __init__(self, step: str, limit: int) -> None:
        self.step, self.limit = step, limit

    def decode(self, buf: Any, out: Any = None) -> Any:
        return STEPS[self.step](bytes(memoryview(buf).cast("B")), self.limit, False)

    def encode(self, buf: Any) -> Any:
        raise NotImplementedError("read-only")


class _BoundedVLenFilter(Numcodec):  # type: ignore[misc]
    """The v2 vlen-bytes filter, with the item count and lengths checked first."""

    codec_id = "episerve.bounded_vlen"

    def __init__(self, rows: int, max_item_bytes: int) -> None:
        self.rows, self.max_item_bytes = rows, max_item_bytes

    def decode(self, buf: Any, out: Any = None) -> Any:
        items = parse_vlen(bytes(memoryview(buf).cast("B")), self.rows, self.max_item_bytes)
        arr = np.empty(self.rows, dtype=object)
        arr[:] = items
        return arr

    def encode(self, buf: Any) -> Any:
        raise NotImplementedError("read-only")


class _CappedStore(WrapperStore[CountingStore]):
    """Every data object through here is capped at ``cap`` bytes (by its size on disk)."""

    def __init__(self, store: CountingStore, cap: int) -> None:
        super().__init__(store)
        self.cap = cap

    def _with_store(self, store: Store) -> _CappedStore:
        assert isinstance(store, CountingStore)
        return type(self)(store, self.cap)

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        cap = None if posixpath.basename(key) in METADATA_NAMES else self.cap
        return await self._store.get(key, prototype, byte_range, max_bytes=cap)
