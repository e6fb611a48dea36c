"""A mixture of two WindowDatasets on two daemons: one Read per sub-dataset per batch, the
two Reads in threads or one after the other, against ``ConcatDataset`` (one Read per sample).

    python benchmarks/bench_mixture.py [--root data/bench] [--batch 64] [--reps 5]

Both daemons serve ``--root``; a first pass over every batch warms their caches, then the
three paths read the same batches in rotating order, timed in the main process. The keymap
is the mecka keymap, numeric only and then with the camera decoded; every batch draws half
its samples from each daemon.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from common import MECKA, NUMERIC_MECKA, args, ensure_dataset
from torch.utils.data import ConcatDataset

from episerve_client import WindowDataset
from episerve_client.data.mixture import MixtureDataset, WeightedMixtureSampler
from episerve_tools.launch import DaemonProcess


def main() -> None:
    opts = args(__doc__ or "")
    ensure_dataset(opts.root, opts.episodes)
    for name, keymap in (("numeric mecka", NUMERIC_MECKA), ("mecka with camera", MECKA)):
        run(opts, name, keymap)


def run(opts: Any, label: str, keymap: dict[str, Any]) -> None:
    with DaemonProcess(opts.root) as a, DaemonProcess(opts.root) as b:
        subs = [WindowDataset(a.target, keymap), WindowDataset(b.target, keymap)]
        parallel = MixtureDataset(subs, parallel=True)
        sequential = MixtureDataset(subs, parallel=False)
        concat = ConcatDataset(subs)
        sampler = WeightedMixtureSampler(parallel, [1, 1], batch_size=opts.batch,
                                         num_samples=opts.batch * (opts.reps + 1),
                                         seed=opts.seed)
        batches = list(sampler)
        for batch in batches:  # a first pass fills both daemons' caches for every batch
            sequential.__getitems__(batch)
        paths = [("parallel", parallel.__getitems__), ("sequential", sequential.__getitems__),
                 ("concat", lambda idx: [concat[i] for i in idx])]
        times: dict[str, list[float]] = {name: [] for name, _ in paths}
        for k, batch in enumerate(batches):
            for name, read in paths[k % 3:] + paths[: k % 3]:  # the order rotates
                start = time.perf_counter()
                read(batch)
                times[name].append(time.perf_counter() - start)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"{label}: batch {opts.batch}, two daemons, {opts.reps} batches (medians):")
    for name, t in med.items():
        print(f"  {name:<11} {t * 1e3:8.1f} ms/batch  {opts.batch / t:8.0f} samples/s  "
              f"{med['parallel'] / t:5.2f}x the samples/s of parallel")


if __name__ == "__main__":
    main()
