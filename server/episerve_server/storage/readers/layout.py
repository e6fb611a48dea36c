"""Layout detection: the fastest correct reader for one array, after its metadata is checked
against sane maxima (:mod:`.bounds`), so no absurd shape or chunk size gets further."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from zarr import AsyncArray
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata

from episerve_server.storage.readers.base import ChunkReader
from episerve_server.storage.readers.bounds import (
    DEFAULT_MAX_ITEM_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS_PER_SHARD,
    MAX_FEATURE_ELEMENTS,
    MAX_NDIM,
    MAX_ROW_BYTES,
    MAX_ROWS,
    MAX_VLEN_CHUNK_ROWS,
)
from episerve_server.storage.readers.decode import ArrayInfo, plain_decoder, v3_decoder
from episerve_server.storage.readers.fallback import FallbackReader, bounded_array
from episerve_server.storage.readers.keyed import KeyedReader
from episerve_server.storage.readers.sharded import ShardedReader
from episerve_server.storage.store import CountingStore


def build_reader(episode: str, name: str, array: AsyncArray[Any], store: CountingStore,
                 prefix: str, on_fallback_read: Callable[[], None], *,
                 max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> ChunkReader:
    """Choose the fastest correct reader for ``array`` (stored under ``prefix``).

    ``ValueError`` says why the array cannot be served: metadata beyond the maxima, or
    codecs that cannot be decoded within a bound."""
    meta = array.metadata
    is_bytes = array.dtype == np.dtype(object)
    shape = tuple(int(n) for n in meta.shape)
    chunks = tuple(int(n) for n in array.chunks)  # the inner chunks, for sharded arrays
    _check(shape, chunks, array.dtype, is_bytes)
    info = ArrayInfo(episode, name, shape[0], chunks[0], shape[1:], is_bytes,
                     array.dtype.itemsize, max_item_bytes)
    if isinstance(meta, ArrayV3Metadata) and isinstance(meta.codecs[0], ShardingCodec) \
            and len(meta.codecs) == 1:
        return _sharded(info, array, meta, store, prefix, on_fallback_read)
    decoder = plain_decoder(info, meta, array)
    if decoder is None or chunks[1:] != shape[1:]:
        return _fallback(info, array, store, info.raw_bound, on_fallback_read)
    return KeyedReader(info, decoder, store, _key_fn(meta, prefix, len(shape)))


def _check(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype[Any],
           is_bytes: bool) -> None:
    def bad(what: str) -> ValueError:
        return ValueError(what)

    if not shape:
        raise bad("a 0-d array has no rows")
    if len(shape) > MAX_NDIM:
        raise bad(f"shape {shape!r} has {len(shape)} dimensions, more than {MAX_NDIM}")
    if not 0 <= shape[0] <= MAX_ROWS:
        raise bad(f"shape {shape!r} has {shape[0]!r} rows, expected at most {MAX_ROWS}")
    if len(chunks) != len(shape) or min(chunks) < 1:
        raise bad(f"chunk shape {chunks!r} does not fit shape {shape!r} (each >= 1)")
    if not is_bytes and dtype.kind not in "biuf":
        raise bad(f"dtype {str(dtype)!r} is not a number (bool, int, uint or float)")
    if is_bytes and len(shape) != 1:
        raise bad(f"a variable-length bytes array must be 1-d, got shape {shape!r}")
    elements = math.prod(shape[1:])
    if elements > MAX_FEATURE_ELEMENTS:
        raise bad(f"feature shape {shape[1:]!r} has {elements} values per row, more than "
                  f"{MAX_FEATURE_ELEMENTS}")
    if 4 * elements > MAX_ROW_BYTES:
        raise bad(f"feature shape {shape[1:]!r} is {4 * elements} float32 bytes per row, more "
                  f"than {MAX_ROW_BYTES}")
    if is_bytes and chunks[0] > MAX_VLEN_CHUNK_ROWS:  # a fill chunk is a list that long
        raise bad(f"chunk shape {chunks!r} has {chunks[0]} variable-length elements a chunk, "
                  f"more than {MAX_VLEN_CHUNK_ROWS}")
    if not is_bytes:
        chunk_bytes = chunks[0] * elements * max(4, dtype.itemsize)
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise bad(f"chunk shape {chunks!r} is {chunk_bytes} bytes decoded, more than "
                      f"{MAX_CHUNK_BYTES}")


def _key_fn(
    meta: ArrayV2Metadata | ArrayV3Metadata, prefix: str, ndim: int
) -> Callable[[int], str]:
    zeros = (0,) * (ndim - 1)
    return lambda c: f"{prefix}/{meta.encode_chunk_key((c, *zeros))}"


def _fallback(info: ArrayInfo, array: AsyncArray[Any], store: CountingStore,
              object_bytes: int, on_read: Callable[[], None]) -> ChunkReader:
    bounded = bounded_array(array, store, object_bytes, info.max_item_bytes)
    return FallbackReader(info, bounded, on_read)


def _sharded(info: ArrayInfo, array: AsyncArray[Any], meta: ArrayV3Metadata,
             store: CountingStore, prefix: str, on_fallback_read: Callable[[], None]
             ) -> ChunkReader:
    sharding = meta.codecs[0]
    assert isinstance(sharding, ShardingCodec)
    shape, shard_shape = tuple(meta.shape), tuple(meta.chunk_grid.chunk_shape)  # type: ignore[attr-defined]
    inner = tuple(sharding.chunk_shape)
    inner_chunks = math.prod(-(-s // c) for s, c in zip(shard_shape, inner))
    if inner_chunks > MAX_CHUNKS_PER_SHARD:
        raise ValueError(f"shard shape {shard_shape!r} holds "
                         f"{inner_chunks} inner chunks of {inner!r}, more than "
                         f"{MAX_CHUNKS_PER_SHARD}")
    shard_bytes = inner_chunks * (info.raw_bound + 16) + 4
    decoder = v3_decoder(info, sharding.codecs, array)
    index_codecs = sharding.index_codecs
    plain_index = (
        isinstance(index_codecs[0], BytesCodec)
        and all(isinstance(c, Crc32cCodec) for c in index_codecs[1:])
        and len(index_codecs) <= 2
    )
    if decoder is None or not plain_index or inner[1:] != shape[1:] \
            or shard_shape[1:] != shape[1:] or shard_shape[0] % inner[0]:
        return _fallback(info, array, store, shard_bytes, on_fallback_read)
    endian = getattr(getattr(index_codecs[0], "endian", None), "value", "little")
    return ShardedReader(
        info, decoder, store, _key_fn(meta, prefix, len(shape)),
        per_shard=shard_shape[0] // inner[0],
        at_end=sharding.index_location == ShardingCodecIndexLocation.end,
        index_dtype="<u8" if endian == "little" else ">u8",
        index_crc=len(index_codecs) == 2,
    )
