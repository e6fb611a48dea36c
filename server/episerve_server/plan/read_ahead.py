"""Work the daemon does for reads to come: prefetch hints and the start-up preload.

**Hints** (``ReadRequest.prefetch``): samples a caller expects to read soon. After its read
is served, a hint is queued (at most ``MAX_QUEUED_HINTS``; a full queue drops it). One
worker takes hints in order and, once the store has spare slots (no read waiting for one,
at most half in use), plans the hint's chunks as a read would, marks its frame chunks as
wanted in the cache (kept ahead of frames no read to come uses), keeps those neither
cached nor in flight, and fetches them into the cache as one job of the fetcher, so a read
that needs one of them meanwhile waits for that fetch instead of repeating it. At most
``budget_bytes`` of decoded chunks are in flight for hints; a hint over it is dropped, and
so is a hint that waited ``HINT_TTL_S`` for spare slots. A hint is never an error to its
caller: samples the daemon cannot serve (an unknown episode, a frame out of range, a key an
episode lacks) are dropped and counted.

A hint is admitted as a read is, before anything is built: its estimated response size
(samples x window rows x row size, from the first episode it names) must be within
``--max-response-bytes``, and its planning cost (samples x window rows of the keymap) must
fit ``HINT_PEER_CELLS`` queued per connection and ``HINT_TOTAL_CELLS`` queued in all. A hint
over any of them is dropped and counted in ``prefetch_over_budget``. An admitted hint is
planned in slices of about ``PLAN_SLICE_CELLS`` window rows, with the loop served between
them, so health and reads never wait behind one.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from episerve_proto.errors import EpiserveError
from episerve_server.core.framecache import ChunkKey
from episerve_server.core.keymap import Keymap, Rule
from episerve_server.plan.fetcher import Need
from episerve_server.storage.readers import ChunkReader

if TYPE_CHECKING:
    from episerve_server.plan.planner import Planner

log = logging.getLogger(__name__)

MAX_QUEUED_HINTS = 64  # hints waiting for the worker; each at most --max-batch samples
HINT_TTL_S = 2.0  # a hint that found no spare store slots for this long is stale
HINT_JOBS = 2  # hint fetches in flight at once
#: Frame chunks are charged to the hint budget at this size (their size is known only once
#: read); numeric chunks at their decoded size.
FRAME_ESTIMATE_BYTES = 256 << 10
#: Planning budgets, in window rows (samples x rows per sample over the keymap's windows;
#: about 20 bytes of planner arrays each): queued per connection, queued in all, and
#: planned between two yields to the event loop (a slice plans in about a millisecond).
HINT_PEER_CELLS = 8 << 20
HINT_TOTAL_CELLS = 32 << 20
PLAN_SLICE_CELLS = 64 << 10
#: Chunks of one preload job: its decode runs in a worker thread, but its chunks go into
#: the cache on the loop in one pass (at 512 a job, reads waited ~300 ms at p99; at 16,
#: ~25 ms).
PRELOAD_CHUNKS_PER_JOB = 16
#: What a preloaded chunk costs beside its data: its slot's bookkeeping and table entry.
PRELOAD_CHUNK_OVERHEAD = 64
PRELOAD_PLAN_SLICE = 64  # episodes planned between yields to the loop
POLL_S = 0.002


class Background:
    """The hint queue and its worker, and the preload task, over a planner's fetcher."""

    max_queue, peer_cells, total_cells = MAX_QUEUED_HINTS, HINT_PEER_CELLS, HINT_TOTAL_CELLS

    def __init__(self, planner: Planner, *, budget_bytes: int, response_limit: int = 0) -> None:
        self.planner, self.fetcher = planner, planner.fetcher
        self.stats, self.cache = planner.stats, planner.cache
        self.budget_bytes = budget_bytes
        self.response_limit = response_limit  # 0: no limit
        self.in_flight_bytes = 0
        self.queued_cells = 0
        self._peer_cells: dict[str, int] = {}
        self._queue: deque[_Hint] = deque()
        self._jobs = 0
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.preload_task: asyncio.Task[None] | None = None
        self.preload_owns: Callable[[str], bool] | None = None

    @property
    def hints_enabled(self) -> bool:
        return self.budget_bytes > 0 and self.cache.enabled

    # -- hints ------------------------------------------------------------------------------

    def hint(self, keymap: Keymap, samples: Sequence[tuple[str, int]], peer: str = "") -> None:
        """Queue a hint from connection ``peer``; never raises, never waits."""
        self.stats.prefetch_hinted_samples += len(samples)
        if not self.hints_enabled or len(self._queue) >= self.max_queue:
            self.stats.prefetch_dropped += len(samples)
            return
        good = self._servable(list(samples))
        if not good:
            return
        cells = len(good) * sum(e.length for e in keymap if e.rule is not Rule.ANNOTATION)
        mine = self._peer_cells.get(peer, 0)
        if (cells + mine > self.peer_cells or cells + self.queued_cells > self.total_cells
                or not self._admitted(keymap, good)):
            self.stats.prefetch_over_budget += len(good)
            self.stats.prefetch_dropped += len(good)
            return
        self._peer_cells[peer] = mine + cells
        self.queued_cells += cells
        self._queue.append(_Hint(keymap, good, time.monotonic(), peer, cells))
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
            item = self._queue.popleft()
            try:
                await self._prefetch(item.keymap, item.samples, item.since)
            except Exception:  # a bug: logged, the hint dropped, the worker lives on
                log.exception("prefetch hint of %d samples failed", len(item.samples))
                self.stats.prefetch_dropped += len(item.samples)
            finally:
                self._release(item)

    def _release(self, item: _Hint) -> None:
        self.queued_cells -= item.cells
        left = self._peer_cells.pop(item.peer, 0) - item.cells
        if left > 0:
            self._peer_cells[item.peer] = left

    def _admitted(self, keymap: Keymap, good: list[tuple[str, int]]) -> bool:
        """Whether the hint's response, estimated as a read's is before anything is built
        (rows x row size, from the first episode named), is within the response limit."""
        if not self.response_limit:
            return True
        try:
            episode = self.planner.catalog.lookup(good[0][0])
        except EpiserveError:
            return False
        per_sample = 0
        for e in keymap:
            if e.rule is Rule.ANNOTATION:
                continue
            reader = episode.readers.get(e.zarr_key)
            if reader is None:
                return False
            info = reader.info
            per_sample += e.length * (4 if info.is_bytes else 4 * math.prod(info.feature))
        return len(good) * per_sample <= self.response_limit

    async def _prefetch(self, keymap: Keymap, good: list[tuple[str, int]],
                        since: float) -> None:
        while not (self.fetcher.spare() and self._jobs < HINT_JOBS):
            if time.monotonic() - since > HINT_TTL_S:
                self.stats.prefetch_dropped += len(good)
                return
            await asyncio.sleep(POLL_S)
        needs = await self._plan(keymap, good)
        if needs is None:  # e.g. a key one of the episodes lacks: the hint is no good
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

    async def _plan(self, keymap: Keymap, good: list[tuple[str, int]]) -> list[Need] | None:
        """The hint's chunks neither cached nor in flight, planned a slice at a time (the
        loop is served between slices); None if a read of it would fail."""
        per_sample = max(1, sum(e.length for e in keymap if e.rule is not Rule.ANNOTATION))
        step = max(1, PLAN_SLICE_CELLS // per_sample)
        needs: list[Need] = []
        seen: set[object] = set()
        frames: list[ChunkKey] = []
        for start in range(0, len(good), step):
            if start:
                await asyncio.sleep(0)
            try:
                part = self.planner.uncached(keymap, good[start: start + step], frames)
            except EpiserveError:
                return None
            for need in part:
                if need.id not in seen and not self.fetcher.in_flight(need.id):
                    seen.add(need.id)
                    needs.append(need)
        if frames:
            self.cache.want(frames)  # kept ahead of frames no read to come uses
        return needs

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
        # Per array, how many of its first chunks fit (counted, not listed: an array may
        # declare 10^8 chunks of one value); each chunk costs its data and what the cache
        # keeps beside it.
        spans: list[tuple[ChunkReader, int]] = []
        planned = 0
        limit = self.cache.budget_bytes
        for n, episode in enumerate(episodes):
            if n % PRELOAD_PLAN_SLICE == PRELOAD_PLAN_SLICE - 1:
                await asyncio.sleep(0)  # planning every episode is served in slices
            for name in sorted(episode.readers):
                reader = episode.readers[name]
                info = reader.info
                if info.is_bytes:
                    continue
                size = info.chunk_rows * math.prod(info.feature) * 4 + PRELOAD_CHUNK_OVERHEAD
                count = min(-(-info.rows // info.chunk_rows), (limit - planned) // size)
                if count > 0:
                    spans.append((reader, count))
                    planned += count * size
        total = sum(count for _, count in spans)
        self.stats.preload_total = total
        log.info("preload numeric: %d chunks (%.1f MiB decoded) of %d arrays, in the "
                 "background", total, planned / 2**20, len(spans))
        started = time.monotonic()
        failed = 0
        for group in _jobs(spans, PRELOAD_CHUNKS_PER_JOB):
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


@dataclass(frozen=True, slots=True)
class _Hint:
    keymap: Keymap
    samples: list[tuple[str, int]]
    since: float  # when it arrived
    peer: str  # the connection it came from
    cells: int  # its planning cost: samples x window rows


def _estimate(need: Need) -> int:
    info = need.reader.info
    if info.is_bytes:
        return min(info.decoded_bound, FRAME_ESTIMATE_BYTES * info.chunk_rows)
    return info.chunk_rows * math.prod(info.feature) * 4


def _jobs(spans: list[tuple[ChunkReader, int]], size: int) -> Iterator[list[Need]]:
    """The first ``count`` chunks of each span's array, in jobs of at most ``size`` chunks
    (a job's chunks are put in the cache on the loop in one pass, so a large job would keep
    reads waiting for that pass), made as they are asked for."""
    job: list[Need] = []
    for reader, count in spans:
        for chunk in range(count):
            job.append(Need(reader, chunk))
            if len(job) == size:
                yield job
                job = []
    if job:
        yield job
