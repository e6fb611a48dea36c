"""The spill tier: frames the daemon decoded, kept in files on local disk after the cache
lets them go, so a node decodes a frame once, not once per epoch, and a restarted daemon
starts warm.

- **What goes in.** Frame chunks of readers that decode (``ChunkReader.spill_token`` is set:
  a video's frames), when the cache evicts them or does not keep them. Nothing else: raw
  bytes a store holds (JPEG frames of a zarr episode) are cheaper to fetch again.
- **Keyed by what they were decoded from.** An entry's name is a digest of the reader's
  token (the file's size, mtime and inode, the span, the frame size, the tolerance and the
  decoder's version) and the chunk's (episode, key, index). A rewritten file has a new
  token, so its old frames are never found again; they age out.
- **Never trusted beyond its checksum.** An entry is one file: a fixed header (magic,
  version, CRC-32C and length of the rest), the chunk's identity as JSON (checked against the
  one asked for) and its frames. A read checks the file's size against the index, the
  header, the identity and the CRC before a byte is served; an entry that fails is deleted
  and counted (``spill_drops``), and the frame is decoded again.
- **Off the read path.** Evicted frames are queued on the event loop and written by one task
  in a worker thread, at most ``queue_bytes`` queued (``--spill-queue-bytes``; past that an
  entry is skipped and counted); a read never waits for a write. Each entry is written to a
  temporary name and renamed, so a crash leaves no half entry under a real name.
- **Bounded.** At most ``budget_bytes`` of entries, least recently used deleted first; the
  index (in memory) holds a name, a size and an order per entry, rebuilt at start from the
  folder (at most ``budget_bytes / MIN_ENTRY_BYTES`` entries are looked at).
- **The daemon's own folder.** Created 0700; refused when it is a symlink, not a folder, or
  owned by another user, when its parent lets another user replace it (not this user's or
  root's, or writable by others without the sticky bit), or when another daemon holds its
  lock (``flock`` on ``lock``).
- **A failing disk turns it off.** ENOSPC, EIO, EROFS or any other error writing or reading
  an entry turns the tier off with one WARNING; reads go on, decoding as without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from crc32c import crc32c

from episerve_server.core.counters import Stats

log = logging.getLogger(__name__)

ChunkId: TypeAlias = tuple[str, str, int]  # episode, key, chunk
#: The header of an entry: magic, format version, CRC-32C and length of what follows.
HEADER = struct.Struct("<8sIIQ")
MAGIC = b"EPISPILL"
VERSION = 1
SUFFIX = ".spill"
LOCK_NAME = "lock"
#: Evicted bytes queued for writing, at most, by default; more are skipped (and counted).
MAX_PENDING_BYTES = 256 << 20
#: The smallest entry the start-up scan expects: it looks at budget / this many files.
MIN_ENTRY_BYTES = 4 << 10
#: One entry's identity, as JSON, at most.
MAX_IDENTITY_BYTES = 4 << 10
#: Frames in one entry, and bytes of one entry, at most (a 4K RGB frame is 25 MB).
MAX_FRAMES = 1 << 16
MAX_ENTRY_BYTES = 256 << 20


class SpillRefused(Exception):
    """The spill folder cannot be used (its path, owner, type, or another daemon's lock)."""


@dataclass(slots=True)
class SpillCounters:
    """Counted in worker threads and on the loop alike, so under the tier's lock."""

    hits: int = 0  # chunks served from the tier instead of decoded
    writes: int = 0  # entries written
    written_bytes: int = 0
    drops: int = 0  # entries that failed their checks (deleted, decoded again)
    skipped: int = 0  # evicted chunks not written: the write queue was full
    evicted: int = 0  # entries deleted to stay within the budget


class SpillTier:
    """The folder, its index and its writer. ``open`` it (blocking: at start-up) first."""

    def __init__(self, folder: str, budget_bytes: int, stats: Stats, *,
                 queue_bytes: int = MAX_PENDING_BYTES) -> None:
        self.folder = os.path.abspath(folder)
        self.budget_bytes = budget_bytes
        self.queue_bytes = queue_bytes
        self.stats = stats
        self.enabled = False
        self.counters = SpillCounters()
        self._index: OrderedDict[str, int] = OrderedDict()  # entry name -> size, LRU order
        self._bytes = 0
        self._lock = threading.Lock()
        self._lock_fd = -1
        self._queue: deque[tuple[str, ChunkId, str, list[bytes], int]] = deque()
        self._pending_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self.off_reason = ""

    # -- start-up ---------------------------------------------------------------------------

    def open(self) -> None:
        """Make or check the folder, take its lock, and index its entries (oldest first by
        their files' mtime). Raises ``SpillRefused`` naming the folder and why."""
        folder = self.folder
        try:
            os.makedirs(folder, 0o700, exist_ok=True)  # (a worker's is in --spill-dir)
        except OSError as exc:
            raise SpillRefused(f"spill folder {folder!r} cannot be made ({exc})") from exc
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode):
            raise SpillRefused(f"spill folder {folder!r} is a symlink; give the folder itself")
        if not stat.S_ISDIR(st.st_mode):
            raise SpillRefused(f"spill folder {folder!r} is not a folder")
        if st.st_uid != os.geteuid():
            raise SpillRefused(f"spill folder {folder!r} belongs to uid {st.st_uid}, not to "
                               f"this daemon's uid {os.geteuid()}")
        parent = os.path.dirname(folder)
        pst = os.stat(parent)
        if pst.st_uid not in (0, os.geteuid()) or (
                pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX):
            # another user could move the folder away and put one of theirs in its place
            raise SpillRefused(f"spill folder {folder!r} is in {parent!r}, which another "
                               f"user can change (owner uid {pst.st_uid}, mode "
                               f"{stat.S_IMODE(pst.st_mode):o}); give a folder whose parent "
                               "only this user (or root, sticky) may write")
        try:
            if st.st_mode & 0o077:
                os.chmod(folder, 0o700)  # ours: others may not read what we decoded
            fd = os.open(os.path.join(folder, LOCK_NAME),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # a read-only or failing disk: serve without the tier
            self._turn_off(f"the folder cannot be written ({_why(exc)})")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            holder = _read_pid(os.path.join(folder, LOCK_NAME))
            raise SpillRefused(f"spill folder {folder!r} is in use by another daemon"
                               f"{f' (pid {holder})' if holder else ''}; give each daemon "
                               "its own --spill-dir") from exc
        self._lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._scan()
        except OSError as exc:  # a full or failing disk: serve without the tier
            self._turn_off(f"the folder cannot be used ({_why(exc)})")
            return
        self.enabled = self.budget_bytes > 0
        self.publish()

    def _scan(self) -> None:
        """Index the entries left by an earlier run (regular files named ``*.spill``),
        least recently written first; remove temporary files a crash left, entries past
        the most this budget can index, and what is over the budget."""
        limit = max(1, self.budget_bytes // MIN_ENTRY_BYTES)
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.folder) as it:
            for entry in it:
                if entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                if len(found) >= limit:  # more than this budget can hold: gone
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_ENTRY_BYTES:
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        for _, name, size in found:
            self._index[name] = size
            self._bytes += size
        self._trim()

    async def flush(self, timeout_s: float) -> None:
        """Wait (on the loop) up to ``timeout_s`` for the queued entries to be written."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.enabled and (self._queue or self._pending_bytes) \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self.enabled = False
        if self._writer is not None:
            self._writer.cancel()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- reads (the miss path) --------------------------------------------------------------

    def has(self, token: str, cid: ChunkId) -> bool:
        return self.enabled and entry_name(token, cid) in self._index

    def read_many(self, wanted: Sequence[tuple[str, ChunkId]]) -> dict[ChunkId, list[bytes]]:
        """The entries of ``wanted`` (token, chunk id) that are there and pass every check
        (in a worker thread); the others are absent from the answer."""
        out: dict[ChunkId, list[bytes]] = {}
        for token, cid in wanted:
            if not self.enabled:
                break
            name = entry_name(token, cid)
            with self._lock:
                size = self._index.get(name)
                if size is None:
                    continue
                self._index.move_to_end(name)
            try:
                frames = self._read(name, size, token, cid)
            except OSError as exc:
                self._turn_off(f"reading {name!r} failed ({_why(exc)})")
                break
            if frames is None:
                self._forget(name, dropped=True)
                continue
            out[cid] = frames
        with self._lock:
            self.counters.hits += len(out)
        return out

    def _read(self, name: str, size: int, token: str, cid: ChunkId) -> list[bytes] | None:
        """An entry's frames, or None when it fails a check."""
        path = os.path.join(self.folder, name)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or size < HEADER.size \
                    or size > MAX_ENTRY_BYTES:
                return None
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        return parse_entry(data, token, cid)

    # -- writes (evicted frames) ------------------------------------------------------------

    def offer(self, items: Sequence[tuple[str, ChunkId, list[bytes]]], *,
              bounded: bool = True) -> None:
        """Queue evicted frame chunks (token, chunk id, frames) for writing; on the loop,
        never waits. Those already there, or past ``queue_bytes`` (unless not
        ``bounded``: the cache's own frames at a drain, held in memory anyway), are
        skipped."""
        if not self.enabled:
            return
        queued = 0
        for token, cid, frames in items:
            name = entry_name(token, cid)
            if name in self._index:
                continue
            size = sum(map(len, frames))
            if (bounded and self._pending_bytes + size > self.queue_bytes) \
                    or len(frames) > MAX_FRAMES or size > MAX_ENTRY_BYTES // 2:
                with self._lock:
                    self.counters.skipped += 1
                continue
            self._queue.append((name, cid, token, list(frames), size))
            self._pending_bytes += size
            queued += 1
        if queued:
            if self._wake is None:
                self._wake = asyncio.Event()
            if self._writer is None or self._writer.done():
                self._writer = asyncio.ensure_future(self._write_all())
            self._wake.set()

    async def _write_all(self) -> None:
        assert self._wake is not None
        while self.enabled:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch: list[tuple[str, ChunkId, str, list[bytes], int]] = []
            while self._queue and len(batch) < 64:
                batch.append(self._queue.popleft())
            try:
                await asyncio.to_thread(self._write_batch, batch)
            finally:
                self._pending_bytes -= sum(item[4] for item in batch)
                self.publish()
        self._queue.clear()
        self._pending_bytes = 0

    def _write_batch(self, batch: list[tuple[str, ChunkId, str, list[bytes], int]]) -> None:
        for name, cid, token, frames, _ in batch:
            if not self.enabled:
                return
            data = build_entry(token, cid, frames)
            path = os.path.join(self.folder, name)
            tmp = f"{path}.{threading.get_ident()}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                             | os.O_NOFOLLOW, 0o600)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                self._turn_off(f"writing an entry failed ({_why(exc)})")
                return
            with self._lock:
                old = self._index.pop(name, None)
                self._bytes += len(data) - (old or 0)
                self._index[name] = len(data)
                self.counters.writes += 1
                self.counters.written_bytes += len(data)
            self._trim()

    # -- the budget, and turning off ----------------------------------------------------------

    def _trim(self) -> None:
        """Delete the least recently used entries until the budget holds."""
        while True:
            with self._lock:
                if self._bytes <= self.budget_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self._bytes -= size
                self.counters.evicted += 1
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))

    def _forget(self, name: str, *, dropped: bool) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size
            if dropped:
                self.counters.drops += 1
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, name))

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self.off_reason:
                return
            self.enabled = False
            self.off_reason = why
        log.warning("spill tier in %s turned off: %s; the daemon goes on serving, decoding "
                    "what it evicts again", self.folder, why)

    def publish(self) -> None:
        """Copy the counters into ``Stats`` (on the event loop, as every counter)."""
        stats, c = self.stats, self.counters
        with self._lock:
            stats.spill_hits, stats.spill_writes = c.hits, c.writes
            stats.spill_drops, stats.spill_skipped = c.drops, c.skipped
            stats.spill_evictions = c.evicted
            stats.spill_bytes, stats.spill_entries = self._bytes, len(self._index)
            stats.spill_on = int(self.enabled)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    @property
    def entries(self) -> int:
        return len(self._index)


def entry_name(token: str, cid: ChunkId) -> str:
    digest = hashlib.blake2b(digest_size=20)
    digest.update(token.encode())
    digest.update(b"\0")
    digest.update(json.dumps(list(cid)).encode())
    return digest.hexdigest() + SUFFIX


def build_entry(token: str, cid: ChunkId, frames: list[bytes]) -> bytes:
    """Header, identity (JSON: the token, the chunk id, each frame's length), frames."""
    identity = json.dumps({"token": token, "chunk": list(cid),
                           "lengths": [len(f) for f in frames]}).encode()
    body = b"".join([struct.pack("<I", len(identity)), identity, *frames])
    return HEADER.pack(MAGIC, VERSION, crc32c(body), len(body)) + body


def parse_entry(data: bytes, token: str, cid: ChunkId) -> list[bytes] | None:
    """An entry's frames when every check holds (magic, version, length, CRC, identity and
    lengths adding up), else None."""
    if len(data) < HEADER.size + 4:
        return None
    magic, version, crc, length = HEADER.unpack_from(data)
    body = memoryview(data)[HEADER.size:]
    if magic != MAGIC or version != VERSION or length != len(body) or crc32c(body) != crc:
        return None
    (n,) = struct.unpack_from("<I", body)
    if n > MAX_IDENTITY_BYTES or 4 + n > len(body):
        return None
    try:
        identity = json.loads(bytes(body[4: 4 + n]))
    except ValueError:
        return None
    if not isinstance(identity, dict) or identity.get("token") != token \
            or identity.get("chunk") != list(cid):
        return None
    lengths = identity.get("lengths")
    if not isinstance(lengths, list) or len(lengths) > MAX_FRAMES or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in lengths) \
            or 4 + n + sum(lengths) != len(body):
        return None
    out, at = [], 4 + n
    for k in lengths:
        out.append(bytes(body[at: at + k]))
        at += k
    return out


def _why(exc: OSError) -> str:
    """``ENOSPC: No space left on device``."""
    name = errno.errorcode.get(exc.errno or 0, "") or type(exc).__name__
    return f"{name}: {exc.strerror or exc}"


def _read_pid(path: str) -> str:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        return str(int(f.read(32).strip()))
    return ""
