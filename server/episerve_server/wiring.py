"""The one place the read core's object graph is built: the daemon, the tests and the
benchmarks all call :func:`build_read_core`, so none of them can forget a hook."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from episerve_server.config import ServerConfig
from episerve_server.core.cache import ChunkCache, EvictHook
from episerve_server.core.collector import COLLECTOR
from episerve_server.core.counters import Stats
from episerve_server.core.ledger import EpisodeState
from episerve_server.plan.loops import PlanLoops
from episerve_server.plan.planner import Planner
from episerve_server.plan.read_ahead import Background
from episerve_server.preflight import StartupError
from episerve_server.statistics.key_statistics import KeyStatsEngine
from episerve_server.storage.catalog import Catalog
from episerve_server.storage.spill import SpillRefused, SpillTier
from episerve_server.storage.store import CountingStore, open_root


@dataclass(frozen=True, slots=True)
class ReadCore:
    """Everything a read needs, wired together; ``await core.catalog.scan()`` opens it."""

    stats: Stats
    store: CountingStore
    cache: ChunkCache
    catalog: Catalog
    planner: Planner
    background: Background  # prefetch hints and --preload
    key_stats: KeyStatsEngine
    spill: SpillTier | None = None  # --spill-dir


def build_read_core(config: ServerConfig, *, stats: Stats | None = None,
                    compiled: bool | None = None) -> ReadCore:
    """The read core of ``config``; ``compiled``: its loops compiled or numpy's (None: the
    compiled ones where built)."""
    stats = stats if stats is not None else Stats()
    # The storage bounds: metadata documents, one vlen element, the time of one store call.
    store = open_root(config.root, stats=stats, storage_options=storage_options(config),
                      max_connections=config.max_store_concurrency,
                      timeout_s=config.store_timeout_s,
                      max_metadata_bytes=config.max_metadata_bytes,
                      latency_s=config.inject_latency_s)
    loops = PlanLoops(compiled)
    cache = ChunkCache(config.cache_bytes, stats, loops.core)
    # A dropped episode's chunks (and its statistics) leave the caches with it.
    dropped: list[Callable[[str], None]] = [cache.drop_episode]

    def on_drop(episode: str) -> None:
        for forget in dropped:
            forget(episode)

    # What the episodes' files declare and the daemon keeps, in one ledger.
    catalog = Catalog(store, allow=config.allow, on_drop=on_drop,
                      max_item_bytes=config.max_item_bytes,
                      video_tolerance_s=config.video_tolerance_s,
                      state=EpisodeState(config.episode_state_bytes, stats), root=config.root)
    planner = Planner(catalog, cache, stats, fetch_limit=config.max_store_concurrency,
                      loops=loops)
    dropped.append(planner.fetcher.forget_episode)  # no read joins a fetch of the old files
    # Hints: at most --prefetch-bytes in flight, and never more than half the cache; each
    # admitted as a read is (its estimated response within --max-response-bytes).
    background = Background(
        planner, budget_bytes=min(config.prefetch_bytes, config.cache_bytes // 2),
        response_limit=config.max_response_bytes)
    key_stats = KeyStatsEngine(catalog, planner, cache, config.stats_cache_bytes)
    dropped.append(key_stats.drop_episode)
    dropped.append(COLLECTOR.episode_dropped)  # frozen episodes are reclaimed in batches
    spill = None
    if config.spill_dir:  # decoded frames the cache lets go, kept on disk and read back
        spill = SpillTier(config.spill_dir, config.spill_bytes, stats,
                          queue_bytes=config.spill_queue_bytes)
        try:
            spill.open()
        except (SpillRefused, OSError) as exc:
            raise StartupError(f"--spill-dir: {exc}") from exc
        planner.fetcher.spill = spill
        cache.on_evict = spill_evicted(spill, catalog)
    return ReadCore(stats, store, cache, catalog, planner, background, key_stats, spill)


def spill_evicted(spill: SpillTier, catalog: Catalog, *, bounded: bool = True) -> EvictHook:
    """The cache's eviction hook: frame chunks of readers with a spill token go to the
    spill tier (with it); others (raw bytes a store holds) do not. Not ``bounded``: for
    the cache's own frames at a drain (``SpillTier.offer``)."""

    def offer(items: list[tuple[tuple[str, str, int], list[bytes]]]) -> None:
        out = []
        for cid, frames in items:
            episode = catalog.episodes.get(cid[0])
            reader = episode.readers.get(cid[1]) if episode is not None else None
            if reader is not None and reader.spill_token is not None:
                out.append((reader.spill_token, cid, frames))
        if out:
            spill.offer(out, bounded=bounded)

    return offer


def storage_options(config: ServerConfig) -> dict[str, Any]:
    if config.s3_endpoint:
        return {"client_kwargs": {"endpoint_url": config.s3_endpoint}}
    return {}
