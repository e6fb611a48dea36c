"""A replay buffer's arrays: zarr format 2 metadata parsed and bounded here, and their
chunks decoded by codec id.

Only what the daemon can decode within a bound is accepted: chunked along time only (each
chunk holds every value of its rows), C order, no filters, and a compressor it knows by id
(``COMPRESSORS``: blosc, zstd, gzip, zlib, none; the image codecs of :mod:`.images` for
frames). Anything else is a problem naming the array and what it found, never a guess.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_server.storage.readers.bounds import (
    MAX_CHUNK_BYTES,
    MAX_FEATURE_ELEMENTS,
    MAX_NDIM,
    BoundError,
    raw_bound,
    run_chain,
)
from episerve_server.storage.replay import images

#: numcodecs compressor ids decoded through the bounded steps (None: stored raw).
COMPRESSORS = {"blosc": "blosc", "zstd": "zstd", "gzip": "gzip", "zlib": "zlib"}
#: Rows of the whole buffer (every episode's, concatenated).
MAX_BUFFER_ROWS = 1 << 40
#: dtype kinds served: bool, signed and unsigned ints, floats (as float32 on the wire).
_KINDS = "biuf"


class ArrayProblem(ValueError):
    """An array whose metadata the daemon will not read (the message says why)."""


@dataclass(frozen=True, slots=True)
class ArrayMeta:
    """One ``data/<key>`` (or ``meta/episode_ends``) array, as its ``.zarray`` declares."""

    path: str  # the array's folder in the root, e.g. "data/action"
    rows: int
    chunk_rows: int
    feature: tuple[int, ...]
    dtype: np.dtype[Any]
    codec: str  # "" (raw), a COMPRESSORS value, or an image codec id
    fill: float
    separator: str

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one decoded chunk in the stored dtype."""
        return self.chunk_rows * math.prod(self.feature) * self.dtype.itemsize

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk_rows)

    @property
    def is_image(self) -> bool:
        """Frames: uint8 rows of H x W x 3 (what cameras store)."""
        return self.dtype == np.uint8 and len(self.feature) == 3 and self.feature[2] == 3

    def key(self, chunk: int) -> str:
        """The store key of chunk ``chunk`` (along time; every other index is 0)."""
        return self.path + "/" + self.separator.join(
            [str(chunk)] + ["0"] * len(self.feature))

    def decode(self, raw: bytes | None, chunk: int) -> np.ndarray:
        """One stored chunk as (chunk_rows, *feature) in the stored dtype; None: the fill
        value (zarr does not write a chunk equal to it). ``BoundError`` or
        ``images.HeaderError`` when it is not what the metadata declares."""
        shape = (self.chunk_rows, *self.feature)
        if raw is None:
            return np.full(shape, self.fill, dtype=self.dtype)
        if self.codec in images.IMAGE_CODECS:
            h, w, c = self.feature
            return images.decode(self.codec, raw, h, w, c)[None]
        if len(raw) > raw_bound(self.chunk_bytes):
            raise BoundError(f"stored chunk of {len(raw)} bytes is over the bound of "
                             f"{raw_bound(self.chunk_bytes)}")
        steps = (self.codec,) if self.codec else ()
        data = run_chain(steps, raw, self.chunk_bytes, True)
        if len(data) != self.chunk_bytes:
            raise BoundError(f"{len(data)} bytes, expected {self.chunk_bytes}")
        return np.frombuffer(data, dtype=self.dtype).reshape(shape)


def parse(path: str, doc: bytes) -> ArrayMeta:
    """``path``'s ``.zarray`` document; ``ArrayProblem`` says what is refused."""
    try:
        meta = json.loads(doc)
    except (ValueError, RecursionError) as exc:
        raise ArrayProblem(f"{path}/.zarray is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
        raise ArrayProblem(f"{path}/.zarray is not zarr format 2 array metadata")
    shape: Any = meta.get("shape")
    chunks: Any = meta.get("chunks")
    if not _ints(shape) or not _ints(chunks) or len(shape) != len(chunks) or not shape \
            or len(shape) > MAX_NDIM + 1:
        raise ArrayProblem(f"{path}: shape {shape!r} and chunks {chunks!r} must be lists of "
                           f"1 to {MAX_NDIM + 1} ints of the same length")
    if any(n < 0 for n in shape) or any(n < 1 for n in chunks) or shape[0] > MAX_BUFFER_ROWS:
        raise ArrayProblem(f"{path}: shape {shape!r} or chunks {chunks!r} out of range")
    feature = tuple(shape[1:])
    if list(chunks[1:]) != list(feature):
        raise ArrayProblem(f"{path} is chunked {chunks!r} for shape {shape!r}: the daemon "
                           "reads arrays chunked along time only")
    if math.prod(feature) > MAX_FEATURE_ELEMENTS:
        raise ArrayProblem(f"{path}: {math.prod(feature)} values a row, more than "
                           f"{MAX_FEATURE_ELEMENTS}")
    dtype = _dtype(path, meta.get("dtype"))
    row_bytes = max(math.prod(feature) * max(dtype.itemsize, 4), 1)
    chunk_rows = min(chunks[0], max(shape[0], 1))
    if chunks[0] * math.prod(feature) * dtype.itemsize > MAX_CHUNK_BYTES \
            or chunk_rows * row_bytes > MAX_CHUNK_BYTES:
        raise ArrayProblem(f"{path}: chunks of {chunks[0]} rows exceed "
                           f"{MAX_CHUNK_BYTES} bytes")
    if meta.get("order", "C") != "C" and feature:
        raise ArrayProblem(f"{path}: order {meta.get('order')!r}; the daemon reads C order")
    filters = meta.get("filters")
    if filters:
        ids = [f.get("id") if isinstance(f, dict) else f for f in filters] \
            if isinstance(filters, list) else filters
        raise ArrayProblem(f"{path}: filters {str(ids)[:200]} are not decoded by the daemon")
    codec = _codec(path, meta.get("compressor"))
    separator = meta.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise ArrayProblem(f"{path}: dimension_separator {separator!r}")
    if codec in images.IMAGE_CODECS and not (
            chunks[0] == 1 and dtype == np.uint8 and len(feature) == 3):
        raise ArrayProblem(f"{path}: codec {codec!r} needs one uint8 H x W x C frame a "
                           f"chunk, got chunks {chunks!r} of {dtype}")
    return ArrayMeta(path, int(shape[0]), int(chunks[0]), feature, dtype, codec,
                     _fill(meta.get("fill_value")), separator)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in value)


def _dtype(path: str, value: Any) -> np.dtype[Any]:
    if not isinstance(value, str) or len(value) > 8:
        raise ArrayProblem(f"{path}: dtype {value!r} is not a plain numeric dtype")
    try:
        dtype = np.dtype(value)
    except Exception:  # numpy raises TypeError, SyntaxError, ValueError... for odd strings
        raise ArrayProblem(f"{path}: dtype {value!r} is not a numpy dtype") from None
    if dtype.kind not in _KINDS or dtype.itemsize > 8 or dtype.fields is not None \
            or dtype.shape:
        raise ArrayProblem(f"{path}: dtype {value!r} is not served (bool, ints and floats "
                           "are)")
    return dtype


def _codec(path: str, compressor: Any) -> str:
    if compressor is None:
        return ""
    cid = compressor.get("id") if isinstance(compressor, dict) else None
    if cid in COMPRESSORS:
        return COMPRESSORS[cid]
    if cid in images.IMAGE_CODECS:
        return str(cid)
    known = sorted([*COMPRESSORS, *images.IMAGE_CODECS])
    raise ArrayProblem(f"{path}: codec {cid!r} is not one the daemon decodes (it decodes "
                       f"{', '.join(known)} and uncompressed chunks)")


def _fill(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return 0.0
