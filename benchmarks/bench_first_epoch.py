"""The first epoch against the second, through a real DataLoader, cold daemon each time.

    python benchmarks/bench_first_epoch.py [--root data/bench] [--episodes 100]

DataLoader with 2 workers, batch 64, the mecka keymap's numeric entries, a full shuffle of
every frame of the first ``--episodes`` episodes (a new permutation each epoch). For each
configuration a fresh daemon (cache 8 GiB) serves two epochs: the first finds the cache
empty, the second warm. Throughput is timed from each epoch's first batch on, so worker
start-up is excluded (workers come from a fork server: this process reads the daemon's
counters over gRPC, and must not fork workers after that). Configurations:

- local disk;
- 20 ms injected per store request (``--inject-latency-s 0.02``, a ``LatencyStore``:
  requests overlap, as on an object store), without hints;
- the same with prefetch hints: the batch sampler below attaches to each batch the indices
  of the batch ``LOOKAHEAD`` batches later (``.prefetch``), which ``WindowDataset`` sends
  with its read (until the library's own sampler does this, this tiny one stands in);
- the same with ``--preload numeric`` (the epoch starts at once, while the preload runs).

It prints samples/s per epoch, the ratio, and the daemon's counters over the first epoch:
chunks fetched, duplicate fetches (must be 0), chunks taken from fetches in flight, and the
hint and preload traffic.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import NUMERIC_MECKA, ensure_dataset, table
from torch.utils.data import DataLoader, Sampler

from episerve_client import Client, WindowDataset, collate
from episerve_tools.launch import DaemonProcess

WORKERS, BATCH = 2, 64
LOOKAHEAD = 4  # batches: past the DataLoader's own prefetch (2 workers x 2 batches)
LATENCY_S = "0.02"
COUNTERS = ("chunks_fetched", "duplicate_fetches", "shared_fetches", "cache_hits",
            "cache_misses", "prefetch_hinted_samples", "prefetch_chunks", "prefetch_dropped",
            "preload_chunks")


class Hinted(list[int]):
    """A batch of indices that also names the indices of a batch to come."""

    prefetch: list[int]


class ShuffledBatches(Sampler[list[int]]):
    """A full shuffle per epoch, in batches; with ``hints``, each batch carries the indices
    of the batch ``LOOKAHEAD`` later as ``.prefetch``."""

    def __init__(self, n: int, hints: bool, seed: int = 0) -> None:
        self.n, self.hints, self.seed, self.epoch = n, hints, seed, 0

    def __len__(self) -> int:
        return -(-self.n // BATCH)

    def __iter__(self) -> Iterator[list[int]]:
        order = np.random.default_rng(self.seed + self.epoch).permutation(self.n).tolist()
        self.epoch += 1
        batches = [order[k: k + BATCH] for k in range(0, self.n, BATCH)]
        for p, b in enumerate(batches):
            out = Hinted(b)
            ahead = p + LOOKAHEAD
            out.prefetch = batches[ahead] if self.hints and ahead < len(batches) else []
            yield out


def epoch(loader: DataLoader[Any]) -> float:
    """Samples/s from the first batch on."""
    it = iter(loader)
    next(it)
    start, n = time.perf_counter(), 0
    for batch in it:
        n += len(next(iter(batch.values())))
    return n / (time.perf_counter() - start)


def run(root: str, episodes: list[str], flags: tuple[str, ...], hints: bool,
        tmp: str, name: str) -> tuple[float, float, dict[str, int]]:
    with DaemonProcess(root, "--cache-bytes", "8GiB", "--log-level", "WARNING", *flags,
                       unix=f"{tmp}/{name}.sock") as d:
        ds = WindowDataset(d.target, NUMERIC_MECKA, episodes=episodes)
        loader = DataLoader(ds, batch_sampler=ShuffledBatches(len(ds), hints),
                            num_workers=WORKERS, collate_fn=collate, persistent_workers=True,
                            prefetch_factor=2, multiprocessing_context="forkserver")
        with Client(d.target) as c:
            before = c.stats()
            cold = epoch(loader)
            after = c.stats()
            warm = epoch(loader)
        del loader
    # -1: a counter this daemon does not keep (an older version, for comparison)
    return cold, warm, {k: after[k] - before[k] if k in after else -1 for k in COUNTERS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--configs", default="local,latency,hints,preload",
                   help="which configurations, comma-separated (default: all four)")
    opts = p.parse_args()
    listed = ensure_dataset(opts.root, opts.episodes)
    episodes = [h for h, _ in listed]
    frames = sum(t for _, t in listed)
    root = str(Path(opts.root).resolve())
    every = {
        "local": ("local disk", (), False),
        "latency": ("20 ms/request, no hints", ("--inject-latency-s", LATENCY_S), False),
        "hints": ("20 ms/request, hints", ("--inject-latency-s", LATENCY_S), True),
        "preload": ("20 ms/request, --preload numeric",
                    ("--inject-latency-s", LATENCY_S, "--preload", "numeric"), False),
    }
    configs = [every[name] for name in opts.configs.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, flags, hints) in enumerate(configs):
            cold, warm, c = run(root, episodes, flags, hints, tmp, f"d{k}")
            hit = c["cache_hits"] / max(1, c["cache_hits"] + c["cache_misses"])
            rows.append((name, f"{cold:,.0f}", f"{warm:,.0f}", f"{cold / warm:.2f}x",
                         f"{c['chunks_fetched']:,}", str(c["duplicate_fetches"]),
                         f"{c['shared_fetches']:,}", f"{hit:.1%}",
                         f"{c['prefetch_hinted_samples']:,} / {c['prefetch_chunks']:,} / "
                         f"{c['prefetch_dropped']:,}", f"{c['preload_chunks']:,}"))
            print(rows[-1], flush=True)
    print(f"{len(episodes)} episodes, {frames:,} samples per epoch, {WORKERS} workers x batch "
          f"{BATCH}, numeric mecka keymap; counters over the first epoch")
    print(table(rows, ("configuration", "epoch 1 samples/s", "epoch 2 samples/s",
                       "epoch 1 / epoch 2", "chunks fetched", "duplicate fetches",
                       "shared fetches", "hit rate", "hinted / prefetched / dropped",
                       "preloaded")))


if __name__ == "__main__":
    main()
