"""Work the daemon does for reads to come: prefetch hints and the start-up preload.

**Hints** (``ReadRequest.prefetch``): samples a caller expects to read soon. After its read
is served, a hint is queued (at most ``MAX_QUEUED_HINTS``; a full queue drops it). One
worker takes hints in order and, once the store has spare slots (no read waiting for one,
at most half in use), plans the hint's chunks as a read would, keeps those neither cached
nor in flight, and fetches them into the cache as one job of the fetcher, so a read that
needs one of them meanwhile waits for that fetch instead of repeating it. At most
``budget_bytes`` of decoded chunks are in flight for hints; a hint over it is dropped, and
so is a hint that waited ``HINT_TTL_S`` for spare slots. A hint is never an error to its
caller: samples the daemon cannot serve (an unknown episode, a frame out of range, a key an
episode lacks) are dropped and counted.

Background fetches hold none of the reads' ``--max-store-concurrency`` slots, so a read
never waits behind one; they start only when the slots are mostly free, and there are at
most ``HINT_JOBS`` hint fetches and one preload fetch at a time.

**Preload** (``--preload numeric``): after the first scan, in the background, every numeric
array of every open episode is fetched into the cache, episode by episode, up to the cache
budget, with the same spare-slot rule, so health and reads never wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from episerve_proto.errors import EpiserveError
from episerve_server.core.keymap import Keymap
from episerve_server.plan.misses import Need

if TYPE_CHECKING:
    from episerve_server.plan.planner import Planner

log = logging.getLogger(__name__)

MAX_QUEUED_HINTS = 64  # hints waiting for the worker; each at most --max-batch samples
HINT_TTL_S = 2.0  # a hint that found no spare store slots for this long is stale
HINT_JOBS = 2  # hint fetches in flight at once
#: Frame chunks are charged to the hint budget at this size (their size is known only once
#: read); numeric chunks at their decoded size.
FRAME_ESTIMATE_BYTES = 256 << 10
PRELOAD_CHUNKS_PER_JOB = 512
POLL_S = 0.002


class Background:
    """The hint queue and its worker, and the preload task, over a planner's fetcher."""

    def __init__(self, planner: Planner, *, budget_bytes: int,
                 max_queue: int = MAX_QUEUED_HINTS) -> None:
        self.planner, self.fetcher = planner, planner.fetcher
        self.stats, self.cache = planner.stats, planner.cache
        self.budget_bytes = budget_bytes
        self.max_queue = max_queue
        self.in_flight_bytes = 0
        self._queue: deque[tuple[Keymap, list[tuple[str, int]], float]] = deque()
        self._jobs = 0
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.preload_task: asyncio.Task[None] | None = None
        self.preload_owns: Callable[[str], bool] | None = None

    @property
    def hints_enabled(self) -> bool:
        return self.budget_bytes > 0 and self.cache.enabled

    # -- hints ------------------------------------------------------------------------------

    def hint(self, keymap: Keymap, samples: Sequence[tuple[str, int]]) -> None:
        """Queue a hint; never raises, never waits."""
        self.stats.prefetch_hinted_samples += len(samples)
        if not self.hints_enabled or len(self._queue) >= self.max_queue:
            self.stats.prefetch_dropped += len(samples)
            return
        self._queue.append((keymap, list(samples), time.monotonic()))
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())
        self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            keymap, samples, since = self._queue.popleft()
            try:
                await self._prefetch(keymap, samples, since)
            except Exception:  # a bug: logged, the hint dropped, the worker lives on
                log.exception("prefetch hint of %d samples failed", len(samples))
                self.stats.prefetch_dropped += len(samples)

    async def _prefetch(self, keymap: Keymap, samples: list[tuple[str, int]],
                        since: float) -> None:
        good = self._servable(samples)
        if not good:
            return
        while not (self.fetcher.spare() and self._jobs < HINT_JOBS):
            if time.monotonic() - since > HINT_TTL_S:
                self.stats.prefetch_dropped += len(good)
                return
            await asyncio.sleep(POLL_S)
        try:
            needs = self.planner.uncached(keymap, good)
        except EpiserveError:  # e.g. a key one of the episodes lacks: the hint is no good
            self.stats.prefetch_dropped += len(good)
            return
        if not needs:
            return
        nbytes = sum(_estimate(n) for n in needs)
        if self.in_flight_bytes + nbytes > self.budget_bytes:
            self.stats.prefetch_dropped += len(good)
            return
        self.in_flight_bytes += nbytes
        self._jobs += 1
        job = self.fetcher.start(needs, count="prefetch_chunks", background=True)
        job.hold()  # reads that join it and leave never cancel it

        def done(_: object) -> None:
            self.in_flight_bytes -= nbytes
            self._jobs -= 1
            job.interest -= 1

        assert job.task is not None
        job.task.add_done_callback(done)

    def _servable(self, samples: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The samples a read could serve; the others are dropped and counted."""
        good = []
        for episode_id, frame in samples:
            try:
                episode = self.planner.catalog.lookup(episode_id)
            except EpiserveError:
                continue
            if 0 <= frame < episode.total_frames:
                good.append((episode_id, frame))
        self.stats.prefetch_dropped += len(samples) - len(good)
        return good

    # -- preload ----------------------------------------------------------------------------

    def start_preload(self, owns: Callable[[str], bool] | None = None) -> asyncio.Task[None]:
        """Preload every healthy episode, or those ``owns`` accepts."""
        self.preload_owns = owns
        self.preload_task = asyncio.ensure_future(self._preload())
        return self.preload_task

    async def _preload(self) -> None:
        try:
            await self._preload_all()
        except Exception:
            log.exception("preload stopped by an unexpected error")

    async def _preload_all(self) -> None:
        owns = self.preload_owns
        episodes = [e for e in self.planner.catalog.healthy() if owns is None or owns(e.hash)]
        if not self.cache.enabled:
            log.warning("--preload numeric: the cache is off (--cache-bytes 0), nothing to do")
            return
        groups: list[list[Need]] = []
        planned = 0
        limit = self.cache.budget_bytes
        for episode in episodes:
            mine = []
            for name in sorted(episode.readers):
                reader = episode.readers[name]
                info = reader.info
                if info.is_bytes:
                    continue
                size = info.chunk_rows * math.prod(info.feature) * 4
                for chunk in range(-(-info.rows // info.chunk_rows)):
                    if planned + size > limit:
                        break
                    planned += size
                    mine.append(Need(reader, chunk))
            if mine:
                groups.append(mine)
        total = sum(len(g) for g in groups)
        self.stats.preload_total = total
        log.info("preload numeric: %d chunks (%.1f MiB decoded) of %d episodes, in the "
                 "background", total, planned / 2**20, len(groups))
        started = time.monotonic()
        failed = 0
        for group in _batches(groups, PRELOAD_CHUNKS_PER_JOB):
            while not self.fetcher.spare():
                await asyncio.sleep(POLL_S)
            needs = [n for n in group if not self.fetcher.in_flight(n.id)
                     and not self._cached(n)]
            if not needs:
                continue
            job = self.fetcher.start(needs, count="preload_chunks", background=True)
            job.hold()
            try:
                assert job.task is not None
                await asyncio.shield(job.task)
            except EpiserveError as exc:
                failed += 1
                log.warning("preload: %s", exc.message)
            finally:
                job.release()
        log.info("preload numeric done: %d of %d chunks in %.1f s (%d groups failed)",
                 self.stats.preload_chunks, total, time.monotonic() - started, failed)

    def _cached(self, need: Need) -> bool:
        info = need.reader.info
        uid = self.cache.uids([info.episode])
        slab, _ = self.cache.lookup(info.name, uid, np.array([need.chunk], np.int64))
        return bool(slab[0] >= 0)


def _estimate(need: Need) -> int:
    info = need.reader.info
    if info.is_bytes:
        return min(info.decoded_bound, FRAME_ESTIMATE_BYTES * info.chunk_rows)
    return info.chunk_rows * math.prod(info.feature) * 4


def _batches(groups: list[list[Need]], size: int) -> list[list[Need]]:
    """Whole episodes per job, about ``size`` chunks a job."""
    out: list[list[Need]] = []
    for group in groups:
        if out and len(out[-1]) + len(group) <= size:
            out[-1].extend(group)
        else:
            out.append(list(group))
    return out
