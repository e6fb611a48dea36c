"""Checks made before the daemon opens anything, so an operator's mistake is one clear line
(``StartupError``; the CLI prints it and exits 2) instead of a traceback or a daemon that
silently does something else: a ``--unix`` path that is a file or another live daemon's
socket, a port in use or not permitted, TLS files that cannot be read or are not PEM."""

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
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # nobody listens: a leftover of a daemon that died
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    except FileNotFoundError:
        return
    except TimeoutError:
        raise StartupError(f"{where}: a process holds this socket (it accepts but is slow to "
                           "answer); stop it or choose another path") from None
    except OSError as exc:
        raise StartupError(f"{where}: cannot check the existing socket ({exc.strerror})") \
            from None
    finally:
        probe.close()
    raise StartupError(f"{where}: another daemon is listening on this socket; stop it or "
                       "choose another path")


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
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StartupError(f"{where} belongs to uid {st.st_uid}, not to this daemon's "
                               f"uid {os.geteuid()}; refusing to use it (another user may have "
                               "made it: remove it, or choose another --unix path)")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise StartupError(f"{where} has mode {stat.S_IMODE(st.st_mode):#o}, open to "
                               "group or others; refusing to use it (remove it, or chmod it "
                               "0700)")
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
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.name, dir_fd=fd)
        return
    except OSError as exc:
        raise StartupError(f"{where}: cannot check the socket {path.name!r} in it "
                           f"({exc.strerror or exc})") from None
    finally:
        probe.close()
    raise StartupError(f"{where}: a process is listening on {path.name!r} in it (another "
                       "daemon's worker?); stop it or choose another --unix path")
