"""The client's side of the local plane, chosen: which transport a target's reads take
(``transport`` ``"auto"``, ``"local"`` or ``"grpc"``), and whether the local-plane socket
beside a daemon's unix socket may be trusted with the token. The calls themselves go over a
``LocalChannel`` (``local_channel``): batches as views of shared-memory segments, no gRPC.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

from episerve_client.channel import DEFAULT_CONNECT_TIMEOUT_S, unix_path
from episerve_client.errors import InvalidArgument, PermissionDenied
from episerve_client.local_channel import LocalChannel, local_socket

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "local", "grpc")


class LocalPlanes:
    """A client's local-plane channels, per target, made lazily in the process that uses
    them (the sync and the async client alike)."""

    targets: tuple[str, ...]
    token: str
    connect_timeout_s: float
    outages: Any
    _pid: int
    _take_channels: Callable[[], list[Any]]

    def _init_planes(self, transport: str, targets: Sequence[str]) -> None:
        self.transport = check_transport(transport, tuple(targets))
        self._local: dict[str, LocalChannel | None] = {}

    def _plane(self, target: str) -> LocalChannel | None:
        """This process's local-plane channel to ``target``, or None for gRPC."""
        if self._pid != os.getpid():
            self._forked()
        if target in self._local:
            return self._local[target]
        plane = pick_local(target, self.transport, self.token, self.connect_timeout_s,
                           self.outages.max_outage_s)
        self._local[target] = plane
        return plane

    def _forked(self) -> None:
        """Drop what the parent process made: its channels and sockets are not ours."""
        self._take_channels()
        self._local, self._pid = {}, os.getpid()

    def _take_planes(self) -> list[LocalChannel]:
        """Forget every local-plane channel; returns them, to close."""
        local, self._local = self._local, {}
        return [plane for plane in local.values() if plane is not None]

    def daemon_pid(self, target: str) -> int | None:
        plane = self._local.get(target) if self._pid == os.getpid() else None
        return plane.daemon_pid if plane is not None else None


def check_transport(transport: str, targets: tuple[str, ...]) -> str:
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, got "
                              f"{transport!r}")
    if transport == "local":
        remote = [t for t in targets if unix_path(t) is None]
        if remote:
            raise InvalidArgument(f"transport='local' needs unix-socket targets of this host, "
                                  f"got {remote[0]!r}")
    return transport


def pick_local(target: str, transport: str, token: str,
               connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
               quiet_s: float | None = None) -> LocalChannel | None:
    """The local-plane channel for ``target`` under ``transport``, or None for gRPC; with
    ``"auto"`` one INFO line says which was chosen and why."""
    path = unix_path(target)
    if transport == "grpc" or path is None:
        return None
    if transport == "local" or offers_local(path):
        trusted_local(path)
        if transport == "auto":
            log.info("episerve: reads from %s go over the local shared-memory plane (%s)",
                     target, local_socket(path))
        return LocalChannel(path, target, token, connect_timeout_s, quiet_s)
    log.info("episerve: reads from %s go over gRPC (no local plane at %s)", target,
             local_socket(path))
    return None


def trusted_local(path: str) -> None:
    """Refuse a local-plane socket that another local user could have put beside the daemon's
    (in a shared folder such as /tmp, with the plane off or before the daemon started) to
    collect the token and answer with rows of its own: it must not be a symlink and must be
    owned by this process's uid or by the owner of the daemon's own socket. Checked before
    anything is sent; nothing there is left to the connect (``Unavailable``)."""
    sock = local_socket(path)
    try:
        st, daemon = os.lstat(sock), os.stat(path)
    except OSError:
        return
    owners = {os.getuid(), daemon.st_uid}
    if stat.S_ISLNK(st.st_mode) or st.st_uid not in owners:
        raise PermissionDenied(
            f"the local-plane socket {sock!r} is owned by uid {st.st_uid}"
            f"{' and is a symlink' if stat.S_ISLNK(st.st_mode) else ''}; expected one of "
            f"{sorted(owners)} (this process or the daemon's socket): refusing to send a "
            "token or reads to it (another local user may have put it there)")


def offers_local(path: str) -> bool:
    """Whether a daemon's unix socket at ``path`` has a local plane this process may use."""
    try:
        st = os.stat(local_socket(path))
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and os.access(local_socket(path), os.R_OK | os.W_OK)
