"""Camera frames as uint8 against float32 through a DataLoader, side by side in one run.

    python benchmarks/bench_frames.py [--root data/bench] [--batches 20] [--rounds 2]

The whole mecka keymap with its 640x360 front camera decoded, `WindowDataset` through one
daemon, DataLoader with 2 workers and batch 64, random samples over all frames. Each round
runs `frames="float32"`, `frames="uint8"` and `frames="uint8"` widened by `to_float` in the
main process (what a CPU-only loop pays; on a GPU `to_float` runs on the device), in that
order, each over the same indices twice (the first pass warms the daemon's cache); the rounds
alternate so that a noisy neighbour hits every mode. Reported: the second-pass samples/s
and each mode's peak worker RSS, then the ratio of the medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import BATCH, MECKA, ensure_dataset, table
from loaders import run

from episerve_client import WindowDataset, collate, to_float
from episerve_tools.launch import DaemonProcess


def as_is(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


MODES: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "float32": ("float32", as_is),
    "uint8": ("uint8", as_is),
    "uint8 + to_float in the main process": ("uint8", to_float),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    opts = p.parse_args()
    episodes = ensure_dataset(opts.root, opts.episodes)
    root = str(Path(opts.root).resolve())
    total = sum(t for _, t in episodes)
    indices = np.random.default_rng(0).permutation(total)[: (opts.batches + 1) * BATCH].tolist()
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    rss: dict[str, list[float]] = {m: [] for m in MODES}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(
            root, "--log-level", "WARNING", "--cache-bytes", "8GiB",
            unix=f"{tmp}/frames.sock") as d:
        for r in range(opts.rounds):
            for mode, (frames, then) in MODES.items():
                ds = WindowDataset(d.target, MECKA, frames=frames)
                cold, warm, peak = run(ds, indices, collate, then)
                rates[mode].append(warm)
                rss[mode].append(peak)
                rows.append((str(r), mode, f"{cold:.0f}", f"{warm:.0f}", f"{peak:.0f}"))
                print(rows[-1], flush=True)
    print(table(rows, ("round", "frames", "samples/s first pass", "samples/s second pass",
                       "peak RSS MB per worker")))
    base = statistics.median(rates["float32"])
    for mode in MODES:
        print(f"{mode}: median {statistics.median(rates[mode]):.0f} samples/s, "
              f"{statistics.median(rates[mode]) / base:.2f}x float32; peak worker RSS "
              f"{max(rss[mode]):.0f} MB")


if __name__ == "__main__":
    main()
