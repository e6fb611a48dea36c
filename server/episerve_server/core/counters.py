"""Counters that prove the read planner's claims (docs/ARCHITECTURE.md).

One ``Stats`` object lives per daemon. Everything touching it runs on the event loop
thread, so plain integers suffice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

COUNTERS = (
    "read_rpcs",
    "samples_read",
    "store_reads",
    "chunks_fetched",
    "metadata_requests",
    "cache_hits",
    "cache_misses",
    "cache_evictions",
    "frames_not_cached",
    "bytes_fetched",
    "bytes_sent",
    "read_ns",
    # the miss path: single-flight, prefetch hints, preload
    "duplicate_fetches",
    "shared_fetches",
    "prefetch_hinted_samples",
    "prefetch_chunks",
    "prefetch_dropped",
    "prefetch_over_budget",
    "preload_chunks",
    # listings and keymap checks (what building a dataset asks for)
    "listing_pages_full",
    "listing_pages_brief",
    "keymap_checks",
    # the catalog
    "episodes_reopened",
    "change_checks",
    # the spill tier: chunks read back instead of decoded, entries written, entries that
    # failed their checks (deleted, decoded again), evicted chunks not written (the queue
    # was full), entries deleted to stay within its budget
    "spill_hits",
    "spill_writes",
    "spill_drops",
    "spill_skipped",
    "spill_evictions",
    # LeRobot roots: video frames the daemon's decoder gave, and those converted to RGB (the
    # frames served and cached: a pass decodes from a keyframe, converting only its frames)
    "video_frames_decoded",
    "video_frames_converted",
    # replay buffers: frames an image codec (JPEG 2000, JPEG XL) decoded
    "image_frames_decoded",
    # arrays not cached because indexing them would pass the slot tables' share of the
    # cache (their declared chunk count is that large)
    "cache_index_refused",
    # state an episode's files declare (readers, shard indexes, keyframe lists, annotation
    # spans) refused: it would pass --episode-state-bytes
    "episode_state_refused",
)


@dataclass(slots=True)
class EpisodeCounters:
    chunks_fetched: int = 0
    read_rpcs: int = 0


@dataclass(slots=True)
class Stats:
    read_rpcs: int = 0
    samples_read: int = 0
    store_reads: int = 0
    chunks_fetched: int = 0
    metadata_requests: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    # frame chunks served but not kept: keeping them would have evicted frames that a read
    # to come (a prefetch hint) wants
    frames_not_cached: int = 0
    bytes_fetched: int = 0
    bytes_sent: int = 0
    read_ns: int = 0  # time spent serving successful Reads, parse to serialized response
    # A chunk fetched while it was already cached or being fetched (single-flight: 0).
    duplicate_fetches: int = 0
    shared_fetches: int = 0  # chunks a read took from another's fetch in flight
    prefetch_hinted_samples: int = 0  # samples named in Read prefetch hints
    prefetch_chunks: int = 0  # chunks fetched into the cache for hints
    prefetch_dropped: int = 0  # hinted samples not prefetched (budget, queue, bad hint)
    # hinted samples refused at admission: over the response limit or the planning budgets
    prefetch_over_budget: int = 0
    preload_chunks: int = 0  # chunks fetched by --preload
    preload_total: int = 0  # chunks --preload means to fetch (a gauge: its progress)
    listing_pages_full: int = 0  # ListEpisodes pages with full entries
    listing_pages_brief: int = 0  # ListEpisodes pages with brief entries
    keymap_checks: int = 0  # RegisterKeymap calls with check_episodes
    episodes_reopened: int = 0  # episodes whose files changed, reopened by a (re)check
    # store requests made only to see whether an episode was rewritten (an object store's
    # metadata documents, read again by a rescan): not metadata_requests, which count what
    # opening and reading need
    change_checks: int = 0
    video_frames_decoded: int = 0
    image_frames_decoded: int = 0
    spill_hits: int = 0
    spill_writes: int = 0
    spill_drops: int = 0
    spill_skipped: int = 0
    spill_evictions: int = 0
    spill_bytes: int = 0  # a gauge: bytes of entries on disk
    spill_entries: int = 0  # a gauge
    spill_on: int = 0  # a gauge: 1 while the tier works
    video_frames_converted: int = 0
    cache_bytes: int = 0
    cache_entries: int = 0
    cache_index_bytes: int = 0  # a gauge: the slot tables' arrays
    cache_index_refused: int = 0
    episode_state_bytes: int = 0  # a gauge: what the episodes' kept state is charged
    episode_state_refused: int = 0
    episodes: defaultdict[str, EpisodeCounters] = field(
        default_factory=lambda: defaultdict(EpisodeCounters)
    )

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy: counters, cache gauges and ``episodes``."""
        out: dict[str, Any] = {name: getattr(self, name) for name in COUNTERS}
        out["cache_bytes"] = self.cache_bytes
        out["cache_entries"] = self.cache_entries
        out["cache_index_bytes"] = self.cache_index_bytes
        out["episode_state_bytes"] = self.episode_state_bytes
        out["preload_total"] = self.preload_total
        out["spill_bytes"] = self.spill_bytes
        out["spill_entries"] = self.spill_entries
        out["spill_on"] = self.spill_on
        out["episodes"] = {
            ep: {"chunks_fetched": c.chunks_fetched, "read_rpcs": c.read_rpcs}
            for ep, c in sorted(self.episodes.items())
        }
        return out
