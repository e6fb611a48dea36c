"""Raw chunk bytes to chunks, bounded by the array's metadata: what each array's codecs allow."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numcodecs
import numpy as np
from zarr import AsyncArray
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, VLenBytesCodec, ZstdCodec
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata

from episerve_proto.errors import DataLossError
from episerve_server.core.cache import Chunk
from episerve_server.storage.readers.bounds import (
    DEFAULT_MAX_ITEM_BYTES,
    BoundError,
    parse_vlen,
    raw_bound,
    run_chain,
    vlen_bound,
)

Raw: TypeAlias = bytes | None
# zarr v3 bytes-to-bytes codecs and numcodecs compressors (v2) we can decode with a bound.
V3_STEPS: dict[type, str] = {ZstdCodec: "zstd", GzipCodec: "gzip", BloscCodec: "blosc",
                             Crc32cCodec: "crc32c"}
V2_STEPS: dict[type, str] = {numcodecs.Zstd: "zstd", numcodecs.GZip: "gzip",
                             numcodecs.Zlib: "zlib", numcodecs.Blosc: "blosc",
                             numcodecs.CRC32C: "crc32c"}


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    episode: str
    name: str
    rows: int
    chunk_rows: int
    feature: tuple[int, ...]
    is_bytes: bool
    itemsize: int = 4  # bytes per stored value (numeric arrays)
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES  # one vlen element, decoded

    @property
    def decoded_bound(self) -> int:
        """Bytes of one decoded chunk: exact for numbers, at most this for vlen-bytes."""
        if self.is_bytes:
            return vlen_bound(self.chunk_rows, self.max_item_bytes)
        return self.chunk_rows * math.prod(self.feature) * self.itemsize

    @property
    def raw_bound(self) -> int:
        """The largest stored chunk accepted (the decoded bound plus compression slack)."""
        return raw_bound(self.decoded_bound)


@dataclass(frozen=True, slots=True)
class Decoder:
    """Raw chunk bytes -> a chunk: float32 (chunk_rows, *feature), or a list of bytes.

    Every step is bounded by the array's metadata (:mod:`.bounds`): a chunk that would
    decode to anything but its expected size is refused before it allocates.
    """

    info: ArrayInfo
    steps: tuple[str, ...]  # bytes-to-bytes codecs, in decode order (names in bounds.STEPS)
    dtype: np.dtype[Any]
    fill: Any

    def __call__(self, raw: Raw, index: int) -> Chunk:
        info = self.info
        shape = (info.chunk_rows, *info.feature)
        if raw is None:
            if info.is_bytes:
                return [bytes(self.fill or b"")] * info.chunk_rows
            return np.full(shape, self.fill, dtype=np.float32)
        try:
            if len(raw) > info.raw_bound:
                raise BoundError(f"stored chunk of {len(raw)} bytes is over the bound of "
                                 f"{info.raw_bound}")
            data = run_chain(self.steps, raw, info.decoded_bound, not info.is_bytes)
            if info.is_bytes:
                return parse_vlen(data, info.chunk_rows, info.max_item_bytes)
            if len(data) != info.decoded_bound:
                raise BoundError(f"{len(data)} bytes, expected {info.decoded_bound}")
            return np.frombuffer(data, dtype=self.dtype).reshape(shape).astype(np.float32)
        except BoundError as exc:
            raise self._loss(index, f"refused before decoding: {exc}") from exc
        except Exception as exc:
            raise self._loss(index, f"is corrupt or undecodable ({type(exc).__name__}: {exc})"
                             ) from exc

    def _loss(self, index: int, what: str) -> DataLossError:
        info = self.info
        return DataLossError(f"episode {info.episode!r} key {info.name!r}: chunk {index} {what}",
                             episode=info.episode, key=info.name)


def plain_decoder(info: ArrayInfo, meta: ArrayV2Metadata | ArrayV3Metadata,
                  array: AsyncArray[Any]) -> Decoder | None:
    """A fast-path decoder for ``meta``'s codecs, or None if it has none."""
    if isinstance(meta, ArrayV3Metadata):
        return v3_decoder(info, meta.codecs, array)
    if meta.order != "C" and len(meta.shape) > 1:
        return None
    filters = tuple(meta.filters or ())
    if info.is_bytes != (len(filters) == 1 and isinstance(filters[0], numcodecs.VLenBytes)):
        return None
    if not info.is_bytes and filters:
        return None
    steps: tuple[str, ...] = ()
    if meta.compressor is not None:
        step = V2_STEPS.get(type(meta.compressor))
        if step is None:
            return None
        steps = (step,)
    return Decoder(info, steps, array.dtype, _fill(meta.fill_value, info))


def v3_decoder(info: ArrayInfo, codecs: Sequence[Any], array: AsyncArray[Any]) -> Decoder | None:
    if not codecs:
        return None
    head, rest = codecs[0], codecs[1:]
    if info.is_bytes and not isinstance(head, VLenBytesCodec):
        return None
    if not info.is_bytes and not isinstance(head, BytesCodec):
        return None
    steps = [V3_STEPS.get(type(c)) for c in rest]
    if any(s is None for s in steps):
        return None
    dtype = array.dtype
    if not info.is_bytes and head.endian is not None:
        dtype = dtype.newbyteorder("<" if head.endian.value == "little" else ">")
    ordered = tuple(s for s in reversed(steps) if s is not None)
    return Decoder(info, ordered, dtype, _fill(array.metadata.fill_value, info))


def _fill(value: Any, info: ArrayInfo) -> Any:
    if info.is_bytes:
        return bytes(value) if isinstance(value, bytes | bytearray) else b""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
