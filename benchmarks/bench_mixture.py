"""A mixture of two WindowDatasets on two daemons: one Read per sub-dataset per batch, the
two Reads in threads or one after the other, against ``ConcatDataset`` (one Read per sample).

    python benchmarks/bench_mixture.py [--root data/bench] [--batch 64] [--reps 5]

Both daemons serve ``--root`` (warm cache after a first pass); the keymap is the mecka
keymap (camera frames decoded); every batch draws half its samples from each daemon.
Timed in the main process, the three paths alternating on the same batches.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from common import MECKA, args, ensure_dataset
from torch.utils.data import ConcatDataset

from episerve_client import WindowDataset
from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
from episerve_tools.launch import DaemonProcess


def main() -> None:
    opts = args(__doc__ or "")
    ensure_dataset(opts.root, opts.episodes)
    with DaemonProcess(opts.root) as a, DaemonProcess(opts.root) as b:
        subs = [WindowDataset(a.target, MECKA), WindowDataset(b.target, MECKA)]
        parallel, sequential = MixtureDataset(subs), MixtureDataset(subs, parallel=False)
        concat = ConcatDataset(subs)
        sampler = WeightedMixtureSampler(parallel, [1, 1], batch_size=opts.batch,
                                         num_samples=opts.batch * (opts.reps + 1),
                                         seed=opts.seed)
        batches = list(sampler)
        times: dict[str, list[float]] = {"parallel": [], "sequential": [], "concat": []}
        for k, batch in enumerate(batches):
            for name, read in (("parallel", parallel.__getitems__),
                               ("sequential", sequential.__getitems__),
                               ("concat", lambda idx: [concat[i] for i in idx])):
                start = time.perf_counter()
                read(batch)
                if k:  # the first batch warms the caches and channels
                    times[name].append(time.perf_counter() - start)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"batch {opts.batch}, two daemons, {opts.reps} batches (medians):")
    for name, t in med.items():
        print(f"  {name:<11} {t * 1e3:8.1f} ms/batch  {opts.batch / t:8.0f} samples/s  "
              f"{med['parallel'] / t:5.2f}x the samples/s of parallel")


if __name__ == "__main__":
    main()
