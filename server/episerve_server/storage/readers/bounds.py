"""Decoding bounded by metadata: every codec's output size is known, or capped, before it
allocates, and anything else is refused.

- zstd: each frame's header is parsed (magic, descriptor, window, dictionary id, content
  size) and its blocks walked to find the next frame; a frame with no content size, a
  skippable frame or one needing a dictionary is refused, never decoded unbounded.
- blosc: the 16-byte header gives the decoded and the compressed size.
- gzip / zlib: inflated with ``max_length``, so a bomb stops one byte past the bound.
- crc32c: a checksum only (its output is its input less 4 bytes).
- vlen-bytes: parsed here (u32 count, then per item a u32 length and the bytes), each
  length checked against ``max_item_bytes`` before anything is sliced.

The sanity limits for array metadata (rows, chunk sizes, feature sizes) live here too.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numcodecs
from numcodecs import blosc as _blosc

from episerve_proto.contract import MAX_EPISODE_FRAMES

# -- limits on array metadata (beyond them an array, or the episode, is refused at open) ------
MAX_ROWS = MAX_EPISODE_FRAMES  # rows of an array, and total_frames (the contract's bound)
MAX_NDIM = 8
MAX_FEATURE_ELEMENTS = 2**24  # values per row
#: An episode's ``fps`` (zarr and LeRobot alike): ``i / fps`` must stay a time a video can
#: seek to and ``fps`` a float32 the answer can carry.
MIN_FPS, MAX_FPS = 1e-3, 10_000.0
MAX_ROW_BYTES = 64 << 20  # bytes per row of the float32 output
MAX_CHUNK_BYTES = 256 << 20  # one decoded chunk (stored dtype or float32), and any vlen chunk
MAX_CHUNKS_PER_SHARD = 2**20  # a shard index of 16 MiB
MAX_VLEN_CHUNK_ROWS = 2**20  # elements of one variable-length chunk (a fill chunk: 8 MiB)
DEFAULT_MAX_ITEM_BYTES = 8 << 20  # matches ServerConfig.max_item_bytes

_ZSTD_MAGIC = 0xFD2FB528
_GZIP_MAGIC = b"\x1f\x8b"


class BoundError(ValueError):
    """A chunk whose decoded size would differ from what its metadata allows."""


def raw_bound(decoded: int) -> int:
    """The largest stored (compressed) form of ``decoded`` bytes we accept: the bound plus
    slack for compression overhead; also the bound of an intermediate step of a chain."""
    return decoded + decoded // 16 + 4096


def vlen_bound(rows: int, max_item_bytes: int) -> int:
    """The largest decoded vlen-bytes chunk of ``rows`` items."""
    return min(rows * (4 + max_item_bytes) + 4, MAX_CHUNK_BYTES)


# -- codecs ----------------------------------------------------------------------------------

def zstd_content_size(data: bytes, limit: int) -> int:
    """Total content size declared by the zstd frames of ``data``; refused past ``limit``."""
    pos, total, n = 0, 0, len(data)
    while pos < n:
        magic = _u32(data, pos)
        if magic & 0xFFFFFFF0 == 0x184D2A50:
            raise BoundError("zstd skippable frame refused")
        if magic != _ZSTD_MAGIC:
            raise BoundError(f"not a zstd frame (magic {magic:#010x} at byte {pos})")
        if pos + 5 > n:
            raise BoundError("truncated zstd frame header")
        fhd = data[pos + 4]
        fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
        if fhd & 0x08:
            raise BoundError("zstd frame header has its reserved bit set")
        p = pos + 5 + (0 if single else 1)
        did_size = (0, 1, 2, 4)[did_flag]
        if did_size and _uint(data, p, did_size):
            raise BoundError("zstd frame needs a dictionary")
        p += did_size
        fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
        if not fcs_size:
            raise BoundError("zstd frame declares no content size (refused: unbounded)")
        size = _uint(data, p, fcs_size) + (256 if fcs_size == 2 else 0)
        total += size
        if total > limit:
            raise BoundError(f"zstd frame declares {total} bytes, over the bound of {limit}")
        pos = _skip_blocks(data, p + fcs_size) + (4 if fhd & 0x04 else 0)
    if pos != n or pos == 0:
        raise BoundError("truncated or empty zstd data")
    return total


def _skip_blocks(data: bytes, p: int) -> int:
    while True:
        header = _uint(data, p, 3)
        p += 3
        kind, size = (header >> 1) & 3, header >> 3
        if kind == 3:
            raise BoundError("zstd block of reserved type")
        p += 1 if kind == 1 else size
        if p > len(data):
            raise BoundError("truncated zstd block")
        if header & 1:
            return p


def decode_zstd(data: bytes, limit: int, exact: bool) -> bytes:
    size = zstd_content_size(data, limit)
    if exact and size != limit:
        raise BoundError(f"zstd data declares {size} bytes, expected exactly {limit}")
    if size == 0:  # numcodecs cannot decode an empty frame
        return b""
    out = bytes(numcodecs.Zstd().decode(data))
    if len(out) != size:
        raise BoundError(f"zstd data decoded to {len(out)} bytes, declared {size}")
    return out


def decode_blosc(data: bytes, limit: int, exact: bool) -> bytes:
    if len(data) < 16:
        raise BoundError(f"blosc data of {len(data)} bytes is shorter than its header")
    nbytes, cbytes, _ = _blosc._cbuffer_sizes(data)
    if cbytes != len(data):
        raise BoundError(f"blosc header says {cbytes} compressed bytes, got {len(data)}")
    if nbytes > limit or (exact and nbytes != limit):
        want = f"exactly {limit}" if exact else f"at most {limit}"
        raise BoundError(f"blosc header declares {nbytes} bytes, expected {want}")
    if nbytes == 0:  # numcodecs cannot decode an empty buffer
        return b""
    return bytes(numcodecs.Blosc().decode(data))


def _inflate(data: bytes, limit: int, wbits: int) -> bytes:
    parts: list[bytes] = []
    total, rest = 0, data
    while True:
        d = zlib.decompressobj(wbits)
        part = d.decompress(rest, limit + 1 - total)
        total += len(part)
        if total > limit:
            raise BoundError(f"deflate data inflates past the bound of {limit} bytes")
        if not d.eof:
            raise BoundError("truncated deflate data")
        parts.append(part)
        rest = d.unused_data
        if wbits != 31 or not rest:
            return b"".join(parts)
        if rest[:2] != _GZIP_MAGIC:
            raise BoundError(f"{len(rest)} bytes of garbage after the gzip data")


def decode_gzip(data: bytes, limit: int, exact: bool) -> bytes:
    return _inflate(data, limit, 31)


def decode_zlib(data: bytes, limit: int, exact: bool) -> bytes:
    return _inflate(data, limit, 15)


def decode_crc32c(data: bytes, limit: int, exact: bool) -> bytes:
    if len(data) - 4 > limit:
        raise BoundError(f"{len(data) - 4} checksummed bytes, over the bound of {limit}")
    return bytes(numcodecs.CRC32C().decode(data))


Step = Callable[[bytes, int, bool], bytes]
STEPS: dict[str, Step] = {"zstd": decode_zstd, "blosc": decode_blosc, "gzip": decode_gzip,
                          "zlib": decode_zlib, "crc32c": decode_crc32c}


def run_chain(steps: tuple[str, ...], raw: bytes, bound: int, exact: bool) -> bytes:
    """Decode ``raw`` through ``steps`` (decode order). The last step's output is at most
    ``bound`` bytes (exactly, if ``exact``); every earlier one at most ``raw_bound(bound)``."""
    data = raw
    for k, name in enumerate(steps):
        last = k == len(steps) - 1
        data = STEPS[name](data, bound if last else raw_bound(bound), exact and last)
    return data


def parse_vlen(data: bytes, rows: int, max_item_bytes: int) -> list[bytes]:
    """The items of a vlen-bytes chunk, which must hold exactly ``rows`` of them."""
    n = len(data)
    if n < 4:
        raise BoundError(f"vlen-bytes chunk of {n} bytes has no item count")
    count = _u32(data, 0)
    if count != rows:
        raise BoundError(f"vlen-bytes chunk holds {count} items, expected {rows}")
    view, pos, items = memoryview(data), 4, []
    for k in range(count):
        if pos + 4 > n:
            raise BoundError(f"vlen-bytes chunk is truncated at item {k}")
        size = _u32(data, pos)
        if size > max_item_bytes:
            raise BoundError(f"item {k} declares {size} bytes, over the limit of "
                             f"{max_item_bytes} bytes (max_item_bytes)")
        pos += 4
        if pos + size > n:
            raise BoundError(f"item {k} declares {size} bytes but the chunk is truncated")
        items.append(bytes(view[pos:pos + size]))
        pos += size
    if pos != n:
        raise BoundError(f"{n - pos} bytes of garbage after the last vlen-bytes item")
    return items


def _u32(data: bytes, pos: int) -> int:
    return _uint(data, pos, 4)


def _uint(data: bytes, pos: int, size: int) -> int:
    if pos + size > len(data):
        raise BoundError("truncated header")
    return int.from_bytes(data[pos:pos + size], "little")
