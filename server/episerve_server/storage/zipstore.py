"""A zip file as a read-only root (a replay buffer saved as ``*.zarr.zip``), bounded as a
local folder is.

``zipfile`` reads the whole central directory when it opens a file, one record per member:
the member count the end record declares is checked first (at most ``MAX_MEMBERS``), so a
file cannot make the daemon hold millions of records. Each read is capped by the member's
declared size before anything is inflated (a member larger than the reader's cap is
refused), and members are read in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import struct
import zipfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from zarr.abc.store import ByteRequest, RangeByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import ZipStore

from episerve_server.storage.local import (
    METADATA_NAMES,
    ByteGet,
    NotARegularFile,
    ObjectTooLarge,
    Refused,
)

#: Members a zip root may hold (each is a record ``zipfile`` keeps: ~400 bytes).
MAX_MEMBERS = 1 << 20
_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"


class BadZipRoot(Exception):
    """A zip root that cannot be served: not a zip file, or one with too many members."""


def is_zip_root(root: str) -> bool:
    """Whether ``root`` names a zip file to serve (a local ``*.zip`` regular file)."""
    return "://" not in root and root.endswith(".zip") and os.path.isfile(root)


def member_count(path: Path | str) -> int:
    """The member count a zip file's end record declares (ZIP64's when it has one);
    ``ValueError`` when it has none."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        tail_len = min(size, 65535 + 22)
        f.seek(size - tail_len)
        tail = f.read(tail_len)
        at = tail.rfind(_EOCD)
        if at < 0 or at + 22 > len(tail):
            raise ValueError("not a zip file (no end of central directory record)")
        count = struct.unpack_from("<H", tail, at + 10)[0]
        if at < 20 or tail[at - 20:at - 16] != _EOCD64_LOCATOR:
            return int(count)
        offset = struct.unpack_from("<Q", tail, at - 20 + 8)[0]  # of the ZIP64 end record
        if offset + 56 > size:
            raise ValueError("its ZIP64 end record lies past the end of the file")
        f.seek(offset)
        record = f.read(56)
    if record[:4] != _EOCD64:
        raise ValueError("its ZIP64 end record is missing")
    return int(struct.unpack_from("<Q", record, 32)[0])


class ConfinedZipStore(ZipStore):
    """A read-only zip root: members capped by their declared size, read in a thread."""

    def __init__(self, path: Path | str, *, max_metadata_bytes: int,
                 max_object_bytes: int) -> None:
        try:
            count = member_count(path)
            if count > MAX_MEMBERS:
                raise ValueError(f"it holds {count} members, more than {MAX_MEMBERS}")
            super().__init__(path, mode="r", read_only=True)
            self._sync_open()
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            raise BadZipRoot(f"zip root {str(path)!r} cannot be served: {exc}") from None
        self.max_metadata_bytes, self.max_object_bytes = max_metadata_bytes, max_object_bytes

    def cap_for(self, key: str) -> int:
        name = posixpath.basename(key)
        return self.max_metadata_bytes if name in METADATA_NAMES else self.max_object_bytes

    def read_sync(self, key: str, byte_range: ByteRequest | None, cap: int) -> bytes | None:
        with self._lock:
            try:
                info = self._zf.getinfo(key)
            except KeyError:
                return None
            if info.is_dir():
                raise NotARegularFile(key, "is a folder in the zip file")
            if info.file_size > cap:
                raise ObjectTooLarge(key, f"holds {info.file_size} bytes, over the limit of "
                                          f"{cap}")
            try:
                with self._zf.open(info) as f:
                    if isinstance(byte_range, RangeByteRequest):
                        f.seek(byte_range.start)
                        return f.read(max(0, byte_range.end - byte_range.start))
                    if byte_range is not None:
                        raise Refused(key, "only whole members or ranges are read")
                    return f.read(cap + 1)
            except (zipfile.BadZipFile, EOFError, ValueError) as exc:
                raise OSError(f"zip member {key!r} cannot be read ({exc})") from exc

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None, *,
                  max_bytes: int | None = None) -> Buffer | None:
        cap = self.cap_for(key) if max_bytes is None else max_bytes
        data = await asyncio.to_thread(self.read_sync, key, byte_range, cap)
        return None if data is None else prototype.buffer.from_bytes(data)

    async def get_many(self, requests: Sequence[ByteGet]) -> list[bytes | None]:
        def read() -> list[bytes | None]:
            return [self.read_sync(key, rng, cap) for key, rng, cap in requests]

        return await asyncio.to_thread(read)

    async def exists(self, key: str) -> bool:
        def look() -> bool:
            with self._lock:
                try:
                    self._zf.getinfo(key)
                except KeyError:
                    return False
                return True

        return await asyncio.to_thread(look)

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        def names() -> list[str]:
            with self._lock:
                return self._zf.namelist()

        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        seen: set[str] = set()
        for name in await asyncio.to_thread(names):
            if name.startswith(base):
                head = name[len(base):].split("/", 1)[0]
                if head and head not in seen:
                    seen.add(head)
                    yield head
