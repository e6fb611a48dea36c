"""Counters that prove the read planner's claims (SPEC section 3).

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
    "bytes_fetched",
    "bytes_sent",
    "read_ns",
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
    bytes_fetched: int = 0
    bytes_sent: int = 0
    read_ns: int = 0  # time spent serving successful Reads, parse to serialized response
    cache_bytes: int = 0
    cache_entries: int = 0
    episodes: defaultdict[str, EpisodeCounters] = field(
        default_factory=lambda: defaultdict(EpisodeCounters)
    )

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy: counters, cache gauges and ``episodes``."""
        out: dict[str, Any] = {name: getattr(self, name) for name in COUNTERS}
        out["cache_bytes"] = self.cache_bytes
        out["cache_entries"] = self.cache_entries
        out["episodes"] = {
            ep: {"chunks_fetched": c.chunks_fetched, "read_rpcs": c.read_rpcs}
            for ep, c in sorted(self.episodes.items())
        }
        return out
