"""Prometheus metrics on their own port, off by default (``--metrics-port``).

Most series are read at scrape time from the daemon's own ``Stats`` and catalog, so the
GetStats RPC and Prometheus report the very same counters, with no second bookkeeping.
Only what the daemon does not count itself is kept here: RPCs by method and status code,
their latency, and the number of samples per Read.

The HTTP server runs in a thread of prometheus-client's. Scrapes read plain integers that
the event loop writes, which is safe under the GIL; the one dict the loop may grow (the
catalog's episodes) is copied in a single C call, never iterated in Python.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from episerve_server.config import ServerConfig
from episerve_server.core.counters import COUNTERS
from episerve_server.rpc.handlers.servicer import Servicer

if TYPE_CHECKING:
    from episerve_server.rpc.handlers.service import EpiserveService

log = logging.getLogger(__name__)

PREFIX = "episerve"
RPC_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, 120.0)
BATCH_SAMPLES_BUCKETS = tuple(float(2**k) for k in range(13))  # 1 .. 4096 (--max-batch)

# Help for the ``Stats`` counters; a counter added there is exported with a generic help.
COUNTER_HELP = {
    "read_rpcs": "Read RPCs served successfully.",
    "samples_read": "Samples read by successful batch plans.",
    "store_reads": "Read calls made to the store (chunk data).",
    "chunks_fetched": "Chunks fetched from the store (cache misses that hit storage).",
    "metadata_requests": "Metadata requests to the store (zarr.json, shard indexes).",
    "cache_hits": "Chunk cache hits.",
    "cache_misses": "Chunk cache misses.",
    "cache_evictions": "Chunks evicted from the cache to stay within its budget.",
    "frames_not_cached": "Frame chunks served but not kept, to keep frames a prefetch hint "
                         "wants.",
    "bytes_fetched": "Bytes fetched from the store.",
    "bytes_sent": "Bytes of Read responses sent.",
    "duplicate_fetches": "Chunks fetched while already cached or being fetched (0: single-flight).",
    "shared_fetches": "Chunks a read took from a fetch already in flight for another.",
    "prefetch_hinted_samples": "Samples named in Read prefetch hints.",
    "prefetch_chunks": "Chunks fetched into the cache for prefetch hints.",
    "prefetch_dropped": "Hinted samples not prefetched (budget, queue, stale or bad hint).",
    "prefetch_over_budget": "Hinted samples refused at admission (response limit or the "
                            "hint planning budgets per connection and in total).",
    "preload_chunks": "Chunks fetched into the cache by --preload.",
    "listing_pages_full": "ListEpisodes pages served with full entries.",
    "listing_pages_brief": "ListEpisodes pages served with brief entries.",
    "keymap_checks": "RegisterKeymap calls that checked the keymap against every episode.",
    "episodes_reopened": "Episodes reopened because their files were rewritten in place.",
    "change_checks": "Store requests made to see whether an episode was rewritten.",
    "video_frames_decoded": "Video frames of LeRobot datasets decoded by the daemon.",
    "image_frames_decoded": "Frames of replay buffers decoded by an image codec (JPEG 2000, "
                            "JPEG XL).",
    "video_frames_converted": "Decoded video frames converted to RGB (those served).",
    "spill_hits": "Chunks read back from the spill tier instead of decoded.",
    "spill_writes": "Entries written to the spill tier.",
    "spill_drops": "Spill entries that failed their checks (deleted, decoded again).",
    "spill_skipped": "Evicted chunks not spilled: the write queue was full.",
    "spill_evictions": "Spill entries deleted to stay within --spill-bytes.",
    "cache_index_refused": "Chunks not cached: indexing their array (by its declared chunk "
                           "count) would pass the slot tables' share of --cache-bytes.",
    "episode_state_refused": "Charges of what episodes' files declare refused (an episode "
                             "listed broken, a read failed) by --episode-state-bytes.",
}


def counter_families(value: Callable[[str], float]) -> Iterator[Metric]:
    """A series for each ``Stats`` counter, ``value(name)`` its value now (``read_ns`` in
    seconds)."""
    for name in COUNTERS:
        if name == "read_ns":
            yield CounterMetricFamily(f"{PREFIX}_read_seconds",
                                      "Time spent serving successful Reads.",
                                      value=value(name) / 1e9)
        else:
            yield CounterMetricFamily(f"{PREFIX}_{name}",
                                      COUNTER_HELP.get(name, f"Daemon counter {name}."),
                                      value=value(name))


class StatsCollector(Collector):
    """Exports ``service.stats`` and the catalog as they are at scrape time."""

    def __init__(self, service: EpiserveService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service, stats = self.service, self.service.stats
        yield from counter_families(lambda name: getattr(stats, name))
        open_, broken = _episode_counts(service)
        gauges = (
            ("cache_bytes", "Bytes held by the chunk cache (numeric slots with their "
             "bookkeeping, frames with their per-item overhead).", stats.cache_bytes),
            ("cache_entries", "Chunks held by the chunk cache.", stats.cache_entries),
            ("cache_index_bytes", "Bytes of the chunk cache's slot tables (at most a "
             "quarter of --cache-bytes).", stats.cache_index_bytes),
            ("cache_budget_bytes", "The chunk cache's budget (--cache-bytes).",
             service.config.cache_bytes),
            ("episode_state_bytes", "Bytes charged for what the episodes' files declare "
             "(readers, shard indexes, keyframe lists, annotation spans).",
             stats.episode_state_bytes),
            ("episode_state_budget_bytes", "Their budget (--episode-state-bytes).",
             service.config.episode_state_bytes),
            ("episodes_open", "Episodes open and readable.", open_),
            ("episodes_broken", "Episodes listed as broken.", broken),
            ("reads_in_flight", "Read RPCs in progress.", service.admission.inflight),
            ("preload_total_chunks", "Chunks --preload means to fetch (progress: "
             "episerve_preload_chunks).", stats.preload_total),
            ("spill_bytes", "Bytes of entries in the spill folder.", stats.spill_bytes),
            ("spill_entries", "Entries in the spill folder.", stats.spill_entries),
            ("spill_on", "1 while the spill tier works (0: off, or turned off by a disk "
             "error).", stats.spill_on),
            ("draining", "1 while the daemon drains before stopping.",
             int(service.admission.draining)),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)


def _episode_counts(service: EpiserveService) -> tuple[int, int]:
    """(open and healthy, broken). ``list()`` copies the dict's values in one C call."""
    catalog = service.catalog
    episodes = list(catalog.episodes.values())
    with_problems = sum(1 for e in episodes if e.problems)
    return len(episodes) - with_problems, len(catalog.broken) + with_problems


class Metrics:
    """The daemon's Prometheus registry; ``observe`` is fed by the logging interceptor."""

    def __init__(self, service: Servicer, collector: Collector | None = None) -> None:
        """``collector``: the series read at scrape time (default: ``service``'s own
        counters, for an ``EpiserveService``)."""
        self.service = service
        self.registry = CollectorRegistry()
        self.rpcs = Counter(
            f"{PREFIX}_rpcs", "RPCs handled, by service, method and status code.",
            ("service", "method", "code"), registry=self.registry)
        self.rpc_seconds = Histogram(
            f"{PREFIX}_rpc_duration_seconds", "RPC latency, from arrival to response.",
            ("service", "method"), buckets=RPC_SECONDS_BUCKETS, registry=self.registry)
        self.batch_samples = Histogram(
            f"{PREFIX}_read_batch_samples", "Samples per successful Read.",
            buckets=BATCH_SAMPLES_BUCKETS, registry=self.registry)
        self.registry.register(
            collector or StatsCollector(cast("EpiserveService", service)))
        self.registry.register(_InfoCollector(service.config))
        ProcessCollector(registry=self.registry)
        service.on_batch = self.batch_samples.observe
        self._http: Any = None

    @classmethod
    def start(cls, config: ServerConfig, service: Servicer,
              collector: Collector | None = None) -> Metrics:
        """Serve ``/metrics`` on ``config.metrics_host:config.metrics_port`` (loopback by
        default: the endpoint has no auth, so exposing it is the operator's choice)."""
        # No ``*_created`` series: they would double the scrape for nothing.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        metrics = cls(service, collector)
        server, _thread = start_http_server(config.metrics_port, addr=config.metrics_host,
                                            registry=metrics.registry)
        metrics._http = server
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
        return metrics

    def observe(self, method: str, code: str, seconds: float) -> None:
        """One finished RPC (``method`` is the full gRPC path)."""
        service, _, name = method.lstrip("/").rpartition("/")
        self.rpcs.labels(service, name, code).inc()
        self.rpc_seconds.labels(service, name).observe(seconds)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _InfoCollector(Collector):
    def __init__(self, config: ServerConfig) -> None:
        try:
            version = metadata.version("episerve")
        except metadata.PackageNotFoundError:
            version = "unknown"
        self.labels = {"version": version, "root": config.root,
                       "tls": str(config.tls).lower(), "auth": str(bool(config.token)).lower()}

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(PREFIX, "The daemon's version and settings.", value=self.labels)
