"""The single-process daemon: the read core and its service, run by the one serve path
(``rpc/process/server``), with the local plane beside it on ``<--unix>.local``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from episerve_server import preflight
from episerve_server.config import ServerConfig
from episerve_server.core.collector import COLLECTOR
from episerve_server.core.counters import Stats
from episerve_server.preflight import StartupError
from episerve_server.rpc.handlers.service import EpiserveService
from episerve_server.rpc.local_plane.plane import LocalPlane
from episerve_server.rpc.process import server
from episerve_server.storage.sources import LayoutError
from episerve_server.storage.zipstore import BadZipRoot
from episerve_server.wiring import build_read_core, spill_evicted

log = logging.getLogger(__name__)


async def start(config: ServerConfig, *, stats: Stats | None = None,
                owns: Callable[[str], bool] | None = None
                ) -> tuple[server.Server, EpiserveService]:
    """Check the settings (``StartupError``), open the root, bind, serve. ``owns`` narrows
    ``--preload`` to the episodes this process serves (a worker of ``--workers N``)."""
    preflight.check(config)
    try:
        core = build_read_core(config, stats=stats)
    except BadZipRoot as exc:
        raise StartupError(str(exc)) from None
    with COLLECTOR.paused():  # full passes over a growing catalog cost ~1.8 s of a 12 s scan
        try:
            await core.catalog.scan()
        except LayoutError as exc:  # a root of no layout, or of several
            raise StartupError(str(exc)) from None
    # The catalog is long-lived: keep the collector from walking it (core/collector.py).
    COLLECTOR.install(asyncio.get_running_loop())
    service = EpiserveService(config, core.catalog, core.planner, core.stats,
                              key_stats=core.key_stats, background=core.background)
    if config.preload == "numeric":  # in the background: health and reads never wait for it
        core.background.start_preload(owns)
    srv = await server.start(config, service)
    if core.spill is not None:  # a drained daemon leaves what its cache held on disk too
        spill, cache = core.spill, core.cache
        everything = spill_evicted(spill, core.catalog, bounded=False)

        async def spill_cache() -> None:
            everything(cache.frame_items())
            await spill.flush(config.grace_s)
            spill.close()

        srv.on_stop.append(spill_cache)
    if config.unix and config.local_plane:
        try:
            plane = await LocalPlane.start(config, service)
        except BaseException:
            await srv.abort()
            raise
        if plane is not None:
            plane.calls = srv.interceptor  # its calls are accounted as gRPC calls are
            service.local_plane = plane.address
            srv.on_stop.append(plane.stop)
    await srv.set_serving(True)
    return srv, service


async def serve(config: ServerConfig, announce: Callable[[str], None]) -> int:
    """One process: serve until SIGTERM/SIGINT, rescanning the root meanwhile; drain."""
    srv, service = await start(config)
    healthy, broken = len(service.catalog.healthy()), len(service.catalog.broken_listing())
    announce(f"episerve listening on {srv.address} ({healthy} episodes, {broken} broken)")
    empty = preflight.empty_root(config, healthy, broken)
    if empty is not None:
        log.warning("%s", empty)
    if (missing := preflight.kernel_missing()) is not None:
        log.warning("%s", missing)
    await server.serve_until_stopped(srv, tasks=[rescan_loop(service, config.rescan_s)])
    return 0


async def rescan_loop(service: EpiserveService, every_s: float) -> None:
    if every_s <= 0:
        return
    while True:
        await asyncio.sleep(every_s)
        try:
            await service.rescan()
        except Exception:
            log.exception("rescan of the root failed; will retry")
