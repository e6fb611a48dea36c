"""The one serve path: any servicer set (the single-process daemon, the ``--workers N``
front, a worker) behind one gRPC server, started, served until a signal and drained here.

- ``start``: one interceptor stack (the logging interceptor with its summary, the token
  check), health (``NOT_SERVING`` until the caller says otherwise) and reflection, the
  bind to ``--unix`` or ``--host``/``--port`` (with TLS), the plaintext ``--health-port``
  server and the metrics; whatever started is stopped again if a later step fails.
- ``Server.drain``: health ``NOT_SERVING``, new reads refused, the reads in flight given
  ``--grace-s`` (``alongside`` runs meanwhile: the front stops its workers), then the
  server, the extra servers, the metrics and the last log summary stop.
- ``serve_until_stopped``: the signals that end serving, the tasks that run meanwhile, the
  drain.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.registry import Collector

from episerve_proto.contract import (
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    MIN_PING_INTERVAL_MS,
    SERVICE_NAME,
)
from episerve_server.config import ServerConfig
from episerve_server.preflight import StartupError
from episerve_server.rpc.grpc.adapter import generic_handler
from episerve_server.rpc.handlers.servicer import Servicer
from episerve_server.rpc.process import introspection
from episerve_server.rpc.process.interceptors import LoggingInterceptor, TokenInterceptor
from episerve_server.rpc.process.metrics import Metrics

log = logging.getLogger(__name__)

# Keepalive: the server accepts pings every 10 s or more, the client pings every 30 s
# (episerve_client.channel), so no call ever ends in too_many_pings. The server pings every
# 60 s and drops a connection whose peer does not answer within 20 s: a client that stopped
# reading its socket holds nothing for longer than that.
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 2),
    # A connection must finish its HTTP/2 (and TLS) handshake this fast.
    ("grpc.server_handshake_timeout_ms", 20_000),
    ("grpc.so_reuseport", 0),
)
#: How often drain looks whether the reads in flight have finished.
DRAIN_POLL_S = 0.02
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def server_options(config: ServerConfig) -> tuple[tuple[str, int], ...]:
    """``SERVER_OPTIONS`` plus the per-connection bounds from the config.

    ``max_connection_age_s`` (default 600 s) GOAWAYs every connection, then gives its RPCs
    ``grace_s`` (at least 1 s) before closing it, so a client that never opens its HTTP/2
    receive window holds the responses it asked for that long at most (while they count
    against ``--max-buffered-bytes``). ``max_connection_idle_s`` (default 300 s) closes
    connections that carry no RPC; ``max_streams_per_connection`` (default 256) bounds the
    RPCs one connection runs at once.
    """
    options: tuple[tuple[str, int], ...] = (*SERVER_OPTIONS,
               ("grpc.max_concurrent_streams", config.max_streams_per_connection))
    if config.max_connection_age_s > 0:  # GOAWAY old connections so new replicas get load
        options += (("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(max(1.0, config.grace_s) * 1000)))
    if config.max_connection_idle_s > 0:
        options += (("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),)
    return options


@dataclass(slots=True)
class Server:
    """A started server: the gRPC server and everything that stops with it."""

    config: ServerConfig
    servicer: Servicer
    server: grpc.aio.Server
    health: introspection.HealthServicer
    address: str
    interceptor: LoggingInterceptor
    extra: list[grpc.aio.Server] = field(default_factory=list)
    metrics: Metrics | None = None
    #: Run after the gRPC server stopped (the local plane).
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def drain(self, alongside: Awaitable[None] | None = None) -> None:
        """Health NOT_SERVING, refuse new reads, let in-flight reads finish, then stop."""
        self.servicer.admission.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.config.grace_s
        beside = asyncio.ensure_future(alongside) if alongside is not None else None
        while self.servicer.admission.inflight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if beside is not None:
            await beside
        await self.server.stop(max(0.1, deadline - time.monotonic()))
        await self._close()

    async def abort(self) -> None:
        """Stop at once (a start-up step after ``start`` failed)."""
        await self.server.stop(0)
        await self._close()

    async def _close(self) -> None:
        for stop in self.on_stop:
            await stop()
        for extra in self.extra:
            await extra.stop(0)
        if self.metrics is not None:
            self.metrics.close()
        self.interceptor.summary.flush()  # the RPCs of the last interval


async def start(config: ServerConfig, servicer: Servicer, *,
                collector: Collector | None = None) -> Server:
    """Serve ``servicer``'s handlers on the configured address; health ``NOT_SERVING``
    until ``Server.set_serving(True)``. ``collector``: the metrics' series (default: the
    servicer's own counters). ``StartupError`` for an address or port it cannot use."""
    metrics = start_metrics(config, servicer, collector)
    logger = LoggingInterceptor(metrics, summary_s=config.log_summary_s)
    interceptors: list[grpc.aio.ServerInterceptor] = [logger]
    if config.token:
        interceptors.append(TokenInterceptor(config.token))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config))
    server.add_generic_rpc_handlers((generic_handler(servicer),))
    health = introspection.add_health(server)
    introspection.add_reflection(server, (SERVICE_NAME,))
    extra: list[grpc.aio.Server] = []
    try:
        address = bind(server, config)
        if config.health_port:
            extra.append(await health_server(config, health))
        await server.start()
    except BaseException:
        for s in (server, *extra):
            await s.stop(0)
        if metrics is not None:
            metrics.close()
        raise
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return Server(config, servicer, server, health, address, logger, extra, metrics)


async def serve_until_stopped(server: Server, *, tasks: Sequence[Coroutine[Any, Any, Any]] = (),
                              stop: asyncio.Event | None = None,
                              signals: Sequence[signal.Signals] = STOP_SIGNALS,
                              alongside: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until one of ``signals`` (or ``stop`` is set); run ``tasks`` until then; drain
    (``alongside()`` runs during the drain)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    running = [asyncio.create_task(t) for t in tasks]
    await stop.wait()
    log.info("draining for up to %.1fs", server.config.grace_s)
    for task in running:
        task.cancel()
    await server.drain(alongside() if alongside is not None else None)
    log.info("stopped")


def bind(server: grpc.aio.Server, config: ServerConfig) -> str:
    """Listen on ``--unix`` or ``--host``/``--port``; the address clients dial."""
    if config.unix:
        path = Path(config.unix).resolve()  # preflight removed a stale socket, refused others
        _add_port(server, config, f"unix:{path}", f"--unix {str(path)!r}")
        return f"unix://{path}"
    port = _add_port(server, config, f"{config.host}:{config.port}", f"--port {config.port}")
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{host}:{port}"


def _add_port(server: grpc.aio.Server, config: ServerConfig, where: str, flag: str) -> int:
    try:
        if not config.tls:
            return int(server.add_insecure_port(where))
        key = Path(config.tls_key).read_bytes()
        cert = Path(config.tls_cert).read_bytes()
        ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
        creds = grpc.ssl_server_credentials(((key, cert),), root_certificates=ca,
                                            require_client_auth=ca is not None)
        return int(server.add_secure_port(where, creds))
    except (RuntimeError, OSError) as exc:
        raise StartupError(f"{flag}: cannot listen on {where} (in use, not permitted, or not "
                           f"an address of this host: {exc})") from None


async def health_server(config: ServerConfig, servicer: Any) -> grpc.aio.Server:
    """Plaintext health only, for Kubernetes probes when the main port speaks TLS."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    where = f"{config.host}:{config.health_port}"
    try:
        server.add_insecure_port(where)
    except RuntimeError as exc:
        raise StartupError(f"--health-port {config.health_port}: cannot listen on {where} "
                           f"({exc})") from None
    await server.start()
    return server


def start_metrics(config: ServerConfig, servicer: Servicer,
                  collector: Collector | None = None) -> Metrics | None:
    """The Prometheus endpoint of ``--metrics-port`` (none without it)."""
    if not config.metrics_port:
        return None
    try:
        return Metrics.start(config, servicer, collector)
    except OSError as exc:
        raise StartupError(f"--metrics-port {config.metrics_port}: cannot listen on "
                           f"{config.metrics_host}:{config.metrics_port} ({exc.strerror})") \
            from None


def tune_allocator() -> None:
    """Keep response-sized buffers on the heap, where freed memory is reused.

    glibc puts blocks over its mmap threshold (128 KiB at first) in mappings of their own:
    every response, output array and gRPC copy then starts on fresh pages, and the kernel's
    page faults and page zeroing were half the daemon's CPU with camera bytes (``perf``:
    47% of it in the kernel, 6.5% in page faults from ``memmove``). A fixed 4 MiB threshold
    serves a batch's blocks (1-3 MB for 64 samples of the mecka keymap) from the heap, reused
    from batch to batch, while larger ones still get a mapping that is returned when freed.
    What the heap keeps is bounded by the bytes in flight (``--max-buffered-bytes``); a free
    heap top of 64 MiB or more goes back to the system, and so do the heap's free pages once
    a burst of held responses ends or a built response is refused (``core/heap.py``). Two
    arenas bound the per-thread heaps.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    mallopt(m_mmap_threshold, MMAP_THRESHOLD)
    mallopt(m_trim_threshold, TRIM_THRESHOLD)
    mallopt(m_arena_max, 2)


MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 64 << 20
