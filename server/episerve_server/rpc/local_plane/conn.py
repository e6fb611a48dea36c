"""The local plane's frame I/O: a connection's state, sending a frame whole (with its
descriptor), receiving a head or an exact count of bytes, and what a handler is told of a
call that came over the plane."""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from episerve_proto import local_plane as lp
from episerve_proto.errors import EpiserveError, clipped
from episerve_server.rpc.handlers.servicer import AnswerWriter
from episerve_server.rpc.local_plane.segments import SegmentPool


class ConnectionClosed(Exception):
    pass


class CallLog(Protocol):
    """Where a finished call is accounted (the gRPC server's logging interceptor)."""

    def finished(self, method: str, code: str, seconds: float, request: Any, *, rid: str,
                 peer: Callable[[], str], sent: int) -> None: ...


class LocalCall:
    """What a handler knows of a call over the local plane (``handlers/servicer.Call``):
    its peer, and the writer that places a batch in a segment; a local call has no
    deadline of its own."""

    __slots__ = ("_peer", "writer")

    def __init__(self, peer: str, writer: AnswerWriter) -> None:
        self._peer, self.writer = peer, writer

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    peer: str
    pool: SegmentPool
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    serial: int = 0  # this plane's count of connections: names its calls in the logs
    last_total: int = 0  # the bytes of its latest answer: what the next one's segment takes
    active: float = field(default_factory=time.monotonic)  # when a frame last came
    kept: int = 0  # bytes of kept segments sent, charged until the client has them
    closing: bool = False  # closed for idleness: stop waiting for its peer
    consumed: int = 0  # bytes of the client's frames read so far (a body once whole)


def queue_bytes(sock: socket.socket, request: int) -> int:
    """A socket queue's byte count by ``ioctl`` (``FIONREAD``: received and not read;
    ``TIOCOUTQ``: sent and not yet received by the peer); 0 once the socket is closed."""
    if sock.fileno() < 0:
        return 0
    raw = fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0")
    n: int = struct.unpack("i", raw)[0]
    return n


def queued(sock: socket.socket) -> int:
    """Bytes the peer has sent on ``sock`` that are not read yet (0 once closed)."""
    return queue_bytes(sock, termios.FIONREAD)


async def send(conn: Connection, data: bytes, fds: Sequence[int] = ()) -> None:
    """``data`` (and ``fds`` with its first bytes) on the connection, whole, under the
    connection's send lock (frames never interleave). The socket takes what it can at once
    (a unix socket's queue usually takes all of it); only a rest waits for room."""
    async with conn.send_lock:
        rest = _sent_now(conn, data, fds)
        if rest:
            await asyncio.get_running_loop().sock_sendall(conn.sock, rest)


def _sent_now(conn: Connection, data: bytes, fds: Sequence[int]) -> memoryview:
    """What of ``data`` the socket takes now, without waiting; returns the rest."""
    view = memoryview(data)
    if fds:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        try:
            sent = conn.sock.sendmsg([view], rights)
        except BlockingIOError as exc:
            # Never waited for: a call is served only once the client has received
            # every earlier answer, so the queue is empty here and a unix stream
            # socket takes part of the frame (a wait here, cancelled by a stop, was
            # uvloop's remove_writer on a closed socket).
            raise RuntimeError(f"{conn.peer}: a descriptor met a full socket queue, "
                               "with earlier answers unread") from exc
        return view[sent:]
    try:
        return view[conn.sock.send(view):]
    except BlockingIOError:
        return view


def error_body(error: EpiserveError) -> bytes:
    return lp.error_body(error.code, type(error).__name__, clipped(error.message),
                         clipped(error.episode, 1024), clipped(error.key, 1024))


async def recv_into(sock: socket.socket, into: memoryview) -> int:
    """What has arrived on the (non-blocking) socket, up to ``into``'s size; waits in the
    loop only when nothing has. uvloop's ``sock_recv_into`` always waits first (a reader
    added and removed, one loop pass, per receive), though a frame's body has mostly
    arrived with its head. A connection whose bytes keep coming never waits here: its
    frame loop yields on its own (``FAIR_FRAMES``)."""
    try:
        return sock.recv_into(into)
    except BlockingIOError:
        return await asyncio.get_running_loop().sock_recv_into(sock, into)


async def recv_exact(sock: socket.socket, n: int) -> bytes:
    try:  # usually all there already (a frame's head and body arrive together)
        first = sock.recv(n)
    except BlockingIOError:
        first = b""
    else:
        if len(first) == n:
            return first
        if not first:
            raise ConnectionClosed("the peer closed the connection")
    buf = bytearray(n)
    buf[:len(first)] = first
    view, got = memoryview(buf), len(first)
    while got < n:
        k = await recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionClosed("the peer closed the connection")
        got += k
    return bytes(buf)


async def recv_head(sock: socket.socket, max_body: int) -> lp.Head:
    head = lp.parse_head(await recv_exact(sock, lp.HEAD_BYTES), lp.TO_DAEMON, max_body)
    if head.flags & lp.FLAG_FD:
        raise lp.FrameError("a client does not send descriptors")
    return head
