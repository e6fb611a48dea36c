"""What a load test reports: tallies per client, percentiles, the summary, the live line."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

PROGRESS_EVERY_S = 1.0
QUANTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


@dataclass(slots=True)
class Tally:
    """What one task saw. Latencies are of successful reads only."""

    latencies_ms: list[float] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)  # per read
    attempts: Counter[str] = field(default_factory=Counter)  # per Read RPC
    samples: int = 0
    bytes: int = 0  # response bytes of successful Read RPCs

    def add(self, other: Tally) -> None:
        self.latencies_ms += other.latencies_ms
        self.codes.update(other.codes)
        self.attempts.update(other.attempts)
        self.samples += other.samples
        self.bytes += other.bytes


def merged(tallies: Sequence[Tally]) -> Tally:
    out = Tally()
    for t in tallies:
        out.add(t)
    return out


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and p99.9 (linear interpolation); None for no values."""
    if not values:
        return dict.fromkeys(QUANTILES)
    qs = np.percentile(np.asarray(values, dtype=np.float64), list(QUANTILES.values()))
    return {name: float(q) for name, q in zip(QUANTILES, qs)}


def hit_rate(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """Cache hits over lookups between two ``stats()`` snapshots; None if unknown."""
    if before is None or after is None:
        return None
    hits = after["cache_hits"] - before["cache_hits"]
    lookups = hits + after["cache_misses"] - before["cache_misses"]
    return hits / lookups if lookups > 0 else None


def summarize(tally: Tally, elapsed_s: float, cache_hit_rate: float | None) -> dict[str, Any]:
    """The report's figures. ``rpc_per_s`` counts successful reads (one RPC each unless
    split or retried); ``attempts_per_s`` counts every Read RPC."""
    elapsed_s = max(elapsed_s, 1e-9)
    lat = percentiles(tally.latencies_ms)
    return {
        "elapsed_s": round(elapsed_s, 3),
        "reads": sum(tally.codes.values()),
        "rpc_per_s": tally.codes["OK"] / elapsed_s,
        "attempts_per_s": sum(tally.attempts.values()) / elapsed_s,
        "samples_per_s": tally.samples / elapsed_s,
        "mb_per_s": tally.bytes / 1e6 / elapsed_s,
        "cache_hit_rate": cache_hit_rate,
        "latency_ms": {**lat, "mean": float(np.mean(tally.latencies_ms))
                       if tally.latencies_ms else None,
                       "max": max(tally.latencies_ms, default=None)},
        "codes": dict(sorted(tally.codes.items())),
        "attempts": dict(sorted(tally.attempts.items())),
    }


def format_report(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    def counts(c: dict[str, int]) -> str:
        return "  ".join(f"{k} {v:,}" for k, v in c.items()) or "-"

    lat = summary["latency_ms"]
    rate = summary["cache_hit_rate"]
    cpu = []
    if "daemon_cpu_s" in summary:
        per = summary["daemon_cpu_ms_per_1k_samples"]
        cpu = [f"daemon CPU       {summary['daemon_cpu_s']:,.2f} s, "
               f"{ms(per)} ms per 1,000 samples  (timed phase, /proc)"]
    return "\n".join([
        f"reads            {summary['reads']:,} in {summary['elapsed_s']:.1f} s",
        f"RPC/s            {summary['rpc_per_s']:,.1f}   (Read attempts/s "
        f"{summary['attempts_per_s']:,.1f})",
        f"samples/s        {summary['samples_per_s']:,.0f}",
        f"MB/s             {summary['mb_per_s']:,.1f}",
        f"latency ms       p50 {ms(lat['p50'])}  p90 {ms(lat['p90'])}  p99 {ms(lat['p99'])}  "
        f"p99.9 {ms(lat['p999'])}  max {ms(lat['max'])}",
        f"codes (reads)    {counts(summary['codes'])}",
        f"codes (attempts) {counts(summary['attempts'])}",
        "cache hit rate   " + ("-" if rate is None else f"{rate:.1%}") + "  (daemon counters)",
        *cpu,
    ])


class Tallied(Protocol):
    tally: Tally


class Progress:
    """One status line on stderr, about every second, with the rates of the last interval,
    then one with the whole phase's figures, the same as its summary's."""

    def __init__(self, label: str, clients: Sequence[Tallied], length_s: float,
                 enabled: bool) -> None:
        self.label, self.clients, self.length_s = label, clients, length_s
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.monotonic()
        self.seen = [0] * len(clients)
        self.prev = (0, 0, 0)

    def tick(self) -> None:
        now = time.monotonic()
        fresh: list[float] = []
        for i, c in enumerate(self.clients):
            fresh += c.tally.latencies_ms[self.seen[i]:]
            self.seen[i] = len(c.tally.latencies_ms)
        ok = sum(c.tally.codes["OK"] for c in self.clients)
        failed = sum(sum(c.tally.codes.values()) for c in self.clients) - ok
        samples = sum(c.tally.samples for c in self.clients)
        nbytes = sum(c.tally.bytes for c in self.clients)
        dt = max(now - self.last, 1e-9)
        p = percentiles(fresh)
        self._write(f"[{self.label} {now - self.start:5.1f}/{self.length_s:.0f}s] "
                    f"{(ok - self.prev[0]) / dt:8.1f} RPC/s {(samples - self.prev[1]) / dt:9.0f} "
                    f"samples/s {(nbytes - self.prev[2]) / 1e6 / dt:7.1f} MB/s  "
                    f"p50 {p['p50'] or 0:7.1f} ms  p99 {p['p99'] or 0:7.1f} ms  "
                    f"reads {ok:,}  failed {failed:,}")
        self.last, self.prev = now, (ok, samples, nbytes)

    def close(self, tally: Tally, elapsed_s: float) -> None:
        """The phase's line: its figures over ``elapsed_s``, as ``summarize`` gives them."""
        s = summarize(tally, elapsed_s, None)
        lat, failed = s["latency_ms"], sum(s["codes"].values()) - s["reads"]
        self._write(f"[{self.label} done in {s['elapsed_s']:.1f}s] {s['rpc_per_s']:,.1f} RPC/s "
                    f"{s['samples_per_s']:,.0f} samples/s {s['mb_per_s']:,.1f} MB/s  "
                    f"p50 {lat['p50'] or 0:.1f} ms  p99 {lat['p99'] or 0:.1f} ms  "
                    f"reads {s['reads']:,}  failed {failed:,}  (whole phase)")
        if self.enabled and self.tty:
            sys.stderr.write("\n")

    def _write(self, line: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r{line}\x1b[K" if self.tty else f"{line}\n")
            sys.stderr.flush()
