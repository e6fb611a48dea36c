"""The front of a ``--workers N`` daemon: one logical daemon on the daemon's address.

The front reads nothing itself. It starts the workers (``rpc/process/workers.py``) and answers:

- ``GetTopology``: the workers' addresses and the routing rule, so that a client sends each
  sample straight to the worker that owns its episode (``episerve_proto.routing``);
- ``Read`` for clients that do not route (grpcurl, older clients, clients that cannot reach
  the workers' sockets): split by owner, forwarded in parallel with the caller's deadline,
  each part with its share of the response limit (so an answer over it is refused before
  it is built), merged in request order within the response buffers' budget. That budget
  is reserved before the parts are asked for, from the size per sample of the latest
  answer of the same keymap and options; the first read of its kind goes alone;
- ``RegisterKeymap`` on every worker, remembered and replayed to a worker restarted after
  a crash; ``GetStats`` summed over the workers that serve; ``ListEpisodes`` (and any
  other read-only call) from worker 0, which opens every episode;
- health: ``SERVING`` only while every worker serves and answers its health checks in
  time (a hung worker is ``NOT_SERVING``, its calls end ``UNAVAILABLE``).

Drain (SIGTERM, SIGINT): health ``NOT_SERVING``, new forwarded reads refused, the workers
drain their own reads, then everything stops. A worker that exits is restarted; more than
``MAX_RESTARTS`` exits in a minute stop the daemon with exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from episerve_proto import routing
from episerve_proto.contract import METHODS
from episerve_proto.errors import ResponseTooLarge, Unavailable
from episerve_server import preflight
from episerve_server.config import ServerConfig
from episerve_server.plan.options import too_big
from episerve_server.rpc.handlers.admission import Admission
from episerve_server.rpc.handlers.buffers import Reservation, ResponseBuffers
from episerve_server.rpc.handlers.servicer import Call, Handler, handlers
from episerve_server.rpc.process import server
from episerve_server.rpc.process.metrics import PREFIX, counter_families
from episerve_server.rpc.process.workers import WorkerPool
from episerve_server.rpc.wire import forward, messages
from episerve_server.rpc.wire.encode import OFFLOAD_ENCODE_BYTES

log = logging.getLogger(__name__)

#: A forwarded call without a client deadline gets this long.
DEFAULT_FORWARD_S = 120.0
#: Bytes a merge holds besides its parts, per byte of the answer: the merged arrays, their
#: bytes and the encoded answer (measured: one 62 MB answer took the front's RSS up by
#: ~380 MiB with the parts and gRPC's own copies).
MERGE_COPIES = 3
#: Keymaps (with their options) whose answer size the front remembers.
SIZES_KEPT = 1024
#: Calls the front answers from worker 0 as they are.
PASSED_THROUGH = ("ListEpisodes", "GetKeyStats")


class FrontService:
    def __init__(self, config: ServerConfig, pool: WorkerPool) -> None:
        self.config, self.pool = config, pool
        self.limits = messages.Limits.of(config)
        # Merged responses wait in gRPC until the client reads them, as a worker's do.
        self.buffers = ResponseBuffers(config.max_buffered_bytes,
                                       config.max_buffered_bytes_per_peer)
        self.admission = Admission(config.max_concurrent_reads, self.buffers,
                                   " through the front")
        self.on_batch: Callable[[int], None] | None = None
        owners, n = routing.OwnerCache(), len(pool.workers)
        self._owner: Callable[[str], int] = lambda episode: owners(episode, n)
        # Every keymap registered through the front (its unchecked request, least recently
        # registered first, under --max-registry-bytes), replayed to a restarted worker.
        self.registered: OrderedDict[bytes, None] = OrderedDict()
        self.registered_bytes = 0
        pool.on_restart = self.replay_keymaps
        # The latest answer's bytes per sample, by keymap and options (``ReadFacts.size_key``):
        # a Read's buffer space is reserved from it before its parts are asked for.
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        # Reads of a kind whose size is not known yet go one at a time (``_learner``).
        self._learning: dict[bytes, asyncio.Event] = {}

    def methods(self) -> dict[str, Handler]:
        """Its own handlers, and worker 0's answer for the calls it passes through."""
        methods = handlers(self, [name for name in METHODS if name not in PASSED_THROUGH])
        for name in PASSED_THROUGH:
            methods[name] = _pass_through(self, name)
        assert set(methods) <= set(METHODS)
        return methods

    async def counters(self) -> dict[str, int]:
        return forward.stats_counters(await self._stats(5.0))

    async def _stats(self, timeout_s: float, *, complete: bool = True) -> bytes:
        """The workers' counters summed; with ``complete=False``, over the workers that are
        ready (the others are counted in ``workers_ready`` and ``workers_hung``)."""
        workers = self.pool.workers if complete else [w for w in self.pool.workers if w.ready]
        if not workers:
            raise Unavailable("no worker of the daemon is serving; retry")
        replies = await _all([self.pool.call(w.index, "GetStats", b"", timeout_s)
                              for w in workers])
        extra = {"workers": len(self.pool.workers),
                 "workers_ready": sum(w.ready for w in self.pool.workers),
                 "workers_hung": self.pool.hung,
                 "worker_restarts": self.pool.restarts_total,
                 "worker_hangs": self.pool.hangs_total,
                 "front_reads_in_flight": self.admission.inflight,
                 "front_buffered_bytes": self.buffers.total}
        return forward.merge_stats(replies, extra)

    async def get_topology(self, request: bytes, rpc: Call) -> bytes:
        messages.parse_empty(request, "GetTopology")
        return messages.encode_topology(self.pool.addresses, routing.ROUTING)

    async def get_stats(self, request: bytes, rpc: Call) -> bytes:
        messages.parse_empty(request, "GetStats")
        return await self._stats(_timeout(rpc), complete=False)

    async def register_keymap(self, request: bytes, rpc: Call) -> bytes:
        """On every worker; the answer is worker 0's. Every worker opens every episode, so
        worker 0's check (``check_episodes``) covers all of them, from the same catalog that
        answers ``ListEpisodes``; the other workers only register the keymap."""
        timeout_s = _timeout(rpc)
        others = messages.unchecked_register(request)
        replies = await _all([self.pool.call(w.index, "RegisterKeymap",
                                             request if w.index == 0 else others, timeout_s)
                              for w in self.pool.workers])
        self._remember(others)
        return replies[0]

    def _remember(self, keymap: bytes) -> None:
        if self.registered.pop(keymap, False) is None:
            self.registered_bytes -= len(keymap)
        self.registered[keymap] = None
        self.registered_bytes += len(keymap)
        while self.registered_bytes > self.config.max_registry_bytes and len(self.registered) > 1:
            old, _ = self.registered.popitem(last=False)
            self.registered_bytes -= len(old)

    async def replay_keymaps(self, index: int) -> None:
        """Register every keymap registered through the front on a restarted worker, before
        it serves again: clients holding their ids never meet ``UnknownKeymap``."""
        await self.pool.replay(index, list(self.registered))

    async def read(self, request: bytes, rpc: Call) -> bytes:
        peer = rpc.peer() or ""
        self.admission.enter(peer)
        held = Reservation(self.buffers, peer)
        learning: asyncio.Event | None = None
        try:
            req = forward.parse_read(request)
            parts = forward.split_read(request, self._owner, self.limits, req)
            facts = forward.read_facts(req, self.config.max_response_bytes)
            del request, req
            copies = 1 + MERGE_COPIES if len(parts) > 1 else 1
            learning = await self._learner(facts.size_key)
            if learning is None:  # refused here if over the budget, before any part is asked
                held.grow_to(copies * self._sizes[facts.size_key] * facts.samples)
            limit = facts.limit if len(parts) > 1 else self.config.max_response_bytes
            replies = await self._forward(parts, _timeout(rpc), limit, held.add)
            pieces = [(idx, data) for (_, idx, _), data in zip(parts, replies)]
            del replies
            n = sum(len(idx) for idx, _ in pieces)
            size = sum(len(d) for _, d in pieces)
            self._learn(facts.size_key, size // max(1, n) + 1)
            if len(pieces) > 1:  # the merge's copies, beside the parts
                held.grow_to(copies * size)
            if size >= OFFLOAD_ENCODE_BYTES and len(pieces) > 1:
                data = await asyncio.to_thread(forward.merge_read_responses, pieces, n)
            else:
                data = forward.merge_read_responses(pieces, n)
            del pieces
        finally:
            self.admission.leave()
            held.release()
            if learning is not None:
                if self._learning.get(facts.size_key) is learning:
                    del self._learning[facts.size_key]
                learning.set()
        if self.on_batch is not None:
            self.on_batch(n)
        return data

    async def _learner(self, key: bytes) -> asyncio.Event | None:
        """None once answers of this kind have a known size. Until then such reads go one
        at a time: the one that goes gets the event to set when it is done; the others wait
        for it (and one of them goes next if it learned nothing, a failed read)."""
        while key not in self._sizes:
            busy = self._learning.get(key)
            if busy is None:
                self._learning[key] = done = asyncio.Event()
                return done
            await busy.wait()
        return None

    def _learn(self, key: bytes, per_sample: int) -> None:
        self._sizes.pop(key, None)
        self._sizes[key] = per_sample
        while len(self._sizes) > SIZES_KEPT:
            self._sizes.popitem(last=False)

    async def _forward(self, parts: list[tuple[int, list[int], bytes]], timeout_s: float,
                       limit: int, reserve: Callable[[int], None]) -> list[bytes]:
        """Each part's answer from its worker, in ``parts`` order, their sum within ``limit``.

        The front refuses a merged answer over the limit as one process refuses one
        response over it, and, like it, before the bytes are built: every part is forwarded
        with a limit of its own, its share of ``limit`` by samples, which its worker checks
        before it reads anything. Parts over their share are then asked again one at a time
        with what is left of the limit, so a batch whose parts are uneven is still served
        when its sum fits. The parts held at once are thus never more than ``limit``; each
        is reserved in the response buffers as it arrives (held until the merged answer is
        built), so reads arriving together cannot hold more than ``--max-buffered-bytes``.
        """
        if len(parts) == 1:
            w, _, payload = parts[0]
            return [await self.pool.call(w, "Read", payload, timeout_s)]
        n = sum(len(idx) for _, idx, _ in parts)
        shares = [max(1, limit * len(idx) // n) for _, idx, _ in parts]
        first = await asyncio.gather(
            *(self.pool.call(w, "Read", forward.limited_read(payload, share), timeout_s)
              for (w, _, payload), share in zip(parts, shares)), return_exceptions=True)
        for got in first:
            if isinstance(got, BaseException) and not isinstance(got, ResponseTooLarge):
                raise got
        total = 0
        for got in first:
            if isinstance(got, bytes):
                total += len(got)
                reserve(len(got))
        over = [k for k, got in enumerate(first) if isinstance(got, ResponseTooLarge)]
        for k in over:  # each alone is known to be over its share
            lower = total + sum(shares[j] + 1 for j in over if j >= k)
            left = limit - total
            if lower > limit:
                raise too_big(lower, limit, n, at_least=True)
            w, _, payload = parts[k]
            try:
                data = await self.pool.call(w, "Read", forward.limited_read(payload, left),
                                            timeout_s)
            except ResponseTooLarge:
                raise too_big(total + left + 1, limit, n, at_least=True) from None
            total += len(data)
            reserve(len(data))
            first[k] = data
        return [got for got in first if isinstance(got, bytes)]


def _pass_through(front: FrontService, method: str) -> Handler:
    """A handler that answers ``method`` from worker 0 (which opens every episode)."""

    async def handler(request: bytes, rpc: Call) -> bytes:
        return await front.pool.call(0, method, request, _timeout(rpc))

    return handler


def _timeout(rpc: Call) -> float:
    left = rpc.time_remaining()
    return DEFAULT_FORWARD_S if left is None else max(0.001, left)


async def _all(calls: list[Coroutine[Any, Any, bytes]]) -> list[bytes]:
    """Every call's result, in order; the first failure cancels the others and is raised."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


class FrontCollector(Collector):
    """Prometheus series from the workers' summed counters, read at scrape time."""

    def __init__(self, front: FrontService, loop: asyncio.AbstractEventLoop) -> None:
        self.front, self.loop = front, loop
        self.last: dict[str, int] = {}  # while a worker restarts, the last complete sums

    def collect(self) -> Iterator[Metric]:
        try:
            got = asyncio.run_coroutine_threadsafe(self.front.counters(), self.loop).result(5)
            self.last = got
        except Exception as exc:
            log.warning("metrics: the workers' counters are unavailable (%s)", exc)
            got = self.last
        yield from counter_families(lambda name: got.get(name, 0))
        pool = self.front.pool
        gauges = (
            ("cache_bytes", "Bytes held by the chunk caches.", got.get("cache_bytes", 0)),
            ("cache_entries", "Chunks held by the chunk caches.", got.get("cache_entries", 0)),
            ("cache_budget_bytes", "The chunk cache's budget (--cache-bytes).",
             self.front.config.cache_bytes),
            ("episode_state_bytes", "Bytes charged for what the episodes' files declare, "
             "in all workers.", got.get("episode_state_bytes", 0)),
            ("episode_state_budget_bytes", "Their budget: --episode-state-bytes per "
             "worker.", self.front.config.episode_state_bytes * len(pool.workers)),
            ("episodes_open", "Episodes open and readable.", got.get("episodes_open", 0)),
            ("episodes_broken", "Episodes listed as broken.", got.get("episodes_broken", 0)),
            ("reads_in_flight", "Read RPCs in progress.", got.get("reads_in_flight", 0)),
            ("draining", "1 while the daemon drains before stopping.",
             int(self.front.admission.draining)),
            ("workers", "Worker processes (--workers).", len(pool.workers)),
            ("workers_ready", "Worker processes serving.", sum(w.ready for w in pool.workers)),
            ("worker_restarts", "Worker processes restarted after they exited.",
             pool.restarts_total),
            ("workers_hung", "Worker processes running but missing their health checks.",
             pool.hung),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)


async def serve(config: ServerConfig, announce: Callable[[str], None]) -> int:
    """Start the workers, then serve the front until SIGTERM/SIGINT; drain; stop. Exit code
    1 when the workers exited too often (``MAX_RESTARTS``)."""
    preflight.check(config)
    pool = WorkerPool.create(config)
    try:
        await pool.start()
    except BaseException:
        await pool.stop(0)
        raise
    front = FrontService(config, pool)
    try:
        srv = await server.start(config, front,
                                 collector=FrontCollector(front, asyncio.get_running_loop()))
    except BaseException:
        await pool.stop(0)
        raise

    async def set_health() -> None:
        await srv.set_serving(pool.all_ready and not front.admission.draining)

    await set_health()
    counters = await front.counters()
    announce(f"episerve listening on {srv.address} ({len(pool.workers)} workers, "
             f"{counters.get('episodes_open', 0)} episodes, "
             f"{counters.get('episodes_broken', 0)} broken)")
    empty = preflight.empty_root(config, counters.get("episodes_open", 0),
                                 counters.get("episodes_broken", 0))
    if empty is not None:
        log.warning("%s", empty)
    if (missing := preflight.kernel_missing()) is not None:
        log.warning("%s", missing)
    stop = asyncio.Event()
    exit_code = 0

    async def give_up() -> None:
        nonlocal exit_code
        exit_code = 1
        stop.set()

    watch = asyncio.create_task(pool.watch(set_health, give_up))
    probe = asyncio.create_task(pool.probe(set_health))

    async def stop_workers() -> None:  # while the front's own reads finish
        await pool.stop(config.grace_s)
        watch.cancel()
        probe.cancel()

    await server.serve_until_stopped(srv, stop=stop, alongside=stop_workers)
    return exit_code
