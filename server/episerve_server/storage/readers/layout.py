"""Layout detection: the fastest correct reader for one array."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from zarr import AsyncArray
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata

from episerve_server.storage.readers.base import ChunkReader
from episerve_server.storage.readers.decode import ArrayInfo, plain_decoder, v3_decoder
from episerve_server.storage.readers.fallback import FallbackReader
from episerve_server.storage.readers.keyed import KeyedReader
from episerve_server.storage.readers.sharded import ShardedReader
from episerve_server.storage.store import CountingStore


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
    decoder = plain_decoder(info, meta, array)
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
    decoder = v3_decoder(info, sharding.codecs, array)
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
