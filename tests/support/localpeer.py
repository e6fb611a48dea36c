"""A raw peer of the daemon's local plane: frames written by hand (heads, bodies, releases in
any order), answers read with the descriptors they carry. What a careless or hostile
client on the same host can do, without the client library's rules."""

from __future__ import annotations

import array
import asyncio
import contextlib
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_proto import local_plane as lp

_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)


@dataclass(frozen=True, slots=True)
class Answer:
    head: lp.Head
    body: bytes
    fd: int  # -1 for none; the caller closes it

    @property
    def error(self) -> tuple[str, str, str, str, str]:
        return lp.parse_error(self.body)


class LocalPeer:
    """One connection to ``<socket>.local``, HELLO sent (and WELCOME read, with ``hello``)."""

    def __init__(self, path: str, token: str = "", hello: bool = True,
                 timeout_s: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.fds: list[int] = []
        if hello:
            self.send(lp.frame(lp.HELLO, 0, token.encode()))
            answer = self.recv()
            if answer.head.kind != lp.WELCOME:
                raise ConnectionError(f"not welcomed: {answer}")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, method: str, payload: bytes, ident: int, keep: bool = False) -> None:
        self.send(lp.frame(lp.CALL, ident, lp.call_body(method, payload),
                           lp.FLAG_KEEP if keep else 0))

    def release(self, segment: int) -> None:
        self.send(lp.frame(lp.RELEASE, segment))

    def recv(self) -> Answer:
        """The next frame; its descriptor (if any) kept in ``fds`` to close with the peer."""
        msg, anc, _, _ = self.sock.recvmsg(lp.HEAD_BYTES, _FD_SPACE)
        if not msg:
            raise ConnectionError("the daemon closed the connection")
        fd = -1
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
                self.fds.extend(got)
                fd = got[0]
        data = msg + self._exact(lp.HEAD_BYTES - len(msg))
        head = lp.parse_head(data, lp.TO_CLIENT, lp.MAX_ANSWER_BODY)
        return Answer(head, self._exact(head.length), fd)

    def answer(self) -> Answer:
        """The next frame that answers a call (RETIRE notices skipped)."""
        while True:
            a = self.recv()
            if a.head.kind != lp.RETIRE:
                return a

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the daemon closed the connection mid-frame")
            buf += chunk
        return bytes(buf)

    def closed_by_daemon(self, timeout_s: float) -> bool:
        """Whether the daemon closes the connection within ``timeout_s`` (frames before
        the close are read and dropped)."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def __enter__(self) -> LocalPeer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def segment_of(fd: int, size: int) -> np.ndarray:
    """A segment a BATCH carried, mapped (read-only use)."""
    return np.frombuffer(mmap.mmap(fd, size), np.uint8)


def batch_segment(answer: Answer) -> tuple[int, int]:
    """The (segment id, size) a BATCH answer is in."""
    ident, size, _ = lp.BATCH_HEAD.unpack_from(answer.body)
    return int(ident), int(size)


def inq(sock: socket.socket) -> int:
    """Bytes waiting to be read on ``sock``."""
    import fcntl
    import termios

    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    n: int = struct.unpack("i", raw)[0]
    return n


@contextlib.contextmanager
def plane_in_thread(config: Any) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    """A read core and its local plane on ``config``, served by an event loop in a thread
    of this process (a real plane, a real socket; no daemon process): (plane, loop)."""
    from episerve_server.rpc.handlers.service import EpiserveService
    from episerve_server.rpc.local_plane.plane import LocalPlane
    from episerve_server.wiring import build_read_core

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> LocalPlane:
        core = build_read_core(config)
        await core.catalog.scan()
        plane = await LocalPlane.start(config, EpiserveService(config, core.catalog,
                                                               core.planner, core.stats))
        assert plane is not None
        return plane

    plane = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield plane, loop
    finally:
        asyncio.run_coroutine_threadsafe(plane.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
