"""Targets, channel options and credentials, shared by ``Client`` and ``AsyncClient``."""

from __future__ import annotations

import atexit
import ipaddress
import logging
import multiprocessing.util
import os
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from episerve_client.errors import InvalidArgument, Unavailable
from episerve_proto.contract import CLIENT_KEEPALIVE_MS, MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

#: Processes that opened an episerve channel. A forked child inherits this set, which is how
#: it can tell that gRPC was already running in its parent.
_GRPC_PIDS: set[int] = set()
# Keepalive: every 30 s, above the daemon's 10 s minimum ping interval, so the daemon never
# answers too_many_pings.
KEEPALIVE_TIME_MS = CLIENT_KEEPALIVE_MS
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 64 * 2**20),
    ("grpc.enable_retries", 0),  # the client retries itself, with jittered backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # A dns:/// name with several replicas behind it: spread calls over all of them.
    ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}'),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TLS:
    """Paths to PEM files. ``ca`` verifies the daemon; ``cert``/``key`` are for mutual TLS."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""

    def options(self) -> tuple[tuple[str, Any], ...]:
        if self.server_name:
            return (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", self.server_name))
        return CHANNEL_OPTIONS

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: str) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


# -- the clients of this process, closed when it exits --------------------------------------

#: Seconds ``close_process_channels`` waits for gRPC's helper threads to end.
EXIT_CLOSE_S = 2.0
_owners: weakref.WeakSet[Any] = weakref.WeakSet()  # blocking clients with a channel open here
_owners_pid = 0
#: Channels a forked child inherited: referenced for good and never used or closed there;
#: letting one be collected or closing it would run gRPC on state of the parent's threads.
_INHERITED: list[Any] = []


def close_at_exit(client: Any) -> None:
    """Have ``client.close()`` run when this process exits, if the client is still alive.

    A DataLoader worker that ends (the epoch was cut short, the loader dropped) must not
    reach interpreter shutdown with a live channel: gRPC's threads then run while the
    interpreter is torn down under them. ``multiprocessing.util.Finalize`` covers a
    multiprocessing child as its target returns, ``atexit`` any process that ends normally.
    """
    global _owners_pid
    pid = os.getpid()
    if _owners_pid != pid:  # the first client of this process (or of a forked child)
        _owners.clear()  # a parent's clients: each parks its own channels when used here
        _owners_pid = pid
        atexit.register(close_process_channels)
        multiprocessing.util.Finalize(None, close_process_channels, exitpriority=100)
    _owners.add(client)


def keep_inherited(channels: Iterable[Any]) -> None:
    """Park channels inherited through ``fork``: referenced for good, never touched."""
    _INHERITED.extend(channels)


def close_process_channels(wait_s: float = EXIT_CLOSE_S) -> int:
    """Close every blocking client of this process that still has channels, dropping its
    references to them, then wait (at most ``wait_s``) for gRPC's helper threads to end.
    Idempotent; inherited channels are left alone. Returns how many clients were closed."""
    if _owners_pid != os.getpid():
        return 0
    clients = list(_owners)
    _owners.clear()
    closed = len(clients)
    for client in clients:
        try:
            client.close()
        except Exception as exc:  # closing at exit must never raise
            log.debug("closing a client at exit failed: %r", exc)
    del clients
    deadline = time.monotonic() + wait_s
    for thread in threading.enumerate():
        # gRPC's call and connectivity pollers: daemon threads running its ``_run``
        if thread.daemon and thread.name.endswith("(_run)") and thread.is_alive():
            thread.join(max(0.0, deadline - time.monotonic()))
    return closed


def note_grpc_use() -> None:
    """Record that this process uses gRPC; warn once in a child forked after its parent did.

    gRPC does not survive ``fork``: a DataLoader worker forked from a process that had
    already made calls can hang on its first one.
    """
    pid = os.getpid()
    if pid in _GRPC_PIDS:
        return
    if _GRPC_PIDS:
        log.warning(
            "process %d was forked from a process that had already used gRPC (pid %s); "
            "gRPC calls after such a fork can hang. Start DataLoader workers with "
            "multiprocessing_context='spawn' or 'forkserver', or do not read through "
            "episerve in the main process before the workers start", pid,
            ", ".join(map(str, sorted(_GRPC_PIDS))),
        )
    _GRPC_PIDS.add(pid)


def parse_targets(target: str | Sequence[str]) -> tuple[str, ...]:
    """The targets, each stripped; a bare absolute path is the unix socket at that path.

    gRPC would take ``/run/episerve.sock`` for a host name and wait for it until the
    deadline: it becomes ``unix:///run/episerve.sock``.
    """
    items = [target] if isinstance(target, str) else list(target)
    out = []
    for t in items:
        if not isinstance(t, str) or not t.strip():
            raise InvalidArgument(f"a target is 'host:port' or 'unix:///path', got {t!r}")
        t = t.strip()
        out.append(f"unix://{t}" if t.startswith("/") else t)
    if not out:
        raise InvalidArgument("at least one target is needed")
    return tuple(dict.fromkeys(out))


def is_local(target: str) -> bool:
    """A unix socket or a loopback address: where a plaintext token cannot be sniffed."""
    if target.startswith("unix:"):
        return True
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token_transport(target: str, token: str, tls: TLS | None,
                          plaintext_token_ok: bool) -> None:
    if not token or tls is not None:
        return
    if not plaintext_token_ok or not is_local(target):
        raise InvalidArgument(
            f"refusing to send a token in plaintext to {target!r}: use tls=TLS(...), or, for "
            "a unix socket or loopback target only, pass plaintext_token_ok=True"
        )


#: The standard health check, asked to see whether a daemon answers at all.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
#: A target that has never answered this client must accept a connection within this.
DEFAULT_CONNECT_TIMEOUT_S = 3.0


def not_answering(target: str, waited_s: float, tls: bool) -> Unavailable:
    """The error for a target that never answered: nothing listens there (or it speaks
    another protocol), which waiting longer will not change."""
    path = unix_path(target)
    if path is not None and (why := nobody_listens(path)):
        return Unavailable(f"no daemon at {target!r}: {why}", target=target)
    hint = ("is the daemon running at this address, and started with --tls-cert?" if tls
            else "is the daemon running at this address, and without TLS?")
    return Unavailable(f"no daemon answered at {target!r} within {waited_s:g}s: nothing "
                       f"listens there or it did not accept the connection ({hint})",
                       target=target)


def nobody_listens(path: str) -> str:
    """Why no daemon can answer at the unix socket ``path``, or ``""`` when one may: a
    socket file with nothing listening on it (left by a daemon that was killed, which
    cannot remove it) refuses every connection at once, and waiting will not change that
    until a daemon is started there again."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(0.5)
        sock.connect(path)
    except ConnectionRefusedError:
        return (f"nothing listens on the unix socket {path!r} (the connection is refused: "
                "the socket is left from a daemon that stopped; start the daemon again)")
    except FileNotFoundError:
        return f"the unix socket {path!r} does not exist (the daemon stopped)"
    except OSError:
        return ""  # busy, or not ours to judge: the call's own error says the rest
    finally:
        sock.close()
    return ""


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a connected unix socket (Linux), if the
    kernel says."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return None
    pid = _UCRED.unpack(creds)[0]
    return pid if pid > 0 else None


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


#: A unix socket that does not exist yet is looked for this long before the call fails (a
#: daemon restarting re-creates its socket within this).
UNIX_WAIT_S = 0.25


def unix_path(target: str) -> str | None:
    """The socket path of a ``unix:`` target (``unix:/p``, ``unix:///p``, ``unix:rel``);
    ``None`` for any other target (TCP, ``unix-abstract:``)."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]  # unix:///abs/path -> /abs/path (gRPC: unix://<absolute path>)
    return path or None


def check_unix_target(target: str, wait_s: float = UNIX_WAIT_S) -> None:
    """Fail at once, naming the path, when a unix target has no socket to connect to.

    gRPC would otherwise wait for the socket until the call's deadline (minutes by
    default) before answering UNAVAILABLE without saying why.
    """
    path = unix_path(target)
    if path is None:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"no daemon at {target!r}: the unix socket {path!r} does not exist "
                    "(is the daemon running, and started with --unix at that path?)",
                    target=target) from None
            time.sleep(0.02)
            continue
        except OSError as exc:
            raise Unavailable(f"cannot reach the daemon at {target!r}: the unix socket "
                              f"{path!r} cannot be checked ({exc.strerror})",
                              target=target) from None
        if not stat.S_ISSOCK(mode):
            raise Unavailable(f"no daemon at {target!r}: {path!r} exists but is not a unix "
                              "socket (expected the path given to the daemon's --unix)",
                              target=target)
        return
