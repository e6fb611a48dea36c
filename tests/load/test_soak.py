"""Soak: 16 concurrent clients for 10 minutes against one daemon with a small cache.

The daemon's RSS and open file descriptors are sampled every 5 s. Targets: the cache is
full after the 60 s warm-up; RSS at the end is within 10% of RSS after warm-up; open fds
do not grow (under load, and idle before vs after); no read fails. The figures are printed
and written to ``soak_figures.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from episerve_client import Client
from episerve_tools.launch import DaemonProcess

CLIENTS = 16
WARMUP_S = 60.0
TOTAL_S = 600.0
CACHE_BYTES = 128 * 2**20
EVERY_S = 5.0
TIMEOUT_S = 30.0  # per read: on a shared machine a CPU stall must not count as a failure


def _spread(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


@pytest.mark.load
@pytest.mark.timeout(TOTAL_S + 300)
def test_16_clients_for_10_minutes(load_root: Path, tmp_path: Path,
                                   loadtest: Callable[..., dict[str, Any]],
                                   sampler: Callable[..., Any],
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    with DaemonProcess(load_root, "--rescan-s", "0", "--log-level", "WARNING",
                       "--cache-bytes", str(CACHE_BYTES), unix=tmp_path / "soak.sock") as d, \
            Client(d.target) as probe:

        def cache() -> dict[str, Any]:
            s = probe.stats(timeout_s=10)
            return {"cache_bytes": s["cache_bytes"], "read_rpcs": s["read_rpcs"]}

        watch = sampler(d.pid, EVERY_S, TOTAL_S + 120, extra=cache)
        idle_before = watch.sample()
        watch.start()
        report = loadtest(d.target, "-c", str(CLIENTS), "-d", str(TOTAL_S - WARMUP_S),
                          "--warmup", str(WARMUP_S), "--timeout-s", str(TIMEOUT_S), "--quiet",
                          out=tmp_path / "soak.json", limit_s=TOTAL_S + 180)
        watch.stop()
        time.sleep(2.0)  # the load generator's connection is gone
        idle_after = watch.sample()
    samples = watch.samples[1:-1]  # under load
    warm = [s for s in samples if s["t"] <= WARMUP_S + EVERY_S / 2]
    first = [s for s in samples if WARMUP_S <= s["t"] <= WARMUP_S + 60]
    last = [s for s in samples if s["t"] >= samples[-1]["t"] - 60]
    rss_warm, rss_end = warm[-1]["rss"], samples[-1]["rss"]
    figures = {
        "root": str(load_root), "clients": CLIENTS, "seconds": TOTAL_S,
        "cache_bytes_budget": CACHE_BYTES, "cache_bytes_after_warmup": warm[-1]["cache_bytes"],
        "rss_idle_before_mb": idle_before["rss"] / 1e6, "rss_after_warmup_mb": rss_warm / 1e6,
        "rss_end_mb": rss_end / 1e6, "rss_max_mb": max(s["rss"] for s in samples) / 1e6,
        "rss_change": rss_end / rss_warm - 1,
        "fds_idle_before": idle_before["fds"], "fds_idle_after": idle_after["fds"],
        "fds_minute_after_warmup": _spread([s["fds"] for s in first]),
        "fds_last_minute": _spread([s["fds"] for s in last]),
        "rpc_per_s": report["rpc_per_s"], "samples_per_s": report["samples_per_s"],
        "mb_per_s": report["mb_per_s"], "latency_ms": report["latency_ms"],
        "codes": report["codes"], "cache_hit_rate": report["cache_hit_rate"],
        "loadavg_1min_end": Path("/proc/loadavg").read_text().split()[0],
        "series": [{"t": s["t"], "rss_mb": round(s["rss"] / 1e6, 1), "fds": s["fds"],
                    "cache_mb": round(s["cache_bytes"] / 1e6, 1), "loadavg": s["loadavg"]}
                   for s in watch.samples],
    }
    out = tmp_path_factory.getbasetemp() / "soak_figures.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nsoak figures (written to {out}):")
    print(json.dumps({k: v for k, v in figures.items() if k != "series"}, indent=2))
    print("t s   RSS MB  fds  cache MB  load avg")
    for s in figures["series"][::12]:
        print(f"{s['t']:5.0f} {s['rss_mb']:7.1f} {s['fds']:4d} {s['cache_mb']:8.1f} "
              f"{s['loadavg']:8.2f}")

    assert report["codes"] == {"OK": report["reads"]}
    assert warm[-1]["cache_bytes"] >= 0.9 * CACHE_BYTES, "the cache was not full after warm-up"
    assert abs(rss_end - rss_warm) <= 0.10 * rss_warm
    # Under load the count moves with the chunk files open at that instant: compare medians.
    assert figures["fds_last_minute"]["median"] <= figures["fds_minute_after_warmup"]["median"] + 2
    assert idle_after["fds"] <= idle_before["fds"]
