"""Daemon RSS under a churn load: ``episerve loadtest`` over more data than the cache, at
several ``--cache-bytes`` budgets and allocator settings, side by side in one run.

    python benchmarks/bench_memory.py --base data/bench --root /tmp/mem_root --copies 3

``--root`` is built from ``--copies`` copies of ``--base`` under new episode names, as hard
links (the daemon sees distinct episodes; the disk holds the base once). Each run starts a
daemon, lets it open the catalog (its RSS then is the *start-up* figure), drives it with
``loadtest`` (16 clients, batch 64, mecka keymap with camera bytes, uniform over every
frame, so the cache keeps evicting) for a warm-up that fills the cache, then ``--duration``
seconds, and samples the daemon's RSS every 0.1 s over both (and its kernel high-water
mark, VmHWM). Target (issue 14): RSS at most
1.15 x cache-bytes plus a fixed overhead; the overhead figure printed is
``peak - 1.15 x cache-bytes`` and the start-up RSS it contains.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from common import replicate, table

from episerve_client import Client
from episerve_tools.launch import DaemonProcess

GIB = 2**30


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid``, bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def one_run(root: Path, cache: int, env: dict[str, str], duration_s: float,
            sock: Path, warmup_s: float) -> dict[str, float]:
    with DaemonProcess(root, "--cache-bytes", str(cache), "--rescan-s", "0",
                       "--log-level", "WARNING", unix=sock, env=env) as d:
        with Client(d.target) as c:
            episodes = len(c.list_episodes(brief=True).episodes)
        start_rss = rss(d.pid)[0]
        samples: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.1):
                samples.append(rss(d.pid)[0])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out = Path(f"/tmp/bench_memory_{os.getpid()}.json")
        subprocess.run([sys.executable, "-m", "episerve_tools.cli", "loadtest", d.target,
                        "-c", "16", "-b", "64", "-d", str(duration_s), "--warmup", str(warmup_s),
                        "--quiet", "--json", str(out)], check=True, capture_output=True)
        done.set()
        sampler.join()
        with Client(d.target) as c:
            stats = c.stats()
        end_rss, hwm = rss(d.pid)
        report = json.loads(out.read_text())
    return {"episodes": episodes, "start": start_rss, "peak": max(samples), "hwm": hwm,
            "end": end_rss, "cache_bytes": stats["cache_bytes"],
            "evictions": stats["cache_evictions"], "samples_s": report["samples_per_s"],
            "ok": report["codes"].get("OK", 0), "failed": sum(
                n for code, n in report["codes"].items() if code != "OK")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", default="data/bench")
    p.add_argument("--root", default="/tmp/mem_root")
    p.add_argument("--copies", type=int, default=3)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--cache", default="1,4", help="budgets in GiB")
    p.add_argument("--fill-s-per-gib", type=float, default=45.0,
                   help="unmeasured warm-up per GiB of budget, so the cache is full (and "
                   "evicting) when the measured 30 s start (default 45: ~25 MB/s of fill)")
    p.add_argument("--allocators", default="tuned,arena1",
                   help="tuned: the daemon's own mallopt settings (2 arenas, 4 MiB mmap "
                   "threshold); arena1: the same with MALLOC_ARENA_MAX=1 in the environment")
    p.add_argument("--runs", default="", help="explicit GIB:ALLOCATOR pairs, e.g. 1:tuned,4:tuned")
    opts = p.parse_args()
    base, root = Path(opts.base), Path(opts.root)
    replicate(base.resolve(), root, opts.copies * len(list(base.glob("*.zarr"))))
    envs = {"tuned": {}, "arena1": {"MALLOC_ARENA_MAX": "1"}}
    rows = []
    runs = [(float(g), a) for g in opts.cache.split(",") for a in opts.allocators.split(",")]
    if opts.runs:
        runs = [(float(g), a) for g, a in (r.split(":") for r in opts.runs.split(","))]
    for gib, name in runs:
        cache = int(gib * GIB)
        r = one_run(root, cache, envs[name], opts.duration,
                    Path(f"/tmp/bench_memory_{os.getpid()}.sock"),
                    opts.fill_s_per_gib * gib)
        limit = 1.15 * cache
        rows.append((f"{gib:g} GiB", name, f"{r['episodes']:.0f}",
                     f"{r['start'] / 2**20:.0f}", f"{r['peak'] / 2**20:.0f}",
                     f"{r['hwm'] / 2**20:.0f}", f"{r['end'] / 2**20:.0f}",
                     f"{r['cache_bytes'] / 2**20:.0f}", f"{r['evictions']:.0f}",
                     f"{r['peak'] / cache:.2f}x", f"{(r['peak'] - limit) / 2**20:+.0f}",
                     f"{r['samples_s']:.0f}", f"{r['failed']:.0f}"))
        print(rows[-1], flush=True)
    print(table(rows, ("budget", "allocator", "episodes", "start MiB", "peak RSS MiB",
                       "VmHWM MiB", "end MiB", "cache MiB", "evictions", "peak/budget",
                       "peak - 1.15x budget MiB", "samples/s", "failed")))


if __name__ == "__main__":
    main()
