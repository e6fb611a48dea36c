"""The local plane: Reads for clients on this host over a unix socket and shared memory.

The daemon listens on ``<--unix PATH>.local`` (``--no-local-plane`` turns it off). A
connection is accepted only from a process of an allowed uid (``SO_PEERCRED``: the
daemon's own, or ``--local-uids``), and its first frame must carry the daemon's token when
it has one. A Read's request bytes are those of the gRPC path and go through the same
``EpiserveService.serve_read`` (admission, parsing, the planner, hints, counters); only the
encoding differs: the batch's blobs are written once, by the daemon, into a segment, and the
answer is the metadata and a table of offsets (``episerve_proto.local``). The other methods
run the gRPC handlers themselves, so every error is the same class, code and trailers.

Segments are memfds (no name in any filesystem), sealed against shrinking, lent from a
pool per connection: at most ``--local-segments`` at once. The client returns a segment
(RELEASE) once nothing of its process refers to it; until then the daemon never writes it.
When every segment is lent the next Read waits for a return (backpressure), up to
``LEND_WAIT_S``, then answers ``Overloaded``. A connection that closes (a client that
exits or is killed) frees all its segments at once: the daemon closes its descriptors and
mappings, and the kernel frees the memory when the client's mappings are gone too.

A Read may instead ask to keep its segment (``FLAG_KEEP``): the daemon makes a segment
for that batch alone, sends the descriptor, closes its own side and forgets it; from then
on it belongs to the client's processes (torch passes it on to the main process).
DataLoader workers ask for this, and so does a client that still refers to every pooled
segment. The daemon holds such a segment only while it writes and sends it, at most one
per call in flight on the connection (``--local-segments`` + 1).

One job, the local plane's transport (frames, credentials, segments), hence its length.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from episerve_proto import local as lp
from episerve_proto.contract import EPISODE_TRAILER, ERROR_TRAILER, KEY_TRAILER, SERVICE_PATH
from episerve_proto.errors import (
    EpiserveError,
    PermissionDenied,
    ResponseTooLarge,
    Unauthenticated,
    clipped,
)
from episerve_server.config import ServerConfig
from episerve_server.core.result import BatchResult
from episerve_server.preflight import MAX_UNIX_PATH_BYTES, bind_private_socket
from episerve_server.rpc.handlers.segments import Segment, SegmentArena, SegmentPool
from episerve_server.rpc.handlers.service import OFFLOAD_ENCODE_BYTES, EpiserveService
from episerve_server.rpc.handlers.status import answered
from episerve_server.rpc.wire import encode

log = logging.getLogger(__name__)


class CallLog(Protocol):
    """Where a finished call is accounted (the gRPC server's logging interceptor)."""

    def finished(self, method: str, code: str, seconds: float, request: Any, *, rid: str,
                 peer: Callable[[], str], sent: int) -> None: ...

#: A connection must send its HELLO within this.
HELLO_S = 10.0
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def local_path(unix: str) -> Path:
    return Path(str(Path(unix).resolve()) + lp.LOCAL_SUFFIX)


class ConnectionClosed(Exception):
    pass


class LocalContext:
    """What the gRPC handlers use of their context, for a call over the local plane: the
    peer's name, and ``abort``, which raises the error's code, message and trailers."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: Any, message: str,
                    trailers: Sequence[tuple[str, str | bytes]]) -> None:
        raise Aborted(str(code.name), message, dict(trailers))


class Aborted(Exception):
    def __init__(self, code: str, message: str, trailers: dict[str, str | bytes]) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass(eq=False)
class Placed:
    segment: Segment
    blobs: list[tuple[int, int]]
    meta: bytes


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    peer: str
    pool: SegmentPool
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    serial: int = 0  # this plane's count of connections: names its calls in the logs
    last_total: int = 0  # the bytes of its latest answer: what the next one's segment takes


class LocalPlane:
    def __init__(self, config: ServerConfig, service: EpiserveService, path: Path,
                 sock: socket.socket) -> None:
        self.config, self.service, self.path, self._sock = config, service, path, sock
        self._inode = os.stat(path).st_ino
        self.uids = {os.getuid(), *(int(u) for u in config.local_uids)}
        self.connections: set[Connection] = set()
        self.segments = self.segment_bytes = 0
        self.refused = 0
        # Bytes of answers gathered straight into their segment, and bytes copied into one.
        self.gathered_bytes = self.copied_bytes = 0
        self._accept: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._serials = itertools.count(1)
        #: Accounts each finished call as the gRPC server's interceptor does (metrics, the
        #: DEBUG line, the INFO summary); set by the daemon.
        self.calls: CallLog | None = None
        service.gauges.append(self.counters)

    @classmethod
    async def start(cls, config: ServerConfig, service: EpiserveService) -> LocalPlane | None:
        """Listen beside ``--unix``; None (with a warning) when that path would be too long
        for a socket address: clients then read over gRPC."""
        path = local_path(config.unix)
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            log.warning("local plane off: %r is longer than the %d bytes of a unix socket "
                        "address (choose a shorter --unix path to have it)", str(path),
                        MAX_UNIX_PATH_BYTES)
            return None
        plane = cls(config, service, path, bind_private_socket(path, "--unix (local plane)"))
        plane._accept = asyncio.create_task(plane._accept_loop())
        return plane

    @property
    def address(self) -> str:
        return str(self.path)

    def counters(self) -> dict[str, int]:
        return {"local_connections": len(self.connections), "local_segments": self.segments,
                "local_segment_bytes": self.segment_bytes, "local_refused": self.refused,
                "local_gathered_bytes": self.gathered_bytes,
                "local_copied_bytes": self.copied_bytes}

    def _changed(self, segments: int, nbytes: int) -> None:
        self.segments += segments
        self.segment_bytes += nbytes

    async def stop(self) -> None:
        """Stop accepting, close every connection (their segments with them), unlink the
        socket if it is still ours."""
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        self._sock.close()
        for task in list(self._serving):
            task.cancel()
        for task in list(self._serving):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors, say: keep serving the others
                log.warning("local plane: accept failed (%s)", exc.strerror)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(sock))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _CRED.size))
        conn = Connection(sock, f"local:{pid}", SegmentPool(self.config.local_segments,
                                                            self._changed),
                          serial=next(self._serials))
        try:
            if uid not in self.uids:
                self.refused += 1
                raise PermissionDenied(f"uid {uid} may not use the local plane (allowed: "
                                       f"{sorted(self.uids)}; see --local-uids)")
            await asyncio.wait_for(self._hello(conn), HELLO_S)
            self.connections.add(conn)
            await self._frames(conn)
        except EpiserveError as exc:
            with contextlib.suppress(OSError, ConnectionClosed):
                await self._send_error(conn, 0, exc)
        except (ConnectionClosed, OSError, TimeoutError, lp.FrameError) as exc:
            log.debug("local plane: connection of %s ends (%s)", conn.peer, exc)
        finally:
            self.connections.discard(conn)
            for task in list(conn.tasks):
                task.cancel()
            await conn.pool.close()
            sock.close()

    async def _hello(self, conn: Connection) -> None:
        head, body = await _recv_frame(conn.sock, lp.MAX_TOKEN_BYTES)
        if head.kind != lp.HELLO:
            raise lp.FrameError("the first frame must be HELLO")
        if self.config.token and not hmac.compare_digest(body, self.config.token.encode()):
            self.refused += 1
            raise Unauthenticated("missing or wrong token for the local plane")
        await self._send(conn, lp.frame(lp.WELCOME, conn.pool.limit))

    async def _frames(self, conn: Connection) -> None:
        calls = asyncio.Semaphore(conn.pool.limit + 1)  # a connection's calls in flight
        while True:
            head, body = await _recv_frame(conn.sock, lp.MAX_CALL_BODY)
            if head.kind == lp.RELEASE:
                await conn.pool.give_back(head.ident)
            elif head.kind == lp.CALL:
                method, payload = lp.parse_call(body)
                if head.flags & lp.FLAG_KEEP and method != "Read":
                    raise lp.FrameError(f"a {method} call cannot keep a segment")
                await calls.acquire()
                task = asyncio.create_task(self._call(conn, head.ident, method, payload,
                                                      bool(head.flags & lp.FLAG_KEEP)))
                conn.tasks.add(task)

                def done(t: asyncio.Task[None]) -> None:
                    conn.tasks.discard(t)
                    calls.release()

                task.add_done_callback(done)
            else:
                raise lp.FrameError(f"unexpected frame kind {head.kind} after HELLO")

    async def _call(self, conn: Connection, ident: int, method: str, payload: bytes,
                    keep: bool = False) -> None:
        start, code, sent = time.perf_counter(), "OK", 0
        try:
            if method == "Read":
                code, sent = await self._read(conn, ident, payload, keep)
                return
            handler = self.service.handlers_by_name()[method]
            data = await handler(payload, cast(Any, LocalContext(conn.peer)))
            sent = len(data)
            await self._send(conn, lp.frame(lp.REPLY, ident, data))
        except Aborted as exc:
            t = exc.trailers
            code = exc.code
            body = lp.error_body(exc.code, _text(t.get(ERROR_TRAILER, "")), exc.message,
                                 _text(t.get(EPISODE_TRAILER, b"")),
                                 _text(t.get(KEY_TRAILER, b"")))
            await self._send_quietly(conn, lp.frame(lp.ERROR, ident, body))
        except (OSError, ConnectionClosed):
            code = "CANCELLED"  # the connection is gone; _serve frees what it held
        except Exception as exc:
            error = answered(exc, f"{method} (local plane)")
            code = error.code
            await self._send_quietly(conn, lp.frame(lp.ERROR, ident, _error_body(error)))
        finally:
            if self.calls is not None:
                self.calls.finished(SERVICE_PATH + method, code, time.perf_counter() - start,
                                    payload, rid=f"local-{conn.serial}-{ident}",
                                    peer=lambda: conn.peer, sent=sent)

    async def _read(self, conn: Connection, ident: int, payload: bytes,
                    keep: bool) -> tuple[str, int]:
        """Serves one Read; returns its status code's name and the bytes it sent."""
        arena = SegmentArena(conn.pool, keep, conn.last_total)
        try:
            placed = await self.service.serve_read(
                payload, conn.peer, lambda r: self._place(conn, r, arena), arena)
        except Exception as exc:
            await arena.release()
            error = answered(exc, "read (local plane)")
            await self._send_quietly(conn, lp.frame(lp.ERROR, ident, _error_body(error)))
            return error.code, 0
        except BaseException:
            await arena.release()
            raise
        seg = placed.segment
        body = lp.batch_body(seg.ident, seg.size, placed.blobs, placed.meta)
        with_fd = keep or not seg.sent
        try:
            await self._send(conn, lp.frame(lp.BATCH, ident, body, lp.FLAG_FD if with_fd else 0),
                             (seg.fd,) if with_fd else ())
            seg.sent = True
        except BaseException:
            await conn.pool.give_back(seg.ident)
            raise
        if keep:
            await conn.pool.give_away(seg.ident)
        return "OK", len(body) + sum(size for _, size in placed.blobs)

    async def _place(self, conn: Connection, result: BatchResult,
                     arena: SegmentArena) -> tuple[Placed, int]:
        """The batch's blobs in the segment of ``arena``: its numeric outputs are there
        already (gathered into it), the rest (frames, indexes, masks) is written after them.
        An answer that does not fit its arena's segment is written whole into one of its
        size: the gathered arrays are then copied a second time."""
        blobs: list[encode.Buf] = []
        meta = encode.encode_result(result, blobs.append)
        if len(meta) + len(blobs) * lp.BLOB.size + 64 > lp.MAX_ANSWER_BODY:
            raise ResponseTooLarge(f"the batch's metadata takes {len(meta)} bytes, over the "
                                   f"local plane's limit of {lp.MAX_ANSWER_BODY}; split the "
                                   "batch")
        sizes = [memoryview(b).nbytes for b in blobs]
        at: list[int | None] = [arena.offset_of(memoryview(b), n) for b, n in zip(blobs, sizes)]
        rest = [k for k, off in enumerate(at) if off is None]
        after, rest_bytes = lp.layout([sizes[k] for k in rest])
        total = arena.used + rest_bytes
        seg = arena.segment
        if seg is None or total > seg.size:  # write it all into a segment of its size
            blobs = [b if off is None else bytes(b) for b, off in zip(blobs, at)]
            await arena.release()
            at, rest = [None] * len(blobs), list(range(len(blobs)))
            after, total = lp.layout(sizes)
            seg = await conn.pool.acquire(max(total, 1), keep=arena.keep)
            arena.segment, arena.used = seg, 0
        for k, off in zip(rest, after, strict=True):
            at[k] = arena.used + off
        offsets = [int(off) for off in at if off is not None]
        copied = [(offsets[k], blobs[k]) for k in rest]
        try:
            if sum(sizes[k] for k in rest) >= OFFLOAD_ENCODE_BYTES:
                await asyncio.to_thread(_copy, seg.view, copied)
            else:
                _copy(seg.view, copied)
        except BaseException:
            await arena.release()
            raise
        self.copied_bytes += sum(sizes[k] for k in rest)
        self.gathered_bytes += sum(sizes) - sum(sizes[k] for k in rest)
        conn.last_total = total
        await self._retired(conn)
        return Placed(seg, list(zip(offsets, sizes, strict=True)), meta), total

    async def _retired(self, conn: Connection) -> None:
        while conn.pool.retired:
            await self._send(conn, lp.frame(lp.RETIRE, conn.pool.retired.pop()))

    async def _send_error(self, conn: Connection, ident: int, error: EpiserveError) -> None:
        await self._send(conn, lp.frame(lp.ERROR, ident, _error_body(error)))

    async def _send_quietly(self, conn: Connection, data: bytes) -> None:
        with contextlib.suppress(OSError, ConnectionClosed):
            await self._send(conn, data)

    async def _send(self, conn: Connection, data: bytes, fds: Sequence[int] = ()) -> None:
        loop = asyncio.get_running_loop()
        async with conn.send_lock:
            view = memoryview(data)
            if fds:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                while True:
                    try:
                        sent = conn.sock.sendmsg([view], rights)
                        break
                    except BlockingIOError:
                        await _writable(loop, conn.sock)
                view = view[sent:]
            if view:
                await loop.sock_sendall(conn.sock, view)


def _error_body(error: EpiserveError) -> bytes:
    return lp.error_body(error.code, type(error).__name__, clipped(error.message),
                         clipped(error.episode, 1024), clipped(error.key, 1024))


def _copy(dst: np.ndarray, blobs: list[tuple[int, encode.Buf]]) -> None:
    for off, blob in blobs:
        src = np.frombuffer(blob, np.uint8)
        dst[off:off + src.size] = src


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_writer(sock.fileno())


async def _recv_exact(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionClosed("the peer closed the connection")
        got += k
    return bytes(buf)


async def _recv_frame(sock: socket.socket, max_body: int) -> tuple[lp.Head, bytes]:
    head = lp.parse_head(await _recv_exact(sock, lp.HEAD_BYTES), lp.TO_DAEMON, max_body)
    if head.flags & lp.FLAG_FD:
        raise lp.FrameError("a client does not send descriptors")
    body = await _recv_exact(sock, head.length) if head.length else b""
    return head, body
