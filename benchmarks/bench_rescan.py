"""Stalls: the slowest Read while a rescan drops or adds 10% of 1,600 episodes with a full
cache, against the Read just before it; listing sizes and times; WindowDataset construction.

    python benchmarks/bench_rescan.py --base /tmp/base100 --root /tmp/root1600

``--root`` is built (if it holds fewer than ``--episodes``) from the synthetic episodes of
``--base`` (``episerve make-dataset BASE --episodes 100 --min-frames 30 --max-frames 60``):
episode ``k`` of the root is base episode ``k mod len(base)`` under its own name, its files
hard links (the daemon sees 1,600 distinct episodes; the disk holds the base once). One
process reads random batches (mecka keymap, camera bytes included) back to back, the main
process moves 10% of the episodes out of the root, lists (which rescans), waits, moves them
back and lists again. Targets (issue 14): slowest Read during a rescan <= 20 ms over the Read
just before it; WindowDataset construction <= 0.3 s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from common import MECKA, random_batches, replicate, table

from episerve_client import Client, messages
from episerve_tools.launch import DaemonProcess


def _read_loop(target: str, batches: list[list[tuple[str, int]]], stop: Any, out: Any) -> None:
    spans: list[tuple[float, float]] = []
    errors: list[str] = []
    with Client(target) as client:
        k = 0
        while not stop.is_set():
            batch = batches[k % len(batches)]
            k += 1
            start = time.monotonic()
            try:
                client.read(MECKA, batch)
            except Exception as exc:  # a read of a moved-away episode: reported, not hidden
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
            spans.append((start, time.monotonic()))
    out.put((spans, errors))


class Reader:
    """Back-to-back reads in a process of their own, so that nothing this benchmark's
    process does (listing, parsing) delays them; records (start, end) of each on the
    monotonic clock, which every process shares."""

    def __init__(self, target: str, batches: list[list[tuple[str, int]]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self._out = ctx.Queue()
        self._proc = ctx.Process(target=_read_loop, args=(target, batches, self.stop, self._out),
                                 daemon=True)
        self.spans: list[tuple[float, float]] = []
        self.errors: list[str] = []

    def start(self) -> None:
        self._proc.start()

    def join(self) -> None:
        self.spans, self.errors = self._out.get(timeout=300)
        self._proc.join()


def stall(spans: list[tuple[float, float]], window: tuple[float, float]) -> tuple[float, ...]:
    """(slowest read overlapping the window, the read just before it, median before), ms."""
    lo, hi = window
    during = sorted(e - s for s, e in spans if s < hi and e > lo)
    before = [e - s for s, e in spans if e <= lo]
    return (during[-1] * 1e3, before[-1] * 1e3, statistics.median(before[-50:]) * 1e3,
            len(during), during[len(during) // 2] * 1e3, during[int(len(during) * 0.9)] * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", default="/tmp/base100")
    p.add_argument("--root", default="/tmp/root1600")
    p.add_argument("--episodes", type=int, default=1600)
    p.add_argument("--cache-bytes", default="4GiB")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.1)
    opts = p.parse_args()
    root, aside = Path(opts.root), Path(opts.root + ".aside")
    replicate(Path(opts.base), root, opts.episodes)
    aside.mkdir(exist_ok=True)
    for moved in aside.glob("*.zarr"):  # an interrupted run: put everything back
        moved.rename(root / moved.name)
    sock = Path(f"/tmp/bench_rescan_{os.getpid()}.sock")
    with DaemonProcess(root, "--cache-bytes", opts.cache_bytes, "--rescan-s", "0",
                       "--log-level", "WARNING", unix=sock) as d, Client(d.target) as client:
        full_t = time.perf_counter()
        listing = client.list_episodes()
        full_t = time.perf_counter() - full_t
        brief_t = time.perf_counter()
        client.list_episodes(brief=True)
        brief_t = time.perf_counter() - brief_t
        sizes = {b: len(client._run(client.unary_flow("ListEpisodes",
                                                      messages.list_request("", 0, b))))
                 for b in (False, True)}
        episodes = [(e.hash, e.total_frames) for e in listing.episodes]
        warm_t = time.perf_counter()
        every = [(h, f) for h, t in episodes for f in range(t)]
        for k in range(0, len(every), 256):  # the whole dataset into the cache
            client.read(MECKA, every[k: k + 256])
        warm_t = time.perf_counter() - warm_t
        stats = client.stats()
        print(f"{len(episodes)} episodes, {len(every)} frames; cache warmed in {warm_t:.1f} s: "
              f"{stats['cache_bytes'] / 2**20:.0f} MiB in {stats['cache_entries']} entries, "
              f"{stats['cache_evictions']} evictions")
        rng = random.Random(0)
        moved = rng.sample([h for h, _ in episodes], int(len(episodes) * opts.fraction))
        kept = [e for e in episodes if e[0] not in set(moved)]
        reader = Reader(d.target, random_batches(kept, 400, opts.batch, 0))
        reader.start()
        time.sleep(8.0)  # the reader's interpreter starts, then 3 s or more of reads
        windows = {}
        for what, src, dst in (("remove", root, aside), ("add", aside, root)):
            for h in moved:
                (src / f"{h}.zarr").rename(dst / f"{h}.zarr")
            start = time.monotonic()
            listed = client.list_episodes(brief=True)
            windows[what] = (start, time.monotonic())
            want = len(episodes) - (len(moved) if what == "remove" else 0)
            assert len(listed.episodes) == want, (what, len(listed.episodes), want)
            time.sleep(2.0)
        reader.stop.set()
        reader.join()
        ds_t = []
        from episerve_client.data.dataset import WindowDataset

        for _ in range(3):
            t = time.perf_counter()
            ds = WindowDataset(d.target, MECKA)
            ds_t.append(time.perf_counter() - t)
        assert len(ds.episodes) == len(episodes)
    rows = []
    for what, window in windows.items():
        slow, before, med, n, p50, p90 = stall(reader.spans, window)
        rows.append((f"rescan that {what}s {len(moved)}", f"{(window[1] - window[0]) * 1e3:.0f}",
                     f"{n}", f"{p50:.1f} / {p90:.1f}", f"{slow:.1f}", f"{before:.1f}",
                     f"{med:.1f}", f"{slow - before:+.1f}"))
    idle = sorted(e - s for s, e in reader.spans if e <= windows["remove"][0])
    print(f"reads before the first rescan: p50 {idle[len(idle) // 2] * 1e3:.1f} ms, "
          f"p90 {idle[int(len(idle) * 0.9)] * 1e3:.1f} ms, max {idle[-1] * 1e3:.1f} ms")
    print(table(rows, ("event", "rescan+list ms", "reads during", "p50 / p90 during ms",
                       "slowest read ms", "read before ms", "median before ms",
                       "slowest - before ms")))
    print(f"reads: {len(reader.spans)}, failed: {len(reader.errors)} "
          f"{reader.errors[:2] if reader.errors else ''}")
    print(f"ListEpisodes at {len(episodes)} episodes: full {sizes[False] / 1e6:.2f} MB in "
          f"{full_t * 1e3:.0f} ms, brief {sizes[True] / 1e3:.0f} kB in {brief_t * 1e3:.0f} ms "
          f"(each call includes a rescan)")
    print(f"WindowDataset construction: {', '.join(f'{t:.2f}' for t in ds_t)} s "
          f"(target <= 0.3 s)")


if __name__ == "__main__":
    main()
