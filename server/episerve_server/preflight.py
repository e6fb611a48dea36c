"""Checks made before the daemon opens anything, so an operator's mistake is one clear line
(``StartupError``; the CLI prints it and exits 2) instead of a traceback or a daemon that
silently does something else: a ``--unix`` path that is a file or another live daemon's
socket, a port in use or not permitted, TLS files that cannot be read or are not PEM.

The daemon's private runtime paths (the workers' folder, the local plane's socket) are
claimed here too, under one rule (``private_folder_refusal``)."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import stat
from pathlib import Path

from episerve_server.config import ServerConfig

#: sockaddr_un's sun_path holds 108 bytes, the last one a NUL.
MAX_UNIX_PATH_BYTES = 107


class StartupError(Exception):
    """A setting the daemon cannot run with; its message is one line for the operator."""


def check(config: ServerConfig) -> None:
    if config.unix:
        claim_unix_socket(Path(config.unix))
    else:
        check_port(config.host, config.port, "--port")
    if config.health_port:
        check_port(config.host, config.health_port, "--health-port")
    if config.metrics_port:
        check_port(config.metrics_host, config.metrics_port, "--metrics-port")
    if config.tls:
        check_tls(config)


def empty_root(config: ServerConfig, episodes: int, broken: int) -> str | None:
    """The warning for a root that holds no episode at all (a wrong path, or a dataset not
    written yet): the daemon serves it, as an empty listing, but says so."""
    if episodes or broken:
        return None
    again = (f"it is scanned again every {config.rescan_s:g}s" if config.rescan_s
             else "it is scanned again on each ListEpisodes")
    return (f"the dataset root {config.root!r} holds no episodes (no <hash>.zarr groups, "
            f"nor a LeRobot v3 dataset): every listing is empty until some appear; {again}")


def kernel_missing() -> str | None:
    """The warning when the warm path's compiled loops were not built (no C compiler when
    installed): answers are the same, the daemon's CPU per sample is higher."""
    from episerve_server.core import kernel

    if kernel.BUILT:
        return None
    return ("the warm read path's compiled loops are not built (episerve_server.core._kernel):"
            " serving with their numpy versions: the same answers, more CPU per warm"
            " sample; install a C compiler and run `pip install -e .` again to build them")


def claim_unix_socket(path: Path) -> None:
    """Make ``path`` free for our socket: refuse a file that is not a socket and a socket
    that answers (a live daemon); remove a stale socket (one that refuses connections)."""
    where = f"--unix {str(path)!r}"
    if len(os.fsencode(path.resolve())) > MAX_UNIX_PATH_BYTES:
        raise StartupError(f"{where}: the path is longer than the {MAX_UNIX_PATH_BYTES} bytes "
                           "a unix socket address holds; choose a shorter one")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"{where}: cannot create its folder ({exc.strerror})") from None
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{where}: the path exists and is not a socket; refusing to replace "
                           "it (remove it yourself, or choose another path)")
    if not _listening(path, where):  # a leftover of a daemon that died
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    raise StartupError(f"{where}: another daemon is listening on this socket; stop it or "
                       "choose another path")


def _listening(path: Path, where: str) -> bool:
    """Whether a process accepts connections on the unix socket at ``path`` (``False``:
    nobody listens, or it is gone). One that accepts but does not answer is refused."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        raise StartupError(f"{where}: a process holds the socket {path.name!r} (it accepts "
                           "but is slow to answer); stop it or choose another path") from None
    except OSError as exc:
        raise StartupError(f"{where}: cannot check the socket {path.name!r} "
                           f"({exc.strerror or exc})") from None
    finally:
        probe.close()
    return True


def check_port(host: str, port: int, flag: str) -> None:
    """Bind and release ``host:port`` once, to report a port in use or not permitted."""
    if port == 0:
        return
    where = f"{flag} {port} on {host!r}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"{where}: cannot resolve the host ({exc.strerror})") from None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as exc:
            raise StartupError(f"{where}: cannot listen there ({exc.strerror})") from None
        finally:
            sock.close()


def check_tls(config: ServerConfig) -> None:
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key),
                       ("--tls-client-ca", config.tls_client_ca)):
        if path:
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise StartupError(f"{flag} {path!r}: cannot read it ({exc.strerror})") \
                    from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: "")
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise StartupError(
            f"--tls-cert {config.tls_cert!r} / --tls-key {config.tls_key!r}: not a PEM "
            f"certificate with its unencrypted private key ({exc})") from None
    if config.tls_client_ca:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise StartupError(f"--tls-client-ca {config.tls_client_ca!r}: not PEM CA "
                               f"certificates ({exc})") from None


def private_folder_refusal(st: os.stat_result, *, shared: bool) -> str | None:
    """Why a folder cannot hold this daemon's private sockets, or ``None``: the one rule for
    its private runtime paths (the workers' folder, the local plane's socket).

    The folder is a real folder, not a symlink, and no other user can put or replace
    anything in it. A folder of the daemon's own (``shared=False``) belongs to its uid, with
    no group or other permission bits. A ``shared`` folder that only receives the socket
    (``/tmp``, a run directory) may also be root's, and is writable by others only with the
    sticky bit (then nobody else can remove or rename what the daemon puts there).
    """
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return "is not a plain directory"
    if st.st_uid != uid and not (shared and st.st_uid == 0):
        return f"belongs to uid {st.st_uid}, not to this daemon's uid {uid}"
    mode = stat.S_IMODE(st.st_mode)
    if not shared and mode & 0o077:
        return f"has mode {mode:#o}, open to group or others"
    if shared and mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return "is writable by every user (and not sticky)"
    return None


def claim_private_dir(folder: Path, flag: str) -> None:
    """Make ``folder`` a runtime folder only this daemon's user can touch: mode 0700.

    A new folder is created exclusively. One that exists already is the leftover of a
    daemon that was killed, or a trap: it is reused only if it is a real folder (not a
    symlink) owned by this uid with no group or other permission bits, since no other user
    can make a folder that we own; what it holds is stale worker sockets, removed here (a
    socket that still answers belongs to a live daemon and is refused). Anything else is
    refused, naming the path: another user may have made it to catch the workers' sockets
    and the token sent to them. The checks run on the opened folder (``O_NOFOLLOW``), so a
    path swapped between the check and the use is not trusted.
    """
    where = f"{flag}: the workers' folder {str(folder)!r}"
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartupError(f"{where}: cannot create it ({exc.strerror})") from None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        kind = "a symlink" if os.path.islink(folder) else "not a folder"
        raise StartupError(f"{where} exists and is {kind}; refusing to use it (remove it "
                           f"yourself, or choose another --unix path) ({exc.strerror})") \
            from None
    try:
        why = private_folder_refusal(os.fstat(fd), shared=False)
        if why:
            raise StartupError(f"{where} {why}; refusing to use it (another user may have "
                               "made it, or may reach into it: remove it, or choose another "
                               "--unix path)")
        for name in os.listdir(fd):
            _remove_stale(fd, folder / name, where)
    finally:
        os.close(fd)


def _remove_stale(fd: int, path: Path, where: str) -> None:
    """Remove a dead worker's socket from our own folder; refuse anything else in it."""
    mode = os.lstat(path.name, dir_fd=fd).st_mode
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{where} holds {path.name!r}, which is not a worker socket; "
                           "refusing to remove it (remove it yourself)")
    if not _listening(path, where):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.name, dir_fd=fd)
        return
    raise StartupError(f"{where}: a process is listening on {path.name!r} in it (another "
                       "daemon's worker?); stop it or choose another --unix path")


def bind_private_socket(path: Path, flag: str) -> socket.socket:
    """A listening unix socket at ``path`` that only this uid can connect to.

    Refused: a path that is a symlink or not a socket, a live socket, a folder owned by
    another uid or writable by others without the sticky bit. A stale socket of ours is
    replaced. The socket is made 0600 before it listens, so no connection ever reaches it
    with wider permissions; bind itself fails if another process took the path meanwhile.
    """
    where = f"{flag} {str(path)!r}"
    try:
        pst = path.parent.lstat()
    except OSError as exc:
        raise StartupError(f"{where}: cannot check its folder ({exc.strerror})") from None
    why = private_folder_refusal(pst, shared=True)
    if why:
        raise StartupError(f"{where}: its folder {why}")
    with contextlib.suppress(FileNotFoundError):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
            raise StartupError(f"{where}: the path is a symlink or belongs to another user; "
                               "refusing to replace it")
    claim_unix_socket(path)  # refuses files and live sockets, removes a stale socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600, follow_symlinks=False)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise StartupError(f"{where}: cannot listen ({exc.strerror})") from None
    sock.setblocking(False)
    return sock
