"""Raw chunk bytes to chunks with plain numcodecs: what each array's codecs allow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numcodecs
import numpy as np
from zarr import AsyncArray
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, VLenBytesCodec, ZstdCodec
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata

from episerve_proto.errors import DataLossError
from episerve_server.core.cache import Chunk

Raw: TypeAlias = bytes | None
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


def plain_decoder(info: ArrayInfo, meta: ArrayV2Metadata | ArrayV3Metadata,
                   array: AsyncArray[Any]) -> Decoder | None:
    if isinstance(meta, ArrayV3Metadata):
        return v3_decoder(info, meta.codecs, array)
    if meta.order != "C" and len(meta.shape) > 1:
        return None
    filters = tuple(meta.filters or ())
    if info.is_bytes != (len(filters) == 1 and isinstance(filters[0], numcodecs.VLenBytes)):
        return None
    if not info.is_bytes and filters:
        return None
    codecs = (meta.compressor,) if meta.compressor is not None else ()
    return Decoder(info, codecs, array.dtype, _fill(meta.fill_value, info))


def v3_decoder(info: ArrayInfo, codecs: Sequence[Any], array: AsyncArray[Any]) -> Decoder | None:
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
