"""A local dataset root that cannot be used to read anything else.

The root is written by people the daemon does not trust, so every file it opens obeys one
rule: **it must be a regular file whose real path lies under the root's real path.**

- Symlinks are allowed only if they resolve inside the root (a chunk linked to a sibling
  episode is fine; a link to ``/etc/passwd`` or ``/dev/zero`` is refused). The check is made
  on the file actually opened (``/proc/self/fd``), so swapping a link after the check does
  not help.
- Files are opened ``O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY``: a FIFO cannot block the
  open, and ``fstat`` then refuses FIFOs, devices, sockets and directories before a byte is
  read.
- A file larger than the caller's cap (``max_bytes``; by default ``max_metadata_bytes`` for
  metadata documents and ``max_object_bytes`` for anything else) is refused by its
  ``st_size``, before reading. Byte ranges are read with ``os.pread``, never more than the
  file holds.
- ``exists`` and ``list_dir`` do not follow links out of the root either: a root entry that
  is a link to elsewhere is listed, but nothing can be opened through it.
- Every filesystem call runs in a worker thread, never on the event loop.

A refusal raises a subclass of :class:`Refused`; the catalog turns it into a broken
episode, the chunk readers into ``DataLossError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import posixpath
import stat
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Self, TypeAlias

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import LocalStore

METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"})
DEFAULT_MAX_METADATA_BYTES = 1 << 20
DEFAULT_MAX_OBJECT_BYTES = 256 << 20
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
#: One read of a batch: (store key, byte range or None for the whole object, size cap).
ByteGet: TypeAlias = tuple[str, ByteRequest | None, int]


class Refused(Exception):
    """A store object the daemon will not read; ``key`` is the store key."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key!r}: {why}")
        self.key, self.why = key, why


class OutsideRoot(Refused):
    """The object resolves to a path outside the dataset root."""


class NotARegularFile(Refused):
    """A FIFO, a device, a socket or a directory where a file was expected."""


class ObjectTooLarge(Refused):
    """The object is larger than the cap for it."""


MAX_REMEMBERED_DIRS = 1 << 16


class ConfinedLocalStore(LocalStore):
    """A read-only ``LocalStore`` that serves only regular files inside its root."""

    def __init__(self, root: Path | str, *, read_only: bool = True,
                 max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        if not read_only:
            raise ValueError("ConfinedLocalStore is read-only")
        super().__init__(root, read_only=True)
        self.real_root = os.path.realpath(self.root)
        # Real paths of folders already resolved: a chunk's check is then one lstat, not a
        # walk of every component. (A folder swapped for a link out of the root after it was
        # first seen is still caught by the check of the opened descriptor.)
        self._real_dirs: dict[str, str] = {}
        self.max_metadata_bytes = max_metadata_bytes
        self.max_object_bytes = max_object_bytes

    def with_read_only(self, read_only: bool = False) -> Self:
        return type(self)(self.root, read_only=read_only,
                          max_metadata_bytes=self.max_metadata_bytes,
                          max_object_bytes=self.max_object_bytes)

    async def _open(self, *, mode: Any = None) -> None:
        if not await asyncio.to_thread(os.path.isdir, self.root):
            raise FileNotFoundError(f"dataset root {str(self.root)!r} is not a folder")
        self._is_open = True

    def cap_for(self, key: str) -> int:
        if posixpath.basename(key) in METADATA_NAMES:
            return self.max_metadata_bytes
        return self.max_object_bytes

    def inside(self, real: str) -> bool:
        root = self.real_root.rstrip(os.sep)
        return real == self.real_root or real.startswith(root + os.sep)

    # -- reads --------------------------------------------------------------------------

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None, *,
                  max_bytes: int | None = None) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        cap = self.cap_for(key) if max_bytes is None else max_bytes
        data = await asyncio.to_thread(self.read_sync, key, byte_range, cap)
        return None if data is None else prototype.buffer.from_bytes(data)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    def read_sync(self, key: str, byte_range: ByteRequest | None, cap: int) -> bytes | None:
        """The bytes of ``key`` (or a range of them); None if there is no such file."""
        path = os.path.join(self.root, key)
        try:
            real = self._real_path(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not self.inside(real):  # before opening: no outside device opens
            raise OutsideRoot(key, f"resolves outside the dataset root {self.real_root!r}")
        try:
            fd = os.open(path, _FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return self._read_fd(key, fd, byte_range, cap)
        finally:
            os.close(fd)

    def open_sync(self, key: str, cap: int) -> BinaryIO:
        """``key`` opened for reading by a library that reads files itself (pyarrow, PyAV):
        a regular file inside the root of at most ``cap`` bytes, checked on the file
        opened, as every other read is. ``FileNotFoundError`` if there is no such file."""
        path = os.path.join(self.root, key)
        real = self._real_path(path)
        if not self.inside(real):
            raise OutsideRoot(key, f"resolves outside the dataset root {self.real_root!r}")
        fd = os.open(path, _FLAGS)
        try:
            self._check_fd(key, fd, cap)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    async def get_many(self, requests: Sequence[ByteGet]) -> list[bytes | None]:
        """Many ranged reads in one worker thread: each file is opened (and checked) once,
        then read with one ``pread`` per range. A refused file raises as ``get`` would."""
        return await asyncio.to_thread(self.read_many_sync, requests)

    def read_many_sync(self, requests: Sequence[ByteGet]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(requests)
        by_key: dict[str, list[int]] = {}
        for i, (key, _, _) in enumerate(requests):
            by_key.setdefault(key, []).append(i)
        for key, which in by_key.items():
            path = os.path.join(self.root, key)
            try:
                real = self._real_path(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not self.inside(real):
                raise OutsideRoot(key, f"resolves outside the dataset root {self.real_root!r}")
            try:
                fd = os.open(path, _FLAGS)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                size = self._check_fd(key, fd, max(requests[i][2] for i in which))
                for i in which:
                    _, byte_range, cap = requests[i]
                    if size > cap:
                        raise ObjectTooLarge(key, f"holds {size} bytes, over the limit of {cap}")
                    start, stop = _span(byte_range, size)
                    out[i] = _pread(fd, start, stop - start)
            except OSError as exc:  # (pread does not say which file it was reading)
                if exc.filename is None:
                    exc.filename = key
                raise
            finally:
                os.close(fd)
        return out

    def _real_path(self, path: str) -> str:
        """``os.path.realpath(path)``, with the folder part remembered between calls."""
        folder, name = os.path.split(path)
        real_folder = self._real_dirs.get(folder)
        if real_folder is None:
            real_folder = os.path.realpath(folder)
            if len(self._real_dirs) >= MAX_REMEMBERED_DIRS:
                self._real_dirs.clear()
            self._real_dirs[folder] = real_folder
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return os.path.realpath(path)
        return os.path.join(real_folder, name)

    def _read_fd(self, key: str, fd: int, byte_range: ByteRequest | None, cap: int) -> bytes:
        size = self._check_fd(key, fd, cap)
        start, stop = _span(byte_range, size)
        return _pread(fd, start, stop - start)

    def _check_fd(self, key: str, fd: int, cap: int) -> int:
        """The size of an opened file that is regular, inside the root and within ``cap``."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(key, f"is not a regular file (mode {stat.filemode(st.st_mode)})")
        real = _fd_path(fd, os.path.join(self.root, key))
        if not self.inside(real):
            raise OutsideRoot(key, f"resolves to {real!r}, outside the root {self.real_root!r}")
        if st.st_size > cap:
            raise ObjectTooLarge(key, f"holds {st.st_size} bytes, over the limit of {cap}")
        return int(st.st_size)

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self._exists_sync, key)

    def _exists_sync(self, key: str) -> bool:
        real = os.path.realpath(os.path.join(self.root, key))
        return self.inside(real) and os.path.isfile(real)

    async def getsize(self, key: str) -> int:
        def size() -> int:
            real = os.path.realpath(os.path.join(self.root, key))
            if not self.inside(real):
                raise OutsideRoot(key, f"resolves outside the dataset root {self.real_root!r}")
            return os.path.getsize(real)

        return await asyncio.to_thread(size)

    # -- listing ------------------------------------------------------------------------

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        for name in await asyncio.to_thread(self._list_dir_sync, prefix):
            yield name

    def _list_dir_sync(self, prefix: str) -> list[str]:
        real = os.path.realpath(os.path.join(self.root, prefix))
        if not self.inside(real):
            return []
        try:
            return sorted(os.listdir(real))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def fingerprint_sync(self, prefix: str, max_files: int) -> tuple[str, str]:
        """What a folder holds, as two digests of 16 hex digits: one over every entry's
        name, size, mtime and inode (it changes when any file under ``prefix`` is written,
        replaced, added or removed), one over the regular files' names and sizes only (the
        same for a copy). Links are not followed; past ``max_files`` entries the walk stops
        (and says so)."""
        real = os.path.realpath(os.path.join(self.root, prefix))
        if not self.inside(real) or not os.path.isdir(real):
            return "absent", ""
        changes, sizes = hashlib.sha256(), hashlib.sha256()
        todo, seen = [(real, "")], 0
        while todo and seen <= max_files:
            folder, rel = todo.pop()
            try:
                with os.scandir(folder) as it:
                    entries = sorted(itertools.islice(it, max_files + 1 - seen),
                                     key=lambda e: e.name)
            except OSError as exc:
                changes.update(f"\0{rel}\0!{type(exc).__name__}".encode())
                continue
            for entry in entries:
                seen += 1
                if seen > max_files:
                    break
                name = f"{rel}/{entry.name}"
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    todo.append((entry.path, name))
                elif stat.S_ISREG(st.st_mode):
                    sizes.update(f"\0{name}\0{st.st_size}".encode())
                changes.update(f"\0{name}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}"
                               f"\0{st.st_ino}".encode())
        if seen > max_files:
            changes.update(b"\0truncated")
        return changes.hexdigest()[:16], sizes.hexdigest()[:16]

    async def list(self) -> AsyncIterator[str]:
        raise NotImplementedError("a confined root is never listed recursively")
        yield ""  # pragma: no cover

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        raise NotImplementedError("a confined root is never listed recursively")
        yield ""  # pragma: no cover


def _fd_path(fd: int, fallback: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(fallback)


def _span(byte_range: ByteRequest | None, size: int) -> tuple[int, int]:
    """[start, stop) of a byte request over a file of ``size`` bytes, clamped to it."""
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        start, stop = byte_range.start, byte_range.end
    elif isinstance(byte_range, OffsetByteRequest):
        start, stop = byte_range.offset, size
    elif isinstance(byte_range, SuffixByteRequest):
        start, stop = size - byte_range.suffix, size
    else:
        raise TypeError(f"unexpected byte range {byte_range!r}")
    start = min(max(0, start), size)
    return start, min(max(start, stop), size)


def _pread(fd: int, offset: int, length: int) -> bytes:
    parts, done = [], 0
    while done < length:
        part = os.pread(fd, length - done, offset + done)
        if not part:
            break
        parts.append(part)
        done += len(part)
    return b"".join(parts)
