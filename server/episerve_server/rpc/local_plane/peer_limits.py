"""What the local plane lets one client make the daemon hold: connections, call bodies and
answers sent but not yet received.

- Connections are capped in total and per uid, and the total cap stays well under the
  descriptor limit (each connection takes its socket and up to ``--local-segments`` + 1
  memfds), so a flood of local connections never takes the descriptors the gRPC port and
  health need. A connection over a cap is answered ``Overloaded`` and closed.
- A call body is allocated as its bytes arrive and charged to the daemon's budget
  (``buffers.ResponseBuffers``) while it is received and served: a head that declares
  8 MiB and sends nothing holds 256 bytes. A body that finds no room is read into a
  buffer the plane shares and dropped, and its call answered ``Overloaded``.
- ``unread`` is what the kernel still queues for the client (``SIOCOUTQ``: bytes, and the
  memfds they carry, that the client has not received); a connection's next call waits
  until it is zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import termios
import time

from episerve_proto import local_plane as lp
from episerve_proto.errors import EpiserveError, Overloaded
from episerve_server.config import ServerConfig
from episerve_server.rpc.handlers.buffers import ResponseBuffers
from episerve_server.rpc.local_plane.conn import (
    Connection,
    ConnectionClosed,
    error_body,
    queue_bytes,
    recv_into,
)

log = logging.getLogger(__name__)

#: A call body's first piece.
BODY_CHUNK = 64 << 10
#: Its largest piece: a body's pieces grow with what has arrived, up to this.
BODY_PIECE = 1 << 20
#: Bytes asked of the socket at once: about what a unix socket's queue holds.
BODY_READ = 256 << 10
#: Descriptors kept for everything but local-plane connections (gRPC, stores, logs).
SPARE_FDS = 256
#: How often a connection whose answers are unread is looked at again, at most.
UNREAD_POLL_S = 0.05


def descriptor_cap(segments: int) -> int:
    """Connections the descriptor limit leaves room for: half of what remains over
    ``SPARE_FDS`` once each connection may hold its socket and ``segments`` + 1 memfds."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, (soft - SPARE_FDS) // (2 * (segments + 2)))


class ConnectionCaps:
    """Connections open, in total (accepted, before their credentials are known) and per
    uid (after)."""

    def __init__(self, total: int, per_uid: int) -> None:
        self.total, self.per_uid = total, per_uid
        self.open = 0
        self.by_uid: dict[int, int] = {}

    def accept(self) -> Overloaded | None:
        if self.open >= self.total:
            return Overloaded(f"the local plane has {self.open} connections open, its limit "
                              f"(--local-max-connections, within the descriptor limit); "
                              "back off and retry")
        self.open += 1
        return None

    def closed(self) -> None:
        self.open -= 1

    def join(self, uid: int) -> Overloaded | None:
        held = self.by_uid.get(uid, 0)
        if held >= self.per_uid:
            return Overloaded(f"uid {uid} has {held} local-plane connections open, the limit "
                              "(--local-max-connections-per-uid); back off and retry")
        self.by_uid[uid] = held + 1
        return None

    def leave(self, uid: int) -> None:
        left = self.by_uid.get(uid, 0) - 1
        if left > 0:
            self.by_uid[uid] = left
        else:
            self.by_uid.pop(uid, None)


def unread(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not received yet (0 once closed)."""
    return queue_bytes(sock, termios.TIOCOUTQ)


async def received(conn: Connection) -> None:
    """Returns once the peer has received everything sent on the connection."""
    pause = 0.001
    while unread(conn.sock):
        if conn.closing:
            raise ConnectionClosed("closed while its answers were unread")
        await asyncio.sleep(pause)
        pause = min(UNREAD_POLL_S, pause * 2)


def refuse(sock: socket.socket, error: EpiserveError) -> None:
    """Answer a connection with its error, if its buffer takes it; close it."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(lp.frame(lp.ERROR, 0, error_body(error)))
    sock.close()


class Keeper:
    """A plane's bookkeeping of its connections: the caps, idle ones closed, and kept
    segments charged to the budget until their client has received them (after its
    connection closed too: then its socket is kept, shut down, until its queue is empty)."""

    def __init__(self, config: ServerConfig, budget: ResponseBuffers) -> None:
        self.caps = ConnectionCaps(
            min(config.local_max_connections, descriptor_cap(config.local_segments)),
            config.local_max_connections_per_uid)
        self.budget, self.idle_s = budget, config.local_idle_s
        self.draining: set[Connection] = set()

    def sent_kept(self, conn: Connection, nbytes: int) -> None:
        conn.kept += nbytes
        self.budget.charge(nbytes)

    def kept_received(self, conn: Connection) -> None:
        if conn.kept and not unread(conn.sock):
            self.budget.charge(-conn.kept)
            conn.kept = 0

    def reclaim(self, connections: set[Connection]) -> None:
        """The budget is short: uncount every kept segment its client has received. (A
        connection's are otherwise looked at when it next calls, and a DataLoader worker
        waiting for its next indices may not call for a while.)"""
        for conn in (*connections, *self.draining):
            self.kept_received(conn)

    def ended(self, conn: Connection) -> None:
        """The connection's calls and segments are done: close its socket, or keep it till
        its peer has the kept segments still queued in it."""
        self.kept_received(conn)
        if not conn.kept:
            conn.sock.close()
            return
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        self.draining.add(conn)

    async def sweep(self, connections: set[Connection]) -> None:
        """Forever: closes idle connections; uncounts what closed ones' peers received."""
        idle = self.idle_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4) if idle else 1.0)
            now = time.monotonic()
            for conn in list(connections):
                if idle and not conn.tasks and now - conn.active > idle and not conn.closing:
                    log.info("local plane: closing %s, idle for %.0fs (--local-idle-s)",
                             conn.peer, now - conn.active)
                    conn.closing = True
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
            for conn in list(self.draining):
                self.kept_received(conn)
                if not conn.kept:
                    self.draining.discard(conn)
                    conn.sock.close()

    def stop(self) -> None:
        for conn in self.draining:
            self.budget.charge(-conn.kept)
            conn.kept = 0
            conn.sock.close()
        self.draining.clear()


#: A body's first receive, before its first piece is allocated (a head alone holds this).
FIRST_READ = 256
#: Where a dropped body's bytes are read (and forgotten): one buffer for every connection,
#: allocated once, so a body refused for the budget makes the daemon allocate nothing.
#: (Only for bytes never looked at: a receive completes in the loop's callback, and another
#: connection's receive may fill the buffer before the coroutine that asked resumes.)
_DROPPED = memoryview(bytearray(BODY_READ))


async def recv_call(sock: socket.socket, n: int, buffers: ResponseBuffers,
                    what: str) -> tuple[str, bytes, int] | None:
    """A CALL body of ``n`` bytes: its method, its request bytes and the bytes still
    charged to ``buffers`` for them (the caller discharges them once served), or None when
    the budget had no room (the body was read and dropped).

    Every allocation is charged before it is made, at its full size: each piece the body
    is received into (from ``BODY_CHUNK``, growing with what has arrived, to
    ``BODY_PIECE``, up to ``BODY_READ`` per receive), and the request bytes joined from
    them once the body is whole (the method name is cut off in that join, not by a second
    copy). The first piece is allocated once the first bytes (at most ``FIRST_READ``)
    have arrived. A body that finds no room is read into one shared buffer and dropped.

    A body of at most ``BODY_CHUNK`` is first received at once into another shared buffer
    (no allocation, no wait): when it has wholly arrived, as it usually has (a client sends
    a call's head and body together), only its request bytes are allocated, charged first;
    otherwise what came is the start of the first piece."""
    pre = 0
    if n <= BODY_CHUNK:
        pre = _recv_now(sock, _WHOLE[:n])
        if pre == n:
            method, skip = _method(_WHOLE[:n])
            if not _charge(buffers, n - skip, what):
                return None
            return method, bytes(_WHOLE[skip:n]), n - skip
    pieces: list[memoryview] = []
    charged = got = filled = 0
    piece = _DROPPED[:0]
    try:
        while got < n:
            if filled == len(piece):  # full: the next piece, sized by what has arrived
                size = min(n - got, BODY_CHUNK if not got else min(got, BODY_PIECE))
                early, first = 0, memoryview(b"")
                if pre:  # received at once: copied out below, before anything waits
                    early, first, pre = pre, _WHOLE, 0
                elif not got:  # the first bytes first: a head alone allocates next to nothing
                    first = memoryview(bytearray(min(size, FIRST_READ)))
                    early = await _recv(sock, first)
                if charged < 0 or not _charge(buffers, size, what):
                    buffers.charge(-max(charged, 0))
                    pieces, charged = [], -1  # no room: drop the rest
                    piece = _DROPPED[:min(n - got, BODY_READ)]
                else:
                    charged += size
                    piece = memoryview(bytearray(size))
                    piece[:early] = first[:early]
                    pieces.append(piece)
                got, filled = got + early, early
                if filled == len(piece):  # the first bytes filled it
                    continue
            k = await _recv(sock, piece[filled:filled + BODY_READ])
            got += k
            filled += k
        if charged < 0:
            return None
        method, skip = _method(pieces[0] if pieces else _DROPPED[:0])
        if not _charge(buffers, n - skip, what):  # the joined copy, before it is made
            return None  # (the pieces are discharged below)
        request = b"".join([pieces[0][skip:], *pieces[1:]])
        return method, request, n - skip
    finally:
        pieces.clear()
        buffers.charge(-max(charged, 0))  # the pieces are freed


#: Where a small body is received at once (``recv_call``): its bytes are copied out
#: before the coroutine waits for anything, so one buffer serves every connection.
_WHOLE = memoryview(bytearray(BODY_CHUNK))


def _recv_now(sock: socket.socket, into: memoryview) -> int:
    """What has arrived, without waiting (0: nothing yet, or the peer closed: the next
    receive that waits tells which)."""
    try:
        return sock.recv_into(into)
    except BlockingIOError:
        return 0


async def _recv(sock: socket.socket, into: memoryview) -> int:
    k = await recv_into(sock, into)
    if k == 0:
        raise ConnectionClosed("the peer closed the connection mid-frame")
    return k


def _charge(buffers: ResponseBuffers, nbytes: int, what: str) -> bool:
    try:
        buffers.room(nbytes, what)
    except Overloaded:
        return False
    buffers.charge(nbytes)
    return True


def _method(first: memoryview) -> tuple[str, int]:
    """A CALL body's method (from its first piece, which holds the name whole) and where
    its request bytes start."""
    n = first[0] if len(first) else 0
    method, _ = lp.parse_call(bytes(first[:1 + n]))
    return method, 1 + n
