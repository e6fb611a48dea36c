"""``WindowSampler(locality=N)``: chunks fetched per sample and cold throughput.

    python benchmarks/bench_locality.py [--root data/bench] [--batches 20] [--reps 2]

Per configuration a fresh daemon (empty chunk cache), a DataLoader with 2 workers and
batch 64 over the numeric mecka keymap, the first ``--batches`` batches of epoch 0 of
``WindowSampler`` (full shuffle, then locality 1, 4, 16: batches drawn from pools of that
many 100-row neighbourhoods). Reported: chunks the daemon fetched per sample read (its
``chunks_fetched`` counter) and samples/s from the second batch on (worker start-up and the
first batch excluded, as in bench_client.py; workers are spawned, since this process reads
the daemon's counters between passes). Configurations alternate within each
repetition, so they share the machine's state (the OS page cache is warm after the first).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import NUMERIC_MECKA, ensure_dataset, table
from torch.utils.data import DataLoader

from episerve_client import Client, WindowDataset, collate
from episerve_client.data.manifest import Manifest
from episerve_client.data.sampler import WindowSampler
from episerve_tools.launch import DaemonProcess

WORKERS, BATCH = 2, 64
LOCALITIES = (None, 1, 4, 16)


def cold_pass(root: str, sock: str, manifest: Manifest, locality: int | None,
              batches: int) -> tuple[float, float, float]:
    """(chunks fetched per sample, samples/s, distinct episodes per batch)."""
    with DaemonProcess(root, "--log-level", "WARNING", "--rescan-s", "0", unix=sock) as d:
        ds = WindowDataset(d.target, NUMERIC_MECKA, episodes=list(manifest.hashes))
        sampler = WindowSampler(manifest, BATCH, seed=0, locality=locality)
        episodes = [len({manifest.locate(g)[0] for g in b})
                    for b, _ in zip(sampler, range(batches + 1), strict=False)]
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=WORKERS, collate_fn=collate,
                            prefetch_factor=2, multiprocessing_context="spawn")
        it = iter(loader)
        next(it)
        start, timed = time.perf_counter(), 0
        for _ in range(batches):
            timed += len(next(it)["frame_index"])
        elapsed = time.perf_counter() - start
        del it, loader
        with Client(d.target) as client:
            stats = client.stats()  # samples_read includes the batches workers prefetched
    return stats["chunks_fetched"] / stats["samples_read"], timed / elapsed, float(
        np.mean(episodes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    opts = p.parse_args()
    manifest = Manifest.of(ensure_dataset(opts.root, opts.episodes))
    root = str(Path(opts.root).resolve())
    runs: dict[int | None, list[tuple[float, float, float]]] = {k: [] for k in LOCALITIES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(opts.reps):
            for locality in LOCALITIES:
                runs[locality].append(cold_pass(root, f"{tmp}/d.sock", manifest, locality,
                                                opts.batches))
                print(rep, locality, runs[locality][-1], flush=True)
    full = np.median([r[1] for r in runs[None]])
    rows = []
    for locality, rs in runs.items():
        chunks, rate, eps = (float(np.median([r[i] for r in rs])) for i in range(3))
        rows.append(("full shuffle" if locality is None else f"locality={locality}",
                     f"{eps:.1f}", f"{chunks:.2f}", f"{rate:.0f}", f"{rate / full:.2f}x",
                     " / ".join(f"{r[1]:.0f}" for r in rs)))
    print(table(rows, ("sampler", "episodes per batch", "chunks fetched per sample",
                       "cold samples/s (median)", "vs full shuffle", "each run")))


if __name__ == "__main__":
    main()
