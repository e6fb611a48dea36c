"""Decoded camera frames on the wire: what the daemon sends for a frame it decoded itself
(a video frame), in the same ``frames`` field that carries JPEG bytes.

A raw frame is a 16-byte header, ``MAGIC`` then height and width as little-endian uint32,
followed by ``height * width * 3`` bytes of RGB (HxWx3, uint8). The magic cannot start a
JPEG (``FF D8``), so a client tells the two apart by the first bytes.
"""

from __future__ import annotations

import struct
from typing import Any

MAGIC = b"\x89EPRGB\r\n"
HEADER = struct.Struct("<8sII")
HEADER_BYTES = HEADER.size  # 16


def pack(height: int, width: int, rgb: bytes) -> bytes:
    """One HxWx3 uint8 frame (its bytes in C order) as a raw frame."""
    if len(rgb) != height * width * 3:
        raise ValueError(f"{len(rgb)} bytes of RGB for a {height}x{width} frame, expected "
                         f"{height * width * 3}")
    return HEADER.pack(MAGIC, height, width) + rgb


def size_of(data: bytes | memoryview | Any) -> tuple[int, int] | None:
    """``(H, W)`` of a raw frame whose length matches its header; None for anything else.
    ``data``: bytes, or any 1-D uint8 buffer (a view of a shared segment)."""
    if len(data) < HEADER_BYTES or bytes(data[:len(MAGIC)]) != MAGIC:
        return None
    _, height, width = HEADER.unpack_from(data)
    if len(data) != HEADER_BYTES + height * width * 3:
        return None
    return height, width
