"""A zip file as a read-only root (a replay buffer saved as ``*.zarr.zip``), bounded as a
local folder is.

The central directory is read here rather than by ``zipfile``, which keeps a ``ZipInfo``
object per member: 615 bytes a member measured with tracemalloc (54 MiB for a zip of 92,501
members). The index keeps, per member, its name and four numbers (where its local header
is, its stored and its declared size, its CRC-32) and whether it is deflated: 297 bytes a
member on the same zip (26 MiB). Before anything is read, the member count the end record
declares (ZIP64's too) must be at most ``MAX_MEMBERS`` and the directory at most
``MAX_DIRECTORY_BYTES``. Each read is refused when the member's declared size is over the
reader's cap, inflates at most that many bytes, and checks the CRC-32; members are read in
a worker thread, never on the event loop. Members are stored or deflated; any other method
or an encrypted member is refused by name.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import struct
import zlib
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

from zarr.abc.store import ByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from episerve_server.storage.confined_root import (
    METADATA_NAMES,
    ByteGet,
    NotARegularFile,
    ObjectTooLarge,
    Refused,
)

#: Members a zip root may hold, and bytes its central directory may take.
MAX_MEMBERS = 1 << 20
MAX_DIRECTORY_BYTES = 256 << 20
_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_STORED, _DEFLATED = 0, 8


class DamagedMember(Refused):
    """A member whose bytes are not what the directory says (data loss, not a bad read)."""


class BadZipRoot(Exception):
    """A zip root that cannot be served: not a zip file, or one past the bounds."""


def is_zip_root(root: str) -> bool:
    """Whether ``root`` names a zip file to serve (a local ``*.zip`` regular file)."""
    return "://" not in root and root.endswith(".zip") and os.path.isfile(root)


def _end_record(f: BinaryIO, size: int) -> tuple[int, int, int]:
    """(member count, directory offset, directory size) from the end record, ZIP64's when
    the file has one; ``ValueError`` when it has none."""
    tail_len = min(size, 65535 + 22)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(_EOCD)
    if at < 0 or at + 22 > len(tail):
        raise ValueError("not a zip file (no end of central directory record)")
    count, dir_size, dir_offset = struct.unpack_from("<HII", tail, at + 10)
    if at >= 20 and tail[at - 20:at - 16] == _EOCD64_LOCATOR:
        offset = struct.unpack_from("<Q", tail, at - 20 + 8)[0]
        if offset + 56 > size:
            raise ValueError("its ZIP64 end record lies past the end of the file")
        f.seek(offset)
        record = f.read(56)
        if record[:4] != _EOCD64:
            raise ValueError("its ZIP64 end record is missing")
        count, dir_size, dir_offset = struct.unpack_from("<QQQ", record, 32)
    return int(count), int(dir_offset), int(dir_size)


class _Member:
    """One member as the index keeps it."""

    __slots__ = ("crc", "deflated", "header", "size", "stored")

    def __init__(self, header: int, stored: int, size: int, crc: int, deflated: bool) -> None:
        self.header, self.stored, self.size, self.crc = header, stored, size, crc
        self.deflated = deflated


def read_directory(path: Path | str) -> dict[str, _Member]:
    """Every member of the zip file at ``path``, by name; ``ValueError`` saying why when the
    file is not a zip or passes a bound."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        count, offset, length = _end_record(f, size)
        if count > MAX_MEMBERS:
            raise ValueError(f"it holds {count} members, more than {MAX_MEMBERS}")
        if length > MAX_DIRECTORY_BYTES or offset + length > size:
            raise ValueError(f"its central directory of {length} bytes at {offset} is past "
                             f"the file's end or over {MAX_DIRECTORY_BYTES} bytes")
        f.seek(offset)
        data = f.read(length)
    members: dict[str, _Member] = {}
    pos = 0
    for _ in range(count):
        if data[pos:pos + 4] != _CENTRAL or pos + 46 > len(data):
            raise ValueError(f"its central directory is damaged at byte {pos}")
        (flags, method, crc, stored, declared, name_len, extra_len, comment_len,
         header) = struct.unpack_from("<8xHH4xIIIHHH8xI", data, pos)
        name_at = pos + 46
        name = data[name_at:name_at + name_len].decode("utf-8", "replace")
        extra = data[name_at + name_len:name_at + name_len + extra_len]
        pos = name_at + name_len + extra_len + comment_len
        if 0xFFFFFFFF in (stored, declared, header):
            declared, stored, header = _zip64_sizes(extra, declared, stored, header)
        if name.endswith("/"):
            continue  # a folder entry
        if flags & 1 or method not in (_STORED, _DEFLATED) or header + stored > size \
                or (method == _STORED and stored != declared):
            members[name] = _Member(header, -1, declared, crc, False)  # refused when read
            continue
        members[name] = _Member(header, stored, declared, crc, method == _DEFLATED)
    return members


def _zip64_sizes(extra: bytes, declared: int, stored: int, header: int) -> tuple[int, int, int]:
    """The ZIP64 extra field's values for those the record left at 0xFFFFFFFF, in order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{min(length // 8, 3)}Q", extra, pos + 4))
            if declared == 0xFFFFFFFF and values:
                declared = values.pop(0)
            if stored == 0xFFFFFFFF and values:
                stored = values.pop(0)
            if header == 0xFFFFFFFF and values:
                header = values.pop(0)
            break
        pos += 4 + length
    return declared, stored, header


class ConfinedZipStore(Store):
    """A read-only zip root through its own compact index: members capped by their
    declared size, inflated within it, CRC-checked, read in a thread."""

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, path: Path | str, *, max_metadata_bytes: int,
                 max_object_bytes: int) -> None:
        # (imported here: the readers' package imports the store module, which imports this)
        from episerve_server.storage.readers.bounds import raw_bound

        super().__init__(read_only=True)
        self._raw_bound = raw_bound  # stored bytes accepted for a member of a capped size
        self.path = Path(path)
        try:
            self.members = read_directory(self.path)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except (ValueError, OSError, struct.error) as exc:
            raise BadZipRoot(f"zip root {str(path)!r} cannot be served: {exc}") from None
        self._is_open = True
        self.max_metadata_bytes, self.max_object_bytes = max_metadata_bytes, max_object_bytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfinedZipStore) and self.path == other.path

    def __repr__(self) -> str:
        return f"ConfinedZipStore({str(self.path)!r})"

    def close(self) -> None:
        super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def cap_for(self, key: str) -> int:
        name = posixpath.basename(key)
        return self.max_metadata_bytes if name in METADATA_NAMES else self.max_object_bytes

    def read_sync(self, key: str, byte_range: ByteRequest | None, cap: int) -> bytes | None:
        member = self.members.get(key)
        if member is None:
            return None
        if member.stored < 0:
            raise NotARegularFile(key, "is encrypted, compressed by a method other than "
                                       "stored or deflate, or declares sizes past the file")
        if member.size > cap or member.stored > self._raw_bound(cap):
            raise ObjectTooLarge(key, f"holds {member.size} bytes ({member.stored} stored), "
                                      f"over the limit of {cap}")
        head = os.pread(self._fd, 30, member.header)
        if len(head) < 30 or head[:4] != _LOCAL:
            raise DamagedMember(key, f"has no local header at byte {member.header}")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        start = member.header + 30 + name_len + extra_len
        raw = os.pread(self._fd, member.stored, start)
        if len(raw) != member.stored:
            raise DamagedMember(key, "is truncated")
        if member.deflated:
            try:
                data = zlib.decompressobj(-15).decompress(raw, member.size + 1)
            except zlib.error as exc:
                raise DamagedMember(key, f"does not inflate ({exc})") from None
            if len(data) != member.size:
                raise DamagedMember(key, f"inflates to other than its {member.size} bytes")
        else:
            data = raw
        if len(data) != member.size or zlib.crc32(data) != member.crc:
            raise DamagedMember(key, "fails its CRC-32")
        if isinstance(byte_range, RangeByteRequest):
            return data[byte_range.start:byte_range.end]
        if byte_range is not None:
            raise Refused(key, "only whole members or ranges are read")
        return data

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

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        return [await self.get(key, prototype, rng) for key, rng in key_ranges]

    async def exists(self, key: str) -> bool:
        return key in self.members

    async def set(self, key: str, value: Buffer) -> None:
        raise PermissionError("a zip root is read-only")

    async def delete(self, key: str) -> None:
        raise PermissionError("a zip root is read-only")

    async def list(self) -> AsyncIterator[str]:
        for name in list(self.members):
            yield name

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for name in list(self.members):
            if name.startswith(prefix):
                yield name

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        seen: set[str] = set()
        for name in list(self.members):
            if name.startswith(base):
                head = name[len(base):].split("/", 1)[0]
                if head and head not in seen:
                    seen.add(head)
                    yield head
