"""The miss path: the chunks a batch lacks, fetched once, together, off the event loop.

- **Single-flight.** Every chunk being fetched is registered (episode, key, chunk) -> the
  job fetching it. A read that misses a chunk already in flight waits for that job instead
  of asking the store again, whether the job belongs to a concurrent Read, to the same
  batch, or to a prefetch hint. A job runs while anyone waits for it: when the last
  interested read is cancelled, so is the job. A job that fails for one read is retried once
  more by the others (the failure may be the first read's own, e.g. its response limit).
- **Batched.** One job per batch: shard indexes not yet known are loaded (themselves
  single-flight, in the reader), every run's byte ranges go to the store in one
  ``get_many`` (a local root reads them in one worker thread, opening each shard file
  once), then every chunk is cut out and decoded in one more thread job, and the decoded
  chunks go into the cache once, by the job, for every read that waits on it. A reader that
  reads itself (video) gets all its runs of a job in one call (``fetch_runs``), so it can
  plan its passes of decoding over them.
- **Spilled first.** With ``--spill-dir``, a job first reads back the chunks the spill tier
  holds (``storage/spill.py``) and decodes only the rest.
- **A group of pictures while there is room.** A read's own job also takes the chunks its
  readers say are worth reading with its chunks (``companions``: a video frame's group of
  pictures), while the cache has free room for them, never when they would evict.
- **Bounded.** At most ``limit`` store jobs hold a slot at once (``--max-store-concurrency``);
  each store call is bounded by the store's timeout; every decode by the array's metadata.

How a job's reads are cut and decoded, and what a failed storage read is to the caller, is
:mod:`~episerve_server.plan.fetched_runs`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from episerve_proto.errors import DataLossError, EpisodeNotFound, LimitExceeded
from episerve_server.core.cache import Chunk, ChunkCache
from episerve_server.core.counters import Stats
from episerve_server.plan.fetched_runs import Vanished, split_decode, storage_error
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.readers import ChunkReader, Raw
from episerve_server.storage.readers.base import MAX_ABSENT, RunPlan
from episerve_server.storage.spill import SpillTier
from episerve_server.storage.store import Refused, split_key

ChunkId: TypeAlias = tuple[str, str, int]  # episode, zarr key, chunk
#: A read retries chunks whose shared job failed this many times before it gives up.
MAX_ATTEMPTS = 3
#: Numeric chunks one read may need decoded at once (sampling one row from each of 4,096
#: episodes in chunks of 1,000 rows x 63 floats is 1 GB).
MAX_READ_DECODED_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class Need:
    """One chunk a batch lacks."""

    reader: ChunkReader
    chunk: int

    @property
    def id(self) -> ChunkId:
        return self.reader.info.episode, self.reader.info.name, self.chunk


class Job:
    """One store job: chunks fetched and decoded together, and who waits for them."""

    __slots__ = ("charged", "ids", "interest", "task")

    def __init__(self, ids: list[ChunkId]) -> None:
        self.ids = ids
        self.interest = 0
        self.charged: set[ChunkId] = set()  # frame chunks charged to the owner before reading
        self.task: asyncio.Task[dict[ChunkId, Chunk]] | None = None

    def hold(self) -> None:
        self.interest += 1

    def release(self) -> None:
        self.interest -= 1
        if self.interest <= 0 and self.task is not None and not self.task.done():
            self.task.cancel()


class Fetcher:
    """Fetches missing chunks for reads, prefetch hints and preload: once, in batches."""

    #: A job's fetched bytes from which its chunks are cut and decoded in a worker thread.
    offload_bytes = 1 << 20

    def __init__(self, catalog: Catalog, cache: ChunkCache, stats: Stats, *,
                 limit: int = 64) -> None:
        self.catalog, self.cache, self.stats = catalog, cache, stats
        self.limit = limit
        #: decoded chunks kept on disk (``storage/spill.py``), read before decoding; set by
        #: the wiring when ``--spill-dir`` is given
        self.spill: SpillTier | None = None
        self._flights: dict[ChunkId, Job] = {}
        self._sem: asyncio.Semaphore | None = None
        self.active = 0  # store jobs holding a slot
        self.waiting = 0  # reads waiting for a slot
        self.background = 0  # background store jobs (hints, preload): they hold no slot

    # -- store concurrency ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of ``limit`` store slots, for a read's job (it may wait for one)."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limit)
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            self._sem.release()

    @contextlib.asynccontextmanager
    async def _background_slot(self) -> AsyncIterator[None]:
        """Background jobs take no read slot, so a read never waits behind one; they start
        only when ``spare`` says so, and are few (see ``plan.read_ahead``)."""
        self.background += 1
        try:
            yield
        finally:
            self.background -= 1

    def spare(self, share: float = 0.5) -> bool:
        """Whether background work may start now: no read waits for a slot, and fewer than
        ``share`` of the slots are in use, background jobs included."""
        busy = self.active + self.background
        return self.waiting == 0 and busy < max(1, int(self.limit * share))

    def forget_episode(self, episode: str) -> None:
        """An episode dropped or reopened: its chunks in flight finish for the reads that
        wait for them, but no later read joins them (they are of the old files)."""
        for cid in [cid for cid in self._flights if cid[0] == episode]:
            del self._flights[cid]

    def in_flight(self, cid: ChunkId) -> bool:
        return cid in self._flights

    @property
    def flights(self) -> int:
        return len(self._flights)

    # -- reads ------------------------------------------------------------------------------

    async def get(self, needs: Sequence[Need],
                  charge: Callable[[int], None] | None = None) -> list[Chunk]:
        """The chunks of ``needs`` (distinct), in order: fetched by this call's own job, or
        taken from jobs already in flight. ``charge`` is told frame bytes as they are known
        (before reading, from a shard index) or arrive; it may raise to stop the read."""
        _check_decoded(needs)
        out: list[Chunk | None] = [None] * len(needs)
        pending = list(range(len(needs)))
        error: BaseException | None = None
        for _ in range(MAX_ATTEMPTS):
            by_job: dict[Job, list[int]] = {}
            own: list[int] = []
            for i in pending:
                job = self._flights.get(needs[i].id)
                if job is None:
                    own.append(i)
                else:
                    by_job.setdefault(job, []).append(i)
            self.stats.shared_fetches += len(pending) - len(own)
            mine = None
            if own:
                mine_needs = [needs[i] for i in own]
                mine = self.start(mine_needs + self._on_the_way(mine_needs), charge)
                by_job[mine] = own
            failed, error = await self._wait(by_job, mine)
            for job, idx in by_job.items():
                if job.task is None or job in failed:
                    continue
                result = job.task.result()
                arrived = 0
                for i in idx:
                    cid = needs[i].id
                    chunk = out[i] = result[cid]
                    if isinstance(chunk, list) and (job is not mine or cid not in job.charged):
                        arrived += sum(len(b) for b in chunk)
                if charge is not None and arrived:
                    charge(arrived)
            pending = [i for job in failed for i in by_job[job]]
            if not pending:
                return out  # type: ignore[return-value]
        assert error is not None
        raise error

    def _on_the_way(self, needs: Sequence[Need]) -> list[Need]:
        """Chunks its reader says are worth reading with each of ``needs`` (a video's
        frames of the same group of pictures), kept too while the cache has free room for
        them beside ``needs``: with every frame fitting, no frame is decoded twice and no
        keyframe decoded again for the frame after it. With the cache full (or off), none:
        they would evict others."""
        cache = self.cache
        if not cache.enabled:
            return []
        room = cache.room - sum(n.reader.info.decoded_bound for n in needs
                                if n.reader.info.is_bytes)
        taken = {n.id for n in needs}
        extra: list[Need] = []
        for need in needs:
            for chunk in need.reader.companions(need.chunk):
                more = Need(need.reader, chunk)
                size = need.reader.info.decoded_bound
                if (room < size or more.id in taken or more.id in self._flights
                        or cache.has_frames(more.id)):
                    continue
                taken.add(more.id)
                extra.append(more)
                room -= size
        return extra

    async def _wait(self, by_job: dict[Job, list[int]],
                    mine: Job | None) -> tuple[set[Job], BaseException | None]:
        """Wait for every job; this read's own failure raises at once, others' are
        returned (their chunks are retried)."""
        for job in by_job:
            job.hold()
        failed: set[Job] = set()
        error: BaseException | None = None
        try:
            tasks = {job.task: job for job in by_job if job.task is not None}
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    job = tasks[task]
                    exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
                    if exc is None:
                        continue
                    if job is mine:
                        raise exc
                    failed.add(job)
                    error = exc
        finally:
            for job in by_job:
                job.release()
        return failed, error

    def start(self, needs: Sequence[Need], charge: Callable[[int], None] | None = None,
              *, count: str = "", background: bool = False) -> Job:
        """Register ``needs`` as in flight (none may be) and start the job fetching them;
        ``count`` names a counter of ``Stats`` that the job adds its chunks to;
        ``background`` jobs (hints, preload) hold no read slot."""
        ids = [n.id for n in needs]
        for cid in ids:
            if cid in self._flights:  # never: callers take chunks in flight from their job
                self.stats.duplicate_fetches += 1
        job = Job(ids)
        for cid in ids:
            self._flights[cid] = job
        job.task = asyncio.ensure_future(self._run(job, list(needs), charge, count,
                                                   background))
        job.task.add_done_callback(_observed)
        return job

    # -- one job ----------------------------------------------------------------------------

    async def _run(self, job: Job, needs: list[Need], charge: Callable[[int], None] | None,
                   count: str, background: bool) -> dict[ChunkId, Chunk]:
        try:
            spilled = await self._from_spill(needs)
            if spilled:
                readers = {n.id: n.reader for n in needs if n.id in spilled}
                needs = [n for n in needs if n.id not in spilled]
            runs = _runs(needs)
            result: dict[ChunkId, Chunk] = {}
            if runs:
                plans = await self._plans(runs)
                known = [(run, plan) for run, plan in zip(runs, plans)
                         if plan is not None and run[0].info.is_bytes and plan.known_bytes]
                if charge is not None and known:
                    charge(sum(plan.known_bytes for _, plan in known))
                    job.charged.update((r.info.episode, r.info.name, c) for (r, c0, c1), _
                                       in known for c in range(c0, c1 + 1))
                decoded = await self._fetch_decode(runs, plans, background)
                await self._check_absent(runs, decoded)
                result = self._keep(runs, decoded)
            if spilled:
                result.update(spilled)
                self._keep_spilled(spilled, readers)
            if count:
                setattr(self.stats, count, getattr(self.stats, count) + len(result))
            return result
        finally:
            for cid in job.ids:
                if self._flights.get(cid) is job:
                    del self._flights[cid]

    async def _from_spill(self, needs: Sequence[Need]) -> dict[ChunkId, Chunk]:
        """The chunks of ``needs`` the spill tier holds (read in a worker thread, each
        checked), so they are not decoded again."""
        spill = self.spill
        if spill is None or not spill.enabled:
            return {}
        wanted = [(n.reader.spill_token, n.id) for n in needs
                  if n.reader.spill_token is not None and spill.has(n.reader.spill_token, n.id)]
        if not wanted:
            return {}
        got = await asyncio.to_thread(spill.read_many, wanted)
        spill.publish()
        return dict(got)

    def _keep_spilled(self, chunks: dict[ChunkId, Chunk],
                      readers: dict[ChunkId, ChunkReader]) -> None:
        """Chunks read back from the spill tier go into the cache, as decoded ones do
        (unless their episode was dropped or reopened meanwhile)."""
        keep = [(cid, chunk) for cid, chunk in chunks.items() if isinstance(chunk, list)
                and self.catalog.current(cid[0], cid[1], readers[cid])]
        if keep:
            self.stats.duplicate_fetches += self.cache.put_frames(keep)

    async def _plans(self, runs: list[tuple[ChunkReader, int, int]]) -> list[RunPlan | None]:
        """Each batched run's store reads (None: read by the reader itself). Shard indexes
        not loaded yet are loaded concurrently, once each."""
        plans: list[RunPlan | None] = [r.plan_now(c0, c1) if r.batched else None
                                       for r, c0, c1 in runs]
        late = [k for k, (r, _, _) in enumerate(runs) if r.batched and plans[k] is None]
        if late:
            got = await asyncio.gather(*(self._plan(*runs[k]) for k in late))
            for k, plan in zip(late, got):
                plans[k] = plan
        return plans

    async def _plan(self, reader: ChunkReader, first: int, last: int) -> RunPlan:
        try:
            return await reader.plan(first, last)
        except Refused as exc:
            raise reader.loss(f"store object {exc.key!r} refused: {exc.why}") from exc
        except FileNotFoundError as exc:  # a shard index vanished: is the episode gone?
            raise await self._went_missing(reader, exc) from exc
        except (OSError, TimeoutError) as exc:
            raise storage_error(exc, reader.info.episode, reader.info.name) from exc

    async def _fetch_decode(self, runs: list[tuple[ChunkReader, int, int]],
                            plans: list[RunPlan | None],
                            background: bool) -> list[list[tuple[Raw | Chunk, Chunk]]]:
        """Per run, per chunk: (raw, decoded)."""
        requests = [req for plan in plans if plan is not None for req in plan.requests]
        others = [k for k, plan in enumerate(plans) if plan is None]
        async with self._background_slot() if background else self.slot():
            # the runs a reader reads itself, one call per reader (one job per video)
            by_reader: dict[ChunkReader, list[int]] = {}
            for k in others:
                by_reader.setdefault(runs[k][0], []).append(k)
            try:
                got: list[Any] = await asyncio.gather(
                    self.catalog.store.get_many(requests),
                    *(r.fetch_runs([runs[k][1:] for k in ks]) for r, ks in by_reader.items()))
            except Refused as exc:
                episode, key = split_key(exc.key)
                raise DataLossError(f"episode {episode!r} key {key!r}: store object "
                                    f"{exc.key!r} refused: {exc.why}",
                                    episode=episode, key=key) from exc
            except (OSError, TimeoutError) as exc:
                failed = getattr(exc, "filename", None)
                episode, key = split_key(failed if isinstance(failed, str) else
                                         requests[0][0] if requests else "")
                raise storage_error(exc, episode, key) from exc
        raws: list[bytes | None] = got[0]
        fallback: dict[int, list[Raw | Chunk]] = {
            k: chunks for ks, per_run in zip(by_reader.values(), got[1:])
            for k, chunks in zip(ks, per_run)}
        nbytes = sum(len(r) for r in raws if r is not None)
        self._count(runs, plans, raws, fallback)
        args = (runs, plans, raws, fallback)
        try:
            if nbytes >= self.offload_bytes:
                return await asyncio.to_thread(split_decode, *args)
            return split_decode(*args)
        except Vanished as exc:
            raise await self._went_missing(exc.reader, exc.exc) from exc.exc

    def _count(self, runs: list[tuple[ChunkReader, int, int]], plans: list[RunPlan | None],
               raws: list[bytes | None], fallback: dict[int, list[Raw | Chunk]]) -> None:
        stats = self.stats
        for k, (reader, c0, c1) in enumerate(runs):
            n = c1 - c0 + 1
            stats.episodes[reader.info.episode].chunks_fetched += n
            stats.chunks_fetched += n
            if k in fallback:
                stats.bytes_fetched += sum(len(r) for r in fallback[k] if isinstance(r, bytes))
        stats.bytes_fetched += sum(len(r) for r in raws if r is not None)

    async def _check_absent(self, runs: list[tuple[ChunkReader, int, int]],
                            decoded: list[list[tuple[Raw | Chunk, Chunk]]]) -> None:
        """A missing chunk is fill, unless the episode was deleted: checked once a chunk."""
        for (reader, c0, _), chunks in zip(runs, decoded):
            unknown = {c0 + k for k, (raw, _) in enumerate(chunks) if raw is None}
            unknown -= reader.absent
            if unknown:
                await self.check_present(reader)
                room = MAX_ABSENT - len(reader.absent)
                reader.absent.update(itertools.islice(unknown, max(0, room)))

    async def fetch_raw(self, reader: ChunkReader, first: int, last: int) -> list[Any]:
        """Raw chunks [first, last] of one array, under a store slot and counted as a
        read's fetches, not cached (annotations and the statistics pass decode them)."""
        async with self.slot():
            try:
                raws = await reader.fetch(first, last)
            except FileNotFoundError as exc:
                raise await self._went_missing(reader, exc) from exc
            except (OSError, TimeoutError) as exc:
                raise storage_error(exc, reader.info.episode, reader.info.name) from exc
        self.stats.episodes[reader.info.episode].chunks_fetched += len(raws)
        self.stats.chunks_fetched += len(raws)
        self.stats.bytes_fetched += sum(len(r) for r in raws if isinstance(r, bytes))
        return raws

    async def _went_missing(self, reader: ChunkReader, exc: BaseException) -> DataLossError:
        """What a read whose data vanished raises: NOT_FOUND when the episode is gone (raised
        here), else data loss naming the episode and key."""
        await self.check_present(reader)
        return reader.loss(f"data went missing ({exc})")

    async def check_present(self, reader: ChunkReader) -> None:
        """Missing data may mean the episode folder was deleted: then drop it, NOT_FOUND."""
        episode = reader.info.episode
        if await self.catalog.still_there(episode):
            return
        self.catalog.drop(episode)
        raise EpisodeNotFound(
            f"episode {episode!r} was removed from the dataset while being served",
            episode=episode, key=reader.info.name,
        )

    def _keep(self, runs: list[tuple[ChunkReader, int, int]],
              decoded: list[list[tuple[Raw | Chunk, Chunk]]]) -> dict[ChunkId, Chunk]:
        """The job's chunks by id, each put in the cache once (one pass per key)."""
        out: dict[ChunkId, Chunk] = {}
        numeric: dict[str, list[tuple[int, int, int, np.ndarray]]] = {}
        frames: list[tuple[ChunkId, list[bytes]]] = []
        for (reader, c0, _), chunks in zip(runs, decoded):
            info = reader.info
            # chunks of an episode dropped or reopened meanwhile are served, never kept
            keep = self.catalog.current(info.episode, info.name, reader)
            uid = self.cache.uid(info.episode) if keep and not info.is_bytes else -1
            n_chunks = -(-info.rows // info.chunk_rows)
            for k, (_, chunk) in enumerate(chunks):
                cid = (info.episode, info.name, c0 + k)
                out[cid] = chunk
                if not keep:
                    continue
                if isinstance(chunk, np.ndarray):
                    numeric.setdefault(info.name, []).append((uid, n_chunks, c0 + k, chunk))
                else:
                    frames.append((cid, chunk))
        replaced = sum(self.cache.store_many(key, stored) for key, stored in numeric.items())
        replaced += self.cache.put_frames(frames)
        self.stats.duplicate_fetches += replaced
        return out


def _check_decoded(needs: Sequence[Need]) -> None:
    """A read holds the numeric chunks it needs decoded at once, each up to 256 MiB however
    few of its rows the answer takes (the answer's own limit does not see them): more than
    ``MAX_READ_DECODED_BYTES`` of them is ``LimitExceeded`` naming the episode and key that
    hold the most, before anything is fetched. (Frames are charged as they arrive.)"""
    total = 0
    by_key: dict[tuple[str, str], list[int]] = {}
    for need in needs:
        info = need.reader.info
        if not info.is_bytes:  # held as float32 (or wider) whatever the stored type
            size = info.chunk_rows * math.prod(info.feature) * max(4, info.itemsize)
            total += size
            seen = by_key.setdefault((info.episode, info.name), [0, size])
            seen[0] += 1
    if total <= MAX_READ_DECODED_BYTES:
        return
    (episode, key), (count, size) = max(by_key.items(), key=lambda kv: kv[1][0] * kv[1][1])
    raise LimitExceeded(
        f"episode {episode!r} key {key!r}: the read needs {total} bytes of numeric chunks "
        f"decoded at once ({count} chunks of {size} bytes of this key), more than "
        f"{MAX_READ_DECODED_BYTES}; read fewer samples at a time", episode=episode, key=key)


def _observed(task: asyncio.Task[Any]) -> None:
    """A job nobody waits for any more must not log "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


def _runs(needs: Sequence[Need]) -> list[tuple[ChunkReader, int, int]]:
    """Runs of consecutive chunks of one array, in the order given."""
    runs: list[tuple[ChunkReader, int, int]] = []
    for n in needs:
        if runs and runs[-1][0] is n.reader and runs[-1][2] == n.chunk - 1:
            runs[-1] = (n.reader, runs[-1][1], n.chunk)
        else:
            runs.append((n.reader, n.chunk, n.chunk))
    return runs
