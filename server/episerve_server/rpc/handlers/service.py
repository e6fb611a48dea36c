"""The service's handlers: request bytes in, response bytes out, the project's errors
raised (each transport answers them its own way: ``handlers/servicer``).

Handlers take raw bytes (no generated deserializer), so a request that is not a valid
message becomes INVALID_ARGUMENT here instead of an opaque INTERNAL inside grpc.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from episerve_proto import routing
from episerve_proto.contract import METHODS
from episerve_proto.errors import (
    DataLossError,
    EpisodeNotFound,
    LimitExceeded,
    UnknownKeymap,
    shown,
)
from episerve_server.config import ServerConfig
from episerve_server.core.counters import Stats
from episerve_server.core.keymap import Keymap
from episerve_server.plan.options import ReadOptions
from episerve_server.plan.planner import Planner
from episerve_server.plan.read_ahead import Background
from episerve_server.rpc.handlers.admission import Admission
from episerve_server.rpc.handlers.buffers import ResponseBuffers
from episerve_server.rpc.handlers.registry import KeymapRegistry
from episerve_server.rpc.handlers.servicer import AnswerWriter, Call, Handler, handlers
from episerve_server.rpc.handlers.status import release_chain
from episerve_server.rpc.wire import messages
from episerve_server.statistics.key_statistics import MAX_KEYS, KeyStatsEngine
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.keycheck import check_keymap, merged

CHECK_SLICE = 50  # episodes checked against a keymap between yields to the event loop
#: RegisterKeymap calls served at once; the others wait their turn (concurrent ones would
#: each put a parse or a check slice on every loop turn).
KEYMAP_REGISTRATIONS = 1
#: A RegisterKeymap request over this size (a keymap of ~40 entries or more) is parsed in
#: a worker thread.
OFFLOAD_KEYMAP_BYTES = 4 << 10
#: A ListEpisodes request over this size (a long ``hashes`` filter) is parsed in a worker
#: thread, one such at a time; on the loop, 65,536 ids took ~15 ms.
OFFLOAD_PARSE_BYTES = 64 << 10
#: A ListEpisodes page is filled up to this many bytes: well under MAX_MESSAGE_BYTES, and
#: small enough that encoding one page never keeps health waiting (measured: 16 MiB pages
#: of 200 kB attributes delayed health by 260 ms; 4 MiB pages do not).
LIST_PAGE_BYTES = 4 * 2**20


class EpiserveService:
    def __init__(self, config: ServerConfig, catalog: Catalog, planner: Planner,
                 stats: Stats, *, key_stats: KeyStatsEngine | None = None,
                 background: Background | None = None) -> None:
        self.config, self.catalog, self.planner, self.stats = config, catalog, planner, stats
        self.background = background  # prefetch hints (none: hints are counted, not read)
        self.key_stats = key_stats if key_stats is not None else KeyStatsEngine(
            catalog, planner, planner.cache, config.stats_cache_bytes)
        self.keymaps = KeymapRegistry(config.max_registry_bytes)
        self.buffers = ResponseBuffers(config.max_buffered_bytes,
                                       config.max_buffered_bytes_per_peer)
        self.limits = messages.Limits.of(config)
        self.admission = Admission(config.max_concurrent_reads, self.buffers)
        #: The local plane's socket once it listens (``GetTopology`` advertises it).
        self.local_plane = ""
        self.on_batch: Callable[[int], None] | None = None  # samples per successful Read
        #: More GetStats counters (the local plane's connections and segments).
        self.gauges: list[Callable[[], dict[str, int]]] = []
        self._last_scan = 0.0
        self._scan_lock = asyncio.Lock()
        self._registrations = asyncio.Semaphore(KEYMAP_REGISTRATIONS)
        self._heavy_parse = asyncio.Semaphore(1)
        self._windows_checked: Keymap | None = None  # the keymap last found within --max-window

    def methods(self) -> dict[str, Handler]:
        """Every method of the contract, by name (the gRPC server and the local plane)."""
        return handlers(self, METHODS)  # raises unless every method of the contract is served

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

    async def list_episodes(self, request: bytes, rpc: Call) -> bytes:
        if len(request) > OFFLOAD_PARSE_BYTES:
            async with self._heavy_parse:
                page = await asyncio.to_thread(messages.parse_list, request)
        else:
            page = messages.parse_list(request)
        del request
        if not page.token:  # the first page rescans; later ones continue by hash
            await self.rescan()
        if page.brief:
            self.stats.listing_pages_brief += 1
        else:
            self.stats.listing_pages_full += 1
        healthy, broken = self.catalog.healthy(), self.catalog.broken_listing()
        return await asyncio.to_thread(messages.encode_listing, healthy, broken, page,
                                       LIST_PAGE_BYTES)

    async def register_keymap(self, request: bytes, rpc: Call) -> bytes:
        # One registration at a time: parsing a keymap of 128 entries is ~10-30 ms of
        # Python, and 64 parsed back to back kept health waiting for all of them. A large
        # one is parsed in a worker thread (the loop keeps its turns at the GIL).
        async with self._registrations:
            if len(request) > OFFLOAD_KEYMAP_BYTES:
                call = await asyncio.to_thread(messages.parse_register, request, self.limits)
            else:
                call = messages.parse_register(request, self.limits)
            del request
            self._check_windows(call.keymap)
            kid = messages.keymap_id(call.keymap)
            self.keymaps.add(kid, call.keymap, call.wire_bytes)
            if not call.check_episodes:
                return messages.encode_keymap_id(kid)
            # Every healthy episode, as the listing shows them (broken ones are listed
            # there). At 1,600 episodes the check takes ~14 ms and answers ~29 kB (measured
            # over benchmarks/bench_dataset_build.py's root); it yields every slice.
            episodes = list(self.catalog.healthy())
            parts = []
            for start in range(0, len(episodes), CHECK_SLICE):
                parts.append(check_keymap(call.keymap, episodes[start: start + CHECK_SLICE]))
                await asyncio.sleep(0)
            check = merged(parts)
            self.stats.keymap_checks += 1
        return messages.encode_keymap_check(kid, check)

    async def get_stats(self, request: bytes, rpc: Call) -> bytes:
        messages.parse_empty(request, "GetStats")
        snapshot = self.stats.snapshot()
        snapshot["episodes_open"] = len(self.catalog.healthy())
        snapshot["episodes_broken"] = len(self.catalog.broken_listing())
        snapshot["reads_in_flight"] = self.admission.inflight
        snapshot["buffered_bytes"] = self.buffers.total
        snapshot["keymaps_registered"] = len(self.keymaps)
        snapshot["keymap_registry_bytes"] = self.keymaps.nbytes
        snapshot["keymap_evictions"] = self.keymaps.evictions
        snapshot.update(self.key_stats.counters())
        for gauge in self.gauges:
            snapshot.update(gauge())
        return messages.encode_stats(snapshot)

    async def get_key_stats(self, request: bytes, rpc: Call) -> bytes:
        arrived = time.monotonic()
        call = messages.parse_key_stats(request, MAX_KEYS)
        if not call.episodes:  # every episode: pick up the ones added since the last scan
            await self.rescan()
        try:
            results = await self.key_stats.compute(call.keys, call.episodes)
        except EpisodeNotFound as exc:
            release_chain(exc)
            await self.rescan(arrived)
            results = await self.key_stats.compute(call.keys, call.episodes)
        return messages.encode_key_stats(results)

    async def get_topology(self, request: bytes, rpc: Call) -> bytes:
        """One process serves every episode: no workers to route to; and its local plane."""
        messages.parse_empty(request, "GetTopology")
        return messages.encode_topology((), routing.ROUTING, self.local_plane)

    async def read(self, request: bytes, rpc: Call) -> Any:
        """One Read, whatever carries it: admission (drain, concurrency, the peer's
        buffers), parsing, the planner (gathering into the writer's arena), then the
        batch laid out by the call's writer, the prefetch hint and the counters. Returns
        what the writer wrote."""
        peer = rpc.peer() or ""
        writer = rpc.writer
        self.admission.enter(peer)
        start = time.perf_counter_ns()
        reserved: list[Callable[[object], None]] = []

        def admit(nbytes: int) -> None:
            reserved.append(self.buffers.reserve(peer, nbytes))

        try:
            out = await self._read(request, admit, writer, peer)
        finally:
            self.admission.leave()
            for release in reserved:
                release(None)
        self.stats.read_ns += time.perf_counter_ns() - start
        return out

    async def _read(self, request: bytes, admit: Callable[[int], None],
                    writer: AnswerWriter, peer: str = "") -> Any:
        arrived = time.monotonic()
        call = messages.parse_read(request, self.limits)
        del request
        keymap = call.keymap if call.keymap is not None else self._registered(call.keymap_id)
        self._check_windows(keymap)
        limit = self.config.max_response_bytes
        if call.max_response_bytes:
            limit = min(limit, call.max_response_bytes)
        options = ReadOptions(call.annotation_cutoff, limit, admit, all_masks=call.all_masks,
                              arena=writer.arena)
        try:
            result = await self.planner.read(keymap, call.samples, options)
        except EpisodeNotFound as exc:
            release_chain(exc)
            await self.rescan(arrived)  # an episode added since the last scan is readable
            result = await self.planner.read(keymap, call.samples, options)
        except DataLossError as exc:
            # Files rewritten under an open episode read as data loss: if they changed, the
            # episode is reopened (its cache entries dropped) and the read is tried again.
            if not exc.episode or not await self.catalog.recheck(exc.episode):
                raise
            release_chain(exc)
            result = await self.planner.read(keymap, call.samples, options)
        data, nbytes = await writer.write(result)
        del result
        self._hint(call, keymap, peer)
        self.stats.read_rpcs += 1
        self.stats.bytes_sent += nbytes
        if self.on_batch is not None:
            self.on_batch(len(call.samples))
        return data

    def _hint(self, call: messages.ReadCall, keymap: Keymap, peer: str) -> None:
        """Queue a Read's prefetch hint, once the read itself is served; never an error."""
        if call.prefetch_refused:
            self.stats.prefetch_hinted_samples += call.prefetch_refused
            self.stats.prefetch_dropped += call.prefetch_refused
        if call.prefetch and self.background is not None:
            self.background.hint(keymap, call.prefetch, peer)

    def _registered(self, kid: str) -> Keymap:
        keymap = self.keymaps.get(kid)
        if keymap is None:
            raise UnknownKeymap(f"keymap id {shown(kid)} is not registered on this daemon; "
                                "register the keymap again")
        return keymap

    def _check_windows(self, keymap: Keymap) -> None:
        if keymap is self._windows_checked:  # a worker's batches use one keymap object
            return
        for e in keymap:
            if e.length > self.config.max_window:
                raise LimitExceeded(
                    f"output key {shown(e.name)}: a window of {e.length} rows is over the "
                    f"limit of {self.config.max_window} (--max-window)", key=e.zarr_key,
                )
        self._windows_checked = keymap
