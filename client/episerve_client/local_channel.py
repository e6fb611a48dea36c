"""Calls over a daemon's local plane (its ``<socket>.local`` unix socket), batches as views
of shared-memory segments. No gRPC is involved.

One ``LocalChannel`` per target and process (``Client`` makes it lazily, after any fork).
The daemon lends each segment for one batch; the arrays of that batch are numpy views of
it, all derived from one base array, and a finalizer on that base queues the segment's
return: a segment goes back (RELEASE, sent before the next call) only when nothing in this
process refers to it any more, so the daemon never writes memory a caller still reads.
What a client holds lent counts against the daemon's budget, so past the share the WELCOME
names (a quarter of ``--max-buffered-bytes``), or with every pooled segment held, a new
batch is asked to be kept instead (``FLAG_KEEP``): its segment is the client's memory from
then on, and a loop that keeps many batches never makes the daemon refuse others.

The daemon is not trusted: every frame head is checked against a kind and a limit, a
descriptor must be a sealed (cannot shrink) regular file at least as large as the segment
it claims to be, at most ``MAX_CLIENT_SEGMENTS`` are mapped, and every blob of a batch is
checked against the segment's size, and every array's byte count against its dtype and
shape, before any view is made.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import gc
import logging
import mmap
import os
import select
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from episerve_client._outage import ALIVE_S, Watch
from episerve_client.channel import DEFAULT_CONNECT_TIMEOUT_S, peer_pid
from episerve_client.errors import (
    DataLossError,
    DeadlineExceeded,
    EpiserveError,
    Unavailable,
)
from episerve_client.read_answer import InSegment
from episerve_proto import local_plane as lp
from episerve_proto.errors import error_class

log = logging.getLogger(__name__)

#: Maps a kept segment's descriptor: ``(fd, size) -> uint8 array`` (see LocalChannel.call).
Adopt = Callable[[int, int], np.ndarray]
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)


def adopt_mapping(fd: int, size: int) -> np.ndarray:
    """A kept segment as a plain shared mapping; it is unmapped when the batch is dropped."""
    return np.frombuffer(mmap.mmap(fd, size), np.uint8)


def local_socket(path: str) -> str:
    return path + lp.LOCAL_SUFFIX



@dataclass(eq=False)
class _Segment:
    mm: mmap.mmap
    size: int
    lent: bool = False


class LocalChannel:
    """Calls to one daemon's local plane, one at a time (a lock), from one process."""

    def __init__(self, path: str, target: str, token: str,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 quiet_s: float | None = None) -> None:
        self.path, self.target, self.token = path, target, token
        self.connect_timeout_s = connect_timeout_s
        #: ``max_outage_s``: a call the daemon sends nothing for this long, while it
        #: welcomes no new connection either, fails (``Unavailable``) instead of waiting on.
        self.quiet_s = quiet_s
        self._sock: socket.socket | None = None
        self._closer: Callable[[], Any] = lambda: None
        self._segments: dict[int, _Segment] = {}
        self._returned: collections.deque[int] = collections.deque()
        self._limit = 0
        self._lend = 0  # bytes of lent segments the daemon lets it hold (0: no limit said)
        self._ids = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()
        #: The pid of the daemon process that last welcomed this client (None: not yet).
        self.daemon_pid: int | None = None

    # -- public ------------------------------------------------------------------------

    def call(self, method: str, payload: bytes, timeout_s: float,
             adopt: Adopt | None = None) -> bytes | InSegment:
        """The method's answer (an ``InSegment`` for Read, checked by ``read_result``); raises
        ``EpiserveError``.

        ``adopt`` (Read only): keep the batch's segment instead of returning it;
        ``adopt(fd, size)`` maps the descriptor (it is closed afterwards) and returns the
        uint8 array the batch's arrays are views of (``data/shared.py``: a torch
        shared-memory storage, which torch hands between processes as a descriptor).
        """
        deadline = time.monotonic() + max(timeout_s, 0.001)
        with self._lock:
            try:
                return self._call(method, payload, deadline, adopt)
            except EpiserveError as exc:
                if isinstance(exc, Unavailable | DeadlineExceeded | DataLossError):
                    self._drop()  # the stream's state is unknown: start over next time
                raise
            except TimeoutError:
                self._drop()
                raise DeadlineExceeded(f"the daemon's local plane at {self.path!r} did not "
                                       "answer before the deadline",
                                       target=self.target) from None
            except OSError as exc:
                self._drop()
                raise Unavailable(f"the daemon's local plane at {self.path!r} is not "
                                  f"reachable ({exc.strerror or exc})",
                                  target=self.target) from None

    def connect(self, wait_s: float) -> None:
        """Be connected and welcomed, trying for ``wait_s`` at most (a daemon just started
        may not listen yet); then a socket nothing listens on is ``Unavailable`` naming it.
        For a target that never answered: its first call fails in seconds, not at the
        deadline."""
        give_up = time.monotonic() + wait_s
        with self._lock:
            while True:
                try:
                    # past the welcome's own limit, so a silent daemon is Unavailable
                    self._connected(time.monotonic() + 2 * self.connect_timeout_s)
                    return
                except EpiserveError as exc:
                    self._drop()
                    if not exc.transient or time.monotonic() >= give_up:
                        raise
                except OSError as exc:  # a full backlog, a refused permission, ...
                    self._drop()
                    if time.monotonic() >= give_up:
                        raise Unavailable(f"the daemon's local plane at {self.path!r} is not "
                                          f"reachable ({exc.strerror or exc})",
                                          target=self.target) from None
                time.sleep(min(0.1, max(0.0, give_up - time.monotonic())))

    def close(self) -> None:
        with self._lock:
            self._drop()

    @property
    def lent(self) -> int:
        return sum(s.lent for s in self._segments.values())

    @property
    def lent_bytes(self) -> int:
        return sum(s.size for s in self._segments.values() if s.lent)

    def _holds_enough(self) -> bool:
        """Whether a new batch should be kept (the client's memory from then on) rather
        than lent: every pooled segment is held, or the bytes the daemon lends it are."""
        return self.lent >= self._limit or bool(self._lend and self.lent_bytes >= self._lend)

    # -- protocol ----------------------------------------------------------------------

    def _call(self, method: str, payload: bytes, deadline: float,
              adopt: Adopt | None) -> bytes | InSegment:
        sock = self._connected(deadline)
        self._flush(sock)
        if method == "Read" and adopt is None and self._limit and self._holds_enough():
            gc.collect()  # batches only reachable through cycles
            self._flush(sock)
            if self._holds_enough():  # every pooled segment, or its share, held: keep one
                adopt = adopt_mapping
        self._ids += 1
        ident = self._ids
        sock.settimeout(_left(deadline))
        keep = adopt is not None and method == "Read"
        sock.sendall(lp.frame(lp.CALL, ident, lp.call_body(method, payload),
                              lp.FLAG_KEEP if keep else 0))
        while True:
            head, body, fd = self._recv(sock, deadline)
            if head.kind == lp.RETIRE:
                self._retire(head.ident)
                continue
            if head.ident != ident:
                raise DataLossError(f"the local plane answered call {head.ident}, "
                                    f"expected {ident}", target=self.target)
            if head.kind == lp.ERROR:
                raise self._error(body)
            if head.kind == lp.REPLY and method != "Read":
                return body
            if head.kind == lp.BATCH and method == "Read":
                return self._batch(body, fd, adopt if keep else None)
            raise DataLossError(f"the local plane answered a {method} call with frame kind "
                                f"{head.kind}", target=self.target)

    def _connected(self, deadline: float) -> socket.socket:
        if self._pid != os.getpid():  # inherited over a fork: not ours to use
            self._sock, self._segments, self._pid = None, {}, os.getpid()
            self._returned = collections.deque()
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # A daemon (or a --workers process) that accepts but does not welcome within the
        # connect timeout is not serving: Unavailable, so the caller fails over or retries
        # instead of waiting out the whole deadline.
        welcome_by = min(deadline, time.monotonic() + self.connect_timeout_s)
        try:
            sock.settimeout(_left(welcome_by))
            try:
                sock.connect(local_socket(self.path))
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                why = ("refuses connections: it is left from a daemon that stopped"
                       if isinstance(exc, ConnectionRefusedError) else
                       "does not exist: the daemon stopped")
                raise Unavailable(f"no daemon listens at {self.path!r}: its local-plane "
                                  f"socket {local_socket(self.path)!r} {why}",
                                  target=self.target) from None
            self.daemon_pid = peer_pid(sock) or self.daemon_pid
            sock.sendall(lp.frame(lp.HELLO, 0, self.token.encode()))
            head, body, _ = self._recv(sock, welcome_by)
        except TimeoutError:
            sock.close()
            if welcome_by >= deadline:
                raise
            raise Unavailable(f"the daemon's local plane at {self.path!r} did not welcome "
                              f"this client within {self.connect_timeout_s:g}s",
                              target=self.target) from None
        except BaseException:
            sock.close()
            raise
        if head.kind == lp.ERROR:
            sock.close()
            raise self._error(body)
        if head.kind != lp.WELCOME or head.ident < 1:
            sock.close()
            raise DataLossError(f"the local plane at {self.path!r} did not welcome this "
                                "client", target=self.target)
        self._limit = min(head.ident, lp.MAX_CLIENT_SEGMENTS)
        self._lend = lp.LEND.unpack(body)[0] if len(body) == lp.LEND.size else 0
        self._sock = sock
        # A channel dropped without close() still closes its socket (and so the daemon
        # frees its segments) when it is collected, or at exit.
        self._closer = weakref.finalize(self, sock.close)
        return sock

    def _flush(self, sock: socket.socket) -> None:
        frames = []
        while self._returned:
            ident = self._returned.popleft()
            seg = self._segments.get(ident)
            if seg is not None and seg.lent:
                seg.lent = False
                frames.append(lp.frame(lp.RELEASE, ident))
        if frames:
            sock.sendall(b"".join(frames))

    def _recv(self, sock: socket.socket, deadline: float) -> tuple[lp.Head, bytes, int]:
        """One frame and the descriptor it carries (-1 for none)."""
        self._readable(sock, deadline)
        sock.settimeout(_left(deadline))
        data, fds = bytearray(), list[int]()
        try:
            msg, anc, flags, _ = sock.recvmsg(lp.HEAD_BYTES, _FD_SPACE,
                                              socket.MSG_CMSG_CLOEXEC)
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
                    fds.extend(got)
            if not msg:
                raise Unavailable(f"the daemon's local plane at {self.path!r} closed the "
                                  "connection (the daemon stopped or restarted)",
                                  target=self.target)
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                raise DataLossError("the local plane sent more descriptors than one frame "
                                    "carries", target=self.target)
            data += msg
            while len(data) < lp.HEAD_BYTES:
                data += self._exact(sock, lp.HEAD_BYTES - len(data), deadline)
            try:
                head = lp.parse_head(bytes(data), lp.TO_CLIENT, lp.MAX_ANSWER_BODY)
            except lp.FrameError as exc:
                raise DataLossError(f"the local plane sent a bad frame ({exc})",
                                    target=self.target) from None
            if bool(head.flags & lp.FLAG_FD) != bool(fds) or (fds and head.kind != lp.BATCH):
                raise DataLossError("the local plane sent a descriptor where none belongs "
                                    "(or none where one was announced)", target=self.target)
            body = self._exact(sock, head.length, deadline) if head.length else b""
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return head, body, fds[0] if fds else -1

    def _exact(self, sock: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self._readable(sock, deadline)
            sock.settimeout(_left(deadline))
            k = sock.recv_into(view[got:])
            if k == 0:
                raise Unavailable(f"the daemon's local plane at {self.path!r} closed the "
                                  "connection mid-answer (the daemon stopped or restarted)",
                                  target=self.target)
            got += k
        return bytes(buf)

    def _readable(self, sock: socket.socket, deadline: float) -> None:
        """Wait until ``sock`` has bytes (or is closed), or the deadline passes (then
        ``TimeoutError``). While nothing comes, from ``WARN_QUIET_S`` on, the daemon's
        liveness is checked beside the call every ``PROBE_S``: a fresh connection must be
        welcomed. A daemon that welcomes is working (a large Read takes time) and the call
        waits on; one that does not is an outage: a WARNING naming the daemon, and, once it
        has not been seen alive for ``quiet_s`` (``max_outage_s``), ``Unavailable``."""
        poller = select.poll()  # (select.select cannot take a descriptor past 1023)
        poller.register(sock.fileno(), select.POLLIN)
        watch, said = Watch(self.quiet_s), False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if poller.poll(1000 * min(left, watch.wait_s())):
                return
            if time.monotonic() < watch.due_at() or self._sock is None \
                    or (said and watch.limit is None):
                continue  # not due; being welcomed (the connect timeout covers it); said
            watch.probing()
            if self._alive():
                watch.seen()
                continue
            if not said:
                said = True
                log.warning("episerve: the daemon at %s%s has sent nothing for %.0fs and does "
                            "not welcome a new connection: it is stopped or wedged%s",
                            self.target, f" (pid {self.daemon_pid})" if self.daemon_pid
                            else "", watch.quiet_s(), "" if watch.limit is None else
                            f"; the call fails at {watch.limit:g}s (max_outage_s)")
            if watch.over():
                raise watch.failure(f"the daemon's local plane at {self.path!r} has sent "
                                    "nothing", self.target)

    def _alive(self) -> bool:
        """Whether the daemon welcomes a new local-plane connection within ``ALIVE_S``."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(ALIVE_S)
            probe.connect(local_socket(self.path))
            probe.sendall(lp.frame(lp.HELLO, 0, self.token.encode()))
            head = probe.recv(lp.HEAD_BYTES)
            return len(head) > 0
        except OSError:
            return False
        finally:
            probe.close()

    def _batch(self, body: bytes, fd: int, adopt: Adopt | None) -> InSegment:
        try:
            header = lp.parse_batch(body)
        except lp.FrameError as exc:
            if fd >= 0:
                os.close(fd)
            raise DataLossError(f"the local plane sent a bad batch header ({exc})",
                                target=self.target) from None
        if adopt is not None:
            return self._kept(header, fd, adopt)
        seg = self._segments.get(header.segment)
        if fd >= 0:
            seg = self._map(header.segment, header.size, fd)
        if seg is None or seg.size != header.size or seg.lent:
            raise DataLossError(f"the local plane answered with segment {header.segment} "
                                "that this client has not mapped, of another size, or still "
                                "in use", target=self.target)
        base = np.frombuffer(seg.mm, np.uint8)
        seg.lent = True
        weakref.finalize(base, self._returned.append, header.segment)
        return InSegment(header.meta, header.blobs, base)

    def _kept(self, header: lp.BatchHeader, fd: int, adopt: Adopt) -> InSegment:
        """A batch whose segment the daemon gave away: mapped by ``adopt``, never returned."""
        try:
            if fd < 0:
                raise DataLossError("the local plane kept a segment the client asked for",
                                    target=self.target)
            old = self._segments.pop(header.segment, None)
            if old is not None and old.lent:
                raise DataLossError(f"the local plane gave away segment {header.segment}, "
                                    "which this client still uses", target=self.target)
            self._check_fd(header.segment, header.size, fd)
            base = adopt(fd, header.size)
        except OSError as exc:
            raise DataLossError(f"segment {header.segment}: cannot map it ({exc.strerror})",
                                target=self.target) from None
        finally:
            if fd >= 0:
                os.close(fd)
        if base.dtype != np.uint8 or base.ndim != 1 or base.size != header.size:
            raise DataLossError(f"segment {header.segment}: the adopted mapping is not "
                                f"{header.size} bytes", target=self.target)
        return InSegment(header.meta, header.blobs, base)

    def _check_fd(self, ident: int, size: int, fd: int) -> None:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size or not seals & fcntl.F_SEAL_SHRINK:
            raise DataLossError(f"segment {ident}: the descriptor is not a sealed "
                                f"shared-memory file of at least {size} bytes",
                                target=self.target)

    def _map(self, ident: int, size: int, fd: int) -> _Segment:
        try:
            if ident in self._segments or len(self._segments) >= lp.MAX_CLIENT_SEGMENTS:
                raise DataLossError(f"the local plane sent segment {ident} again, or more "
                                    f"than {lp.MAX_CLIENT_SEGMENTS} segments",
                                    target=self.target)
            self._check_fd(ident, size, fd)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            raise DataLossError(f"segment {ident}: cannot map it ({exc.strerror})",
                                target=self.target) from None
        finally:
            os.close(fd)
        seg = self._segments[ident] = _Segment(mm, size)
        return seg

    def _retire(self, ident: int) -> None:
        seg = self._segments.get(ident)
        if seg is not None and not seg.lent:
            del self._segments[ident]  # unmapped when the last view of it goes

    def _error(self, body: bytes) -> EpiserveError:
        try:
            code, name, message, episode, key = lp.parse_error(body)
        except lp.FrameError as exc:
            return DataLossError(f"the local plane sent a bad error frame ({exc})",
                                 target=self.target)
        cls = error_class(code, name)
        if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            message = f"{message} (daemon at {self.target})"
        return cls(message, episode=episode, key=key, target=self.target)

    def _drop(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                self._closer()
        # Mappings live on while views refer to them. Returns queued for this connection's
        # segments must not release the next connection's segments of the same ids.
        self._sock, self._segments = None, {}
        self._returned = collections.deque()


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())
