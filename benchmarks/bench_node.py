"""The daemon's CPU per 1,000 samples under load, hit path and miss path, against memcpy.

    python benchmarks/bench_node.py [--root data/bench] [--episodes 200] [--seconds 10]

Runs a daemon over the dataset, drives it with ``episerve loadtest`` (16 clients, batch 64)
and reads the daemon's own CPU time (user + system, every thread) from /proc before and
after, so other work on the machine does not count. For each keymap (numeric mecka, and the
mecka keymap with the front camera's JPEG bytes) it reports:

- warm: the cache holds everything (after 15 s of warm-up over the same episodes);
- miss: the cache is off, so every chunk of every batch is fetched and decoded;
- the time to memcpy the same response bytes, as the physical floor;
- gRPC's own floor: the server CPU of an echo server answering the same clients with
  responses of the same size (``grpc_floor.py``), the part of the cost that is not the
  daemon's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from common import MECKA, NUMERIC_MECKA, args, ensure_dataset, table
from grpc_floor import floor_ms_per_k

from episerve_tools.launch import DaemonProcess

CLIENTS = 16
BATCH = 64
# The first N episodes: few enough that a warm-up pass puts every frame in the cache.
EPISODES = 24


def daemon_cpu_s(pid: int) -> float:
    """User + system CPU of a process and all its threads, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadtest(target: str, keymap: Path, seconds: float, warmup: float) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "episerve_tools.cli", "loadtest", target,
                        "--episodes", str(EPISODES),
                        "-c", str(CLIENTS), "--batch", str(BATCH), "--duration", str(seconds),
                        "--warmup", str(warmup), "--keymap", str(keymap), "--json", out.name,
                        "--timeout-s", "120"],
                       check=True, capture_output=True)
        report: dict[str, float] = json.loads(Path(out.name).read_text())
    return report


def measure(root: str, keymap: Path, cache: str,
            seconds: float) -> tuple[float, float, float, float]:
    """(daemon CPU ms per 1k samples, samples/s, MB per 1k samples, cache hit rate)."""
    with DaemonProcess(root, "--cache-bytes", cache, "--log-level", "WARNING") as d:
        if cache != "0":
            loadtest(d.target, keymap, 15.0, 0.0)  # fill the cache
        before = daemon_cpu_s(d.pid)
        report = loadtest(d.target, keymap, seconds, 0.0)
        used = daemon_cpu_s(d.pid) - before
    samples = report["samples_per_s"] * report["elapsed_s"]
    mb_per_k = report["mb_per_s"] / report["samples_per_s"] * 1000
    return used / samples * 1e6, report["samples_per_s"], mb_per_k, report["cache_hit_rate"]


def memcpy_ms_per_k(mb_per_k: float) -> float:
    src = np.ones(int(mb_per_k * 1e6) // 8 + 1, np.float64)
    dst = np.empty_like(src)
    reps = 50
    start = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    opts = args(__doc__ or "")
    seconds = float(os.environ.get("BENCH_SECONDS", "10"))
    ensure_dataset(opts.root, opts.episodes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, km in (("numeric", NUMERIC_MECKA), ("mecka + camera bytes", MECKA)):
            path = Path(tmp) / f"{name.split()[0]}.yaml"
            path.write_text(yaml.safe_dump(km))
            warm, warm_rate, mb, hits = measure(opts.root, path, "8GiB", seconds)
            miss, miss_rate, _, _ = measure(opts.root, path, "0", seconds)
            floor = memcpy_ms_per_k(mb)
            echo = floor_ms_per_k(int(mb * 1e6 * BATCH / 1000), clients=CLIENTS, batch=BATCH)
            rows.append((name, f"{warm:.1f}", f"{hits:.1%}", f"{warm_rate:,.0f}", f"{miss:.1f}",
                         f"{miss_rate:,.0f}", f"{miss / warm:.2f}x", f"{mb:.1f}",
                         f"{floor:.2f}", f"{echo:.1f}"))
    print(f"the first {EPISODES} of {opts.episodes} episodes, {CLIENTS} clients x batch {BATCH}, "
          f"{seconds:g} s per run; daemon CPU from /proc")
    print(table(rows, ("keymap", "warm CPU ms/1k", "warm hit rate", "warm samples/s",
                       "miss CPU ms/1k",
                       "miss samples/s", "miss/warm", "MB/1k", "memcpy ms/1k",
                       "gRPC echo ms/1k")))


if __name__ == "__main__":
    main()
