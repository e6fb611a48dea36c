"""Daemon start-up, serving and drain: grpc.aio on uvloop, with health and reflection."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from episerve_proto.contract import (
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    MIN_PING_INTERVAL_MS,
    SERVICE_NAME,
)
from episerve_proto.v1 import episerve_pb2
from episerve_server.config import ServerConfig
from episerve_server.core.collector import COLLECTOR
from episerve_server.core.stats import Stats
from episerve_server.rpc import introspection, logs, preflight
from episerve_server.rpc.interceptors import LoggingInterceptor, RpcSummary, TokenInterceptor
from episerve_server.rpc.preflight import StartupError
from episerve_server.rpc.service import EpiserveService
from episerve_server.wiring import build_read_core

log = logging.getLogger(__name__)

__all__ = ["SERVER_OPTIONS", "Daemon", "StartupError", "run", "serve", "server_options",
           "start"]

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
class Daemon:
    config: ServerConfig
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service: EpiserveService
    address: str
    extra_servers: list[Any]
    metrics: Any = None
    summary: RpcSummary | None = None
    local: Any = None  # the local plane (rpc/local.py), with --unix unless turned off

    async def drain(self) -> None:
        """Health NOT_SERVING, refuse new reads, let in-flight reads finish, then stop."""
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.config.grace_s
        while self.service.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.server.stop(max(0.1, deadline - time.monotonic()))
        if self.local is not None:
            await self.local.stop()
        for extra in self.extra_servers:
            await extra.stop(0)
        if self.metrics is not None:
            self.metrics.close()
        if self.summary is not None:  # the RPCs of the last interval
            self.summary.flush()


async def start(config: ServerConfig, *, stats: Stats | None = None,
                owns: Callable[[str], bool] | None = None) -> Daemon:
    """Check the settings (``StartupError``), open the root, bind, serve. ``owns`` narrows
    ``--preload`` to the episodes this process serves (a worker of ``--workers N``)."""
    preflight.check(config)
    core = build_read_core(config, stats=stats)
    with COLLECTOR.paused():  # full passes over a growing catalog cost ~1.8 s of a 12 s scan
        await core.catalog.scan()
    # The catalog is long-lived: keep the collector from walking it (core/collector.py).
    COLLECTOR.install(asyncio.get_running_loop())
    service = EpiserveService(config, core.catalog, core.planner, core.stats,
                              key_stats=core.key_stats)
    if config.preload == "numeric":  # in the background: health and reads never wait for it
        core.background.start_preload(owns)
    metrics = _metrics(config, service)
    logging_interceptor = LoggingInterceptor(metrics, summary_s=config.log_summary_s)
    interceptors: list[grpc.aio.ServerInterceptor] = [logging_interceptor]
    if config.token:
        interceptors.append(TokenInterceptor(config.token))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config))
    server.add_generic_rpc_handlers((service.handlers(),))
    health_servicer = introspection.add_health(server)
    introspection.add_reflection(server, (SERVICE_NAME,))
    assert episerve_pb2.DESCRIPTOR.services_by_name["EpiServe"]
    extra: list[Any] = []
    plane = None
    try:
        address = _bind(server, config)
        if config.health_port:
            extra.append(await _health_server(config, health_servicer))
        await server.start()
        if config.unix and config.local_plane:
            from episerve_server.rpc.local import LocalPlane

            plane = await LocalPlane.start(config, service)
            if plane is not None:
                plane.calls = logging_interceptor
    except StartupError:
        for s in (server, *extra):
            await s.stop(0)
        if metrics is not None:
            metrics.close()
        raise
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Daemon(config, server, health_servicer, service, address, extra, metrics,
                  logging_interceptor.summary, plane)


def _bind(server: grpc.aio.Server, config: ServerConfig) -> str:
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


async def _health_server(config: ServerConfig, servicer: Any) -> grpc.aio.Server:
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


def _metrics(config: ServerConfig, service: EpiserveService) -> Any:
    if not config.metrics_port:
        return None
    from episerve_server.rpc.metrics import Metrics

    try:
        return Metrics.start(config, service)
    except OSError as exc:
        raise StartupError(f"--metrics-port {config.metrics_port}: cannot listen on "
                           f"{config.metrics_host}:{config.metrics_port} ({exc.strerror})") \
            from None


async def serve(config: ServerConfig, *, announce: Callable[[str], None] = print) -> int:
    if config.worker_count > 1:  # a front and N worker processes (rpc/front.py)
        from episerve_server.rpc import front

        return await front.serve(config, announce)
    daemon = await start(config)
    catalog = daemon.service.catalog
    announce(f"episerve listening on {daemon.address} "
             f"({len(catalog.healthy())} episodes, {len(catalog.broken_listing())} broken)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rescans = asyncio.create_task(_rescan_loop(daemon.service, config.rescan_s))
    await stop.wait()
    log.info("draining for up to %.1fs", config.grace_s)
    rescans.cancel()
    await daemon.drain()
    log.info("stopped")
    return 0


async def _rescan_loop(service: EpiserveService, every_s: float) -> None:
    if every_s <= 0:
        return
    while True:
        await asyncio.sleep(every_s)
        try:
            await service.rescan()
        except Exception:
            log.exception("rescan of the root failed; will retry")


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


def run(config: ServerConfig) -> int:
    tune_allocator()
    logs.configure(config.log_level, config.log_format)
    import uvloop

    return uvloop.run(serve(config, announce=lambda line: print(line, flush=True)))
