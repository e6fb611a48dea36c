"""The gRPC service: request bytes in, response bytes out, every error mapped to a status.

Handlers take raw bytes (no generated deserializer), so a request that is not a valid
message becomes INVALID_ARGUMENT here instead of an opaque INTERNAL inside grpc.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc

from episerve_proto.contract import (
    EPISODE_TRAILER,
    ERROR_TRAILER,
    KEY_TRAILER,
    METHODS,
    SERVICE_NAME,
)
from episerve_proto.errors import (
    EpiserveError,
    EpisodeNotFound,
    InternalError,
    LimitExceeded,
    Overloaded,
    Unavailable,
    UnknownKeymap,
)
from episerve_server.config import ServerConfig
from episerve_server.core.keymap import Keymap
from episerve_server.core.stats import Stats
from episerve_server.plan.planner import Planner, ReadOptions
from episerve_server.rpc import convert, wire
from episerve_server.storage.catalog import Catalog

log = logging.getLogger(__name__)

MAX_KEYMAPS = 1024
OFFLOAD_ENCODE_BYTES = 1 << 20

Handler = Callable[["EpiserveService", bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def error_metadata(exc: EpiserveError) -> tuple[tuple[str, str | bytes], ...]:
    return (
        (ERROR_TRAILER, type(exc).__name__),
        (EPISODE_TRAILER, exc.episode.encode()),
        (KEY_TRAILER, exc.key.encode()),
    )


def _rpc(fn: Handler) -> Handler:
    """Run a handler; map domain errors to their status, and anything else to a clear one."""

    @functools.wraps(fn)
    async def run(self: EpiserveService, request: bytes,
                  context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await fn(self, request, context)
        except EpiserveError as exc:
            error = exc
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("unexpected error in %s", fn.__name__)
            error = InternalError(
                f"the daemon could not serve this request ({type(exc).__name__}: {exc}); "
                "this is a bug, please report it with the daemon's log"
            )
        if error.code not in ("CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"):
            log.warning("%s failed: %s %s", fn.__name__, error.code, error.message)
        await context.abort(grpc.StatusCode[error.code], error.message, error_metadata(error))
        raise AssertionError("unreachable")  # abort raises

    return run


class EpiserveService:
    def __init__(self, config: ServerConfig, catalog: Catalog, planner: Planner,
                 stats: Stats) -> None:
        self.config, self.catalog, self.planner, self.stats = config, catalog, planner, stats
        self.keymaps: OrderedDict[str, Keymap] = OrderedDict()
        self.draining = False
        self.inflight = 0
        self.on_batch: Callable[[int], None] | None = None  # samples per successful Read
        self._last_scan = 0.0
        self._scan_lock = asyncio.Lock()

    def handlers(self) -> grpc.GenericRpcHandler:
        methods = {
            "ListEpisodes": self.list_episodes,
            "RegisterKeymap": self.register_keymap,
            "Read": self.read,
            "GetStats": self.get_stats,
        }
        assert tuple(methods) == METHODS
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()},
        )

    async def rescan(self, since: float | None = None) -> None:
        """Rescan the root, unless a scan that started after ``since`` already ran.

        Concurrent callers coalesce onto one scan: a storm of unknown ids lists the root
        once, not once per request.
        """
        since = time.monotonic() if since is None else since
        async with self._scan_lock:
            if self._last_scan > since:
                return
            self._last_scan = time.monotonic()
            await self.catalog.scan()

    @_rpc
    async def list_episodes(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        convert.parse_empty(request, "ListEpisodes")
        await self.rescan()
        return convert.encode_listing(self.catalog.healthy(), self.catalog.broken_listing())

    @_rpc
    async def register_keymap(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        keymap = convert.parse_register(request)
        self._check_windows(keymap)
        kid = convert.keymap_id(keymap)
        self.keymaps[kid] = keymap
        self.keymaps.move_to_end(kid)
        while len(self.keymaps) > MAX_KEYMAPS:
            self.keymaps.popitem(last=False)
        return convert.encode_keymap_id(kid)

    @_rpc
    async def get_stats(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        convert.parse_empty(request, "GetStats")
        snapshot = self.stats.snapshot()
        snapshot["episodes_open"] = len(self.catalog.healthy())
        snapshot["episodes_broken"] = len(self.catalog.broken_listing())
        snapshot["reads_in_flight"] = self.inflight
        return convert.encode_stats(snapshot)

    @_rpc
    async def read(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if self.draining:
            raise Unavailable("the daemon is shutting down; retry against another replica")
        if self.inflight >= self.config.max_concurrent_reads:
            raise Overloaded(
                f"{self.inflight} reads in flight, the limit is "
                f"{self.config.max_concurrent_reads}; back off and retry"
            )
        self.inflight += 1
        start = time.perf_counter_ns()
        try:
            data = await self._read(request)
        finally:
            self.inflight -= 1
        self.stats.read_ns += time.perf_counter_ns() - start
        return data

    async def _read(self, request: bytes) -> bytes:
        arrived = time.monotonic()
        call = convert.parse_read(request)
        if len(call.samples) > self.config.max_batch:
            raise LimitExceeded(
                f"a batch of {len(call.samples)} samples is over the limit of "
                f"{self.config.max_batch}; split it into smaller reads"
            )
        keymap = call.keymap if call.keymap is not None else self._registered(call.keymap_id)
        self._check_windows(keymap)
        limit = self.config.max_response_bytes
        if call.max_response_bytes:
            limit = min(limit, call.max_response_bytes)
        options = ReadOptions(call.annotation_cutoff, limit)
        try:
            result = await self.planner.read(keymap, call.samples, options)
        except EpisodeNotFound:
            await self.rescan(arrived)  # an episode added since the last scan is readable
            result = await self.planner.read(keymap, call.samples, options)
        if result.nbytes >= OFFLOAD_ENCODE_BYTES:
            data = await asyncio.to_thread(wire.encode_result, result)
        else:
            data = wire.encode_result(result)
        self.stats.read_rpcs += 1
        self.stats.bytes_sent += len(data)
        if self.on_batch is not None:
            self.on_batch(len(call.samples))
        return data

    def _registered(self, kid: str) -> Keymap:
        keymap = self.keymaps.get(kid)
        if keymap is None:
            raise UnknownKeymap(f"keymap id {kid!r} is not registered on this daemon; "
                                "register the keymap again")
        return keymap

    def _check_windows(self, keymap: Keymap) -> None:
        for e in keymap:
            if e.length > self.config.max_window:
                raise LimitExceeded(
                    f"output key {e.name!r}: a window of {e.length} rows is over the "
                    f"limit of {self.config.max_window}", key=e.zarr_key,
                )

