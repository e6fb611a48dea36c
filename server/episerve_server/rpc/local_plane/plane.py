"""The local plane: Reads for clients on this host over a unix socket and shared memory.

The daemon listens on ``<--unix PATH>.local`` (``--no-local-plane`` turns it off). A
connection is accepted only from a process of an allowed uid (``SO_PEERCRED``: the
daemon's own, or ``--local-uids``), and its first frame must carry the daemon's token when
it has one. Every call runs the same handler as over gRPC, with the same request bytes;
only the writer of a batch differs (``SegmentWriter``, the call's ``AnswerWriter``): the
batch's blobs are written once, by the daemon, into a segment, and the answer is the
metadata and a table of offsets (``episerve_proto.local_plane``). A handler's error is
answered in an ERROR frame with the class, code, episode and key gRPC gives in its status
and trailers.

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
segment.

What a connection makes the daemon hold counts in the daemon's one budget
(``--max-buffered-bytes``, shared with gRPC's unsent responses, ``buffers.py``): its call
bodies as their bytes arrive, every segment of its pool, and a kept segment from its
making until the client has received it (``peer_limits.unread``). A segment or body with
no room is answered ``Overloaded``. A connection's calls are served one at a time, and the
next only once the client has received every earlier answer. Connections are capped in
total and per uid (``peer_limits.ConnectionCaps``), and one that stays idle for
``--local-idle-s`` is closed; one closed with answers still unread keeps them counted until
its peer reads or closes.

Here: listening, connections and their calls. A batch is laid out by ``segment_answer``;
frames go through ``conn``; limits and caps are ``peer_limits``'; segments ``segments``'.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from episerve_proto import local_plane as lp
from episerve_proto.contract import SERVICE_PATH
from episerve_proto.errors import (
    EpiserveError,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
)
from episerve_server.config import ServerConfig
from episerve_server.core.result import BatchResult
from episerve_server.preflight import MAX_UNIX_PATH_BYTES, bind_private_socket
from episerve_server.rpc.handlers.service import EpiserveService
from episerve_server.rpc.handlers.status import answered
from episerve_server.rpc.local_plane import peer_limits
from episerve_server.rpc.local_plane.conn import (
    CallLog,
    Connection,
    ConnectionClosed,
    LocalCall,
    error_body,
    queued,
    recv_exact,
    recv_head,
    send,
)
from episerve_server.rpc.local_plane.segment_answer import Placed, place
from episerve_server.rpc.local_plane.segments import SegmentArena, SegmentPool

log = logging.getLogger(__name__)


#: A client holds at most this fraction of the budget in lent segments (WELCOME says).
LEND_SHARE = 4
#: A connection's frame loop yields to the others after this many frames: its receives
#: do not wait while its bytes keep arriving (``conn.recv_into``), so a client streaming
#: RELEASE frames would otherwise hold the loop.
FAIR_FRAMES = 8
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def local_path(unix: str) -> Path:
    return Path(str(Path(unix).resolve()) + lp.LOCAL_SUFFIX)


class SegmentWriter:
    """The local plane's ``AnswerWriter``: a batch's numeric outputs gathered into the
    segment its answer is sent in, the rest laid out after them (``segment_answer``)."""

    def __init__(self, plane: LocalPlane, conn: Connection, keep: bool) -> None:
        self.arena = SegmentArena(conn.pool, keep, conn.last_total)
        self._plane, self._conn = plane, conn

    async def write(self, result: BatchResult) -> tuple[Placed, int]:
        return await self._plane._place(self._conn, result, self.arena)


class LocalPlane:
    def __init__(self, config: ServerConfig, service: EpiserveService, path: Path,
                 sock: socket.socket) -> None:
        self.config, self.service, self.path, self._sock = config, service, path, sock
        self._methods = service.methods()
        self._inode = os.stat(path).st_ino
        self.uids = {os.getuid(), *(int(u) for u in config.local_uids)}
        self.connections: set[Connection] = set()
        self.segments = self.segment_bytes = 0
        self.segments_made = 0  # every memfd segment made, pooled or kept by its client
        self.refused = 0
        # Bytes of answers gathered straight into their segment, and bytes copied into one.
        self.gathered_bytes = self.copied_bytes = 0
        self._accept: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._serials = itertools.count(1)
        self.budget = service.buffers
        self.budget.reclaim.append(self._reclaim)
        self.keeper = peer_limits.Keeper(config, self.budget)
        self.caps = self.keeper.caps
        self._sweep: asyncio.Task[None] | None = None
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
        if config.local_uids:  # other uids must reach the socket; SO_PEERCRED picks them
            os.chmod(path, 0o666)
        plane._accept = asyncio.create_task(plane._accept_loop())
        plane._sweep = asyncio.create_task(plane.keeper.sweep(plane.connections))
        return plane

    @property
    def address(self) -> str:
        return str(self.path)

    def counters(self) -> dict[str, int]:
        return {"local_connections": len(self.connections), "local_segments": self.segments,
                "local_segment_bytes": self.segment_bytes, "local_refused": self.refused,
                "local_gathered_bytes": self.gathered_bytes,
                "local_copied_bytes": self.copied_bytes,
                "local_segments_made": self.segments_made}

    def _changed(self, segments: int, nbytes: int) -> None:
        self.segments += segments
        self.segments_made += max(0, segments)
        self.segment_bytes += nbytes
        self.budget.charge(nbytes)

    def _room(self, nbytes: int) -> None:
        self.budget.room(nbytes, "a shared-memory segment")

    def _reclaim(self) -> None:
        """The budget is short: close the segments free in every connection's pool (their
        clients are told to unmap them with the next answer), and stop counting the kept
        segments their clients have received."""
        for conn in self.connections:
            conn.pool.drop_free()
        self.keeper.reclaim(self.connections)

    async def stop(self) -> None:
        """Stop accepting, close every connection (their segments with them), unlink the
        socket if it is still ours."""
        for task in (self._accept, self._sweep):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sock.close()
        for task in list(self._serving):
            task.cancel()
        for task in list(self._serving):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.keeper.stop()
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
            refused = self.caps.accept()
            if refused is not None:
                self.refused += 1
                peer_limits.refuse(sock, refused)
                continue
            task = asyncio.create_task(self._serve(sock))
            task.add_done_callback(lambda _: self.caps.closed())
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _CRED.size))
        conn = Connection(sock, f"local:{pid}", SegmentPool(self.config.local_segments,
                                                            self._changed, self._room),
                          serial=next(self._serials))
        joined = False
        try:
            if uid not in self.uids:
                self.refused += 1
                raise PermissionDenied(f"uid {uid} may not use the local plane (allowed: "
                                       f"{sorted(self.uids)}; see --local-uids)")
            over = self.caps.join(uid)
            if over is not None:
                self.refused += 1
                raise over
            joined = True
            await asyncio.wait_for(self._hello(conn), self.config.local_hello_s)
            self.connections.add(conn)
            await self._frames(conn)
        except EpiserveError as exc:
            with contextlib.suppress(OSError, ConnectionClosed):
                await self._send_error(conn, 0, exc)
        except (ConnectionClosed, OSError, TimeoutError, lp.FrameError) as exc:
            log.debug("local plane: connection of %s ends (%s)", conn.peer, exc)
        finally:
            if joined:
                self.caps.leave(uid)
            self.connections.discard(conn)
            for task in list(conn.tasks):
                task.cancel()
            # Its calls end before its socket closes (a send waiting for room unhooks its
            # descriptor from the loop while it is still open).
            await asyncio.gather(*conn.tasks, return_exceptions=True)
            await conn.pool.close()
            self.keeper.ended(conn)

    async def _hello(self, conn: Connection) -> None:
        head = await recv_head(conn.sock, lp.MAX_TOKEN_BYTES)
        body = await recv_exact(conn.sock, head.length) if head.length else b""
        if head.kind != lp.HELLO:
            raise lp.FrameError("the first frame must be HELLO")
        if self.config.token and not hmac.compare_digest(body, self.config.token.encode()):
            self.refused += 1
            raise Unauthenticated("missing or wrong token for the local plane")
        # What its lent segments may take: a quarter of the budget (it keeps the rest).
        lend = lp.LEND.pack(self.budget.max_bytes // LEND_SHARE)
        await self._send(conn, lp.frame(lp.WELCOME, conn.pool.limit, lend))

    async def _frames(self, conn: Connection) -> None:
        for count in itertools.count(1):
            if count % FAIR_FRAMES == 0:
                await asyncio.sleep(0)
            head = await recv_head(conn.sock, lp.MAX_CALL_BODY)
            conn.active = time.monotonic()
            at = conn.consumed
            conn.consumed += lp.HEAD_BYTES  # a body counts once it is read
            if head.kind == lp.RELEASE:
                if head.length:
                    raise lp.FrameError("a RELEASE frame has no body")
                await conn.pool.give_back(head.ident, at)
            elif head.kind == lp.CALL:
                # One call at a time, and only once every earlier answer is received.
                if conn.tasks:
                    await asyncio.wait(set(conn.tasks))
                await peer_limits.received(conn)
                self.keeper.kept_received(conn)
                try:
                    call = await peer_limits.recv_call(conn.sock, head.length, self.budget,
                                                 "a call body")
                finally:
                    conn.consumed += head.length
                if call is None:
                    await self._send_error(conn, head.ident, Overloaded(
                        f"no room for a call body of {head.length} bytes: the daemon holds "
                        f"{self.budget.total} bytes for its clients, its limit is "
                        f"{self.budget.max_bytes} (--max-buffered-bytes); back off and retry"))
                    continue
                method, payload, charged = call
                task = asyncio.create_task(self._call(conn, head.ident, method, payload,
                                                      bool(head.flags & lp.FLAG_KEEP)))
                conn.tasks.add(task)

                def done(t: asyncio.Task[None], charged: int = charged) -> None:
                    conn.tasks.discard(t)
                    self.budget.charge(-charged)
                    conn.active = time.monotonic()

                task.add_done_callback(done)
            else:
                raise lp.FrameError(f"unexpected frame kind {head.kind} after HELLO")

    async def _call(self, conn: Connection, ident: int, method: str, payload: bytes,
                    keep: bool = False) -> None:
        """Serves one call: its handler's answer is bytes (a REPLY) or a batch the
        connection's writer placed in a segment (a BATCH)."""
        start, code, sent = time.perf_counter(), "OK", 0
        writer = SegmentWriter(self, conn, keep)
        try:
            try:
                answer = await self._methods[method](payload, LocalCall(conn.peer, writer))
            except Exception as exc:  # the handler's: answered, whatever it is (an OSError too)
                await writer.arena.release()
                error = answered(exc, f"{method} (local plane)")
                code = error.code
                await self._send_quietly(conn, lp.frame(lp.ERROR, ident, error_body(error)))
                return
            except BaseException:
                await writer.arena.release()
                raise
            if isinstance(answer, Placed):
                sent = await self._send_batch(conn, ident, answer, keep)
            else:
                sent = len(answer)
                await self._send(conn, lp.frame(lp.REPLY, ident, answer))
        except (OSError, ConnectionClosed):
            code = "CANCELLED"  # the connection is gone; _serve frees what it held
        except Exception as exc:  # sending failed for another reason: still answered
            error = answered(exc, f"{method} (local plane)")
            code = error.code
            await self._send_quietly(conn, lp.frame(lp.ERROR, ident, error_body(error)))
        finally:
            if self.calls is not None:
                self.calls.finished(SERVICE_PATH + method, code, time.perf_counter() - start,
                                    payload, rid=f"local-{conn.serial}-{ident}",
                                    peer=lambda: conn.peer, sent=sent)

    async def _send_batch(self, conn: Connection, ident: int, placed: Placed,
                          keep: bool) -> int:
        """Sends a placed batch (its descriptor too, the first time or when the client
        keeps it); returns the bytes it sent."""
        seg = placed.segment
        body = lp.batch_body(seg.ident, seg.size, placed.blobs, placed.meta)
        with_fd = keep or not seg.sent
        try:
            # What the client sent before this answer could reach it: a RELEASE in there
            # is of an earlier lending of this segment (measured before the send, so a
            # release sent once the client has the answer is never mistaken for one).
            fence = conn.consumed + queued(conn.sock)
            await self._send(conn, lp.frame(lp.BATCH, ident, body, lp.FLAG_FD if with_fd else 0),
                             (seg.fd,) if with_fd else ())
            conn.pool.sent_out(seg, fence)
        except BaseException:
            await conn.pool.put_back(seg.ident)
            raise
        if keep:  # counted (as the pool's) until the client has it
            self.keeper.sent_kept(conn, seg.size)
            await conn.pool.give_away(seg.ident)
        return len(body) + placed.nbytes

    async def _place(self, conn: Connection, result: BatchResult,
                     arena: SegmentArena) -> tuple[Placed, int]:
        placed, total, copied = await place(conn, result, arena)
        self.copied_bytes += copied
        self.gathered_bytes += placed.nbytes - copied
        await self._retired(conn)
        return placed, total

    async def _retired(self, conn: Connection) -> None:
        while conn.pool.retired:
            await self._send(conn, lp.frame(lp.RETIRE, conn.pool.retired.pop()))

    async def _send_error(self, conn: Connection, ident: int, error: EpiserveError) -> None:
        await self._send(conn, lp.frame(lp.ERROR, ident, error_body(error)))

    async def _send_quietly(self, conn: Connection, data: bytes) -> None:
        with contextlib.suppress(OSError, ConnectionClosed):
            await self._send(conn, data)

    async def _send(self, conn: Connection, data: bytes, fds: Sequence[int] = ()) -> None:
        await send(conn, data, fds)
