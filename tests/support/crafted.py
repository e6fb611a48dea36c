"""Hostile store objects for the storage-hardening tests: crafted codec frames and bombs,
paths of chunk files, and edits of zarr metadata documents.

Every bomb here is small on disk and claims (or really inflates to) far more than the chunk
it replaces may hold; none is built by allocating what it claims.
"""

from __future__ import annotations

import asyncio
import functools
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

ZSTD_MAGIC = struct.pack("<I", 0xFD2FB528)
_ZEROS_BLOCK = 1 << 20


def zstd_declaring(content_size: int, payload: bytes = b"\0" * 16) -> bytes:
    """A zstd frame whose header declares ``content_size`` bytes (8-byte field, single
    segment) followed by one raw block of ``payload``: a few bytes that ask for terabytes."""
    header = ZSTD_MAGIC + bytes([0xE0]) + struct.pack("<Q", content_size)
    return header + _raw_block(payload)


def zstd_without_size(payload: bytes = b"\0" * 16) -> bytes:
    """A valid zstd frame that declares no content size (window descriptor, no FCS)."""
    return ZSTD_MAGIC + bytes([0x00, 0x00]) + _raw_block(payload)


def zstd_skippable(payload: bytes = b"\0" * 16) -> bytes:
    return struct.pack("<II", 0x184D2A50, len(payload)) + payload


def _raw_block(payload: bytes) -> bytes:
    header = 1 | (0 << 1) | (len(payload) << 3)  # last block, raw
    return header.to_bytes(3, "little") + payload


@functools.cache
def zstd_bomb(nbytes: int = 64 << 20) -> bytes:
    """Real zstd data inflating to ``nbytes`` zeros (compressed once, then cached)."""
    return bytes(numcodecs.Zstd(level=1).encode(np.zeros(nbytes, np.uint8)))


@functools.cache
def gzip_bomb(nbytes: int = 64 << 20) -> bytes:
    """Real gzip data inflating to ``nbytes`` zeros, compressed piece by piece."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(_ZEROS_BLOCK)
    parts = [z.compress(block) for _ in range(nbytes // _ZEROS_BLOCK)]
    return b"".join([*parts, z.flush()])


def blosc_declaring(nbytes: int) -> bytes:
    """A real blosc frame whose header is patched to declare ``nbytes`` decoded bytes."""
    frame = bytearray(numcodecs.Blosc(cname="lz4").encode(np.zeros(64, np.uint8)))
    frame[4:8] = struct.pack("<I", nbytes)
    return bytes(frame)


def vlen_declaring(item_bytes: int, actual: bytes = b"\xff\xd8tiny") -> bytes:
    """A vlen-bytes chunk of one item whose length field says ``item_bytes``."""
    return struct.pack("<II", 1, item_bytes) + actual


def chunk_file(root: Path, episode: str, key: str, chunk: int, *, ndim: int = 2,
               layout: str = "unsharded") -> Path:
    """The file of chunk ``chunk`` of ``key`` (v3 unsharded: ``c/<chunk>/0...``; v2:
    ``<chunk>.0...``; sharded: the one shard, ``c/0/0...``)."""
    array = root / f"{episode}.zarr" / key
    if layout == "v2":
        return array / ".".join([str(chunk), *["0"] * (ndim - 1)])
    first = 0 if layout == "sharded" else chunk
    return array.joinpath("c", str(first), *["0"] * (ndim - 1))


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def edit_attrs(root: Path, episode: str, edit: Callable[[dict[str, Any]], None]) -> None:
    edit_json(root / f"{episode}.zarr" / "zarr.json", lambda d: edit(d["attributes"]))


def edit_array(root: Path, episode: str, key: str, edit: Callable[[dict[str, Any]], None]) -> None:
    edit_json(root / f"{episode}.zarr" / key / "zarr.json", edit)


def deep_json(depth: int) -> str:
    """``[[[...]]]`` nested ``depth`` deep: valid JSON no recursive parser can read."""
    return "[" * depth + "]" * depth


class SlowMetadataStore(WrapperStore[Store]):
    """Delays every metadata document by ``delay_s`` (slow or hung storage at open)."""

    def __init__(self, store: Store, delay_s: float) -> None:
        super().__init__(store)
        self.delay_s = delay_s

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if self.delay_s and key.rsplit("/", 1)[-1] in ("zarr.json", ".zgroup", ".zarray"):
            await asyncio.sleep(self.delay_s)
        return await self._store.get(key, prototype, byte_range)
