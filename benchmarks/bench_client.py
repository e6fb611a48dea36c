"""DataLoader throughput: in-process zarr and TensorStore Datasets against WindowDataset.

    python benchmarks/bench_client.py [--root data/bench] [--batches 30]

DataLoader with 2 workers, batch 64, random samples over all frames. Two keymaps: the
mecka keymap's numeric entries, and the whole mecka keymap with the 640x360 front camera
decoded. Each configuration runs the same indices twice: a first pass (cold caches) and a
second (warm). Throughput is timed from the first batch on, so worker start-up is excluded.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from baselines import PerEntryReader, PerKeyReader
from common import BATCH, MECKA, NUMERIC_MECKA, ensure_dataset, table
from loaders import (
    DecodeOnly,
    Index,
    TensorStoreDataset,
    ZarrDataset,
    columns,
    peak_rss_mb,
    run,
)
from torch.utils.data import Dataset, default_collate

from episerve_client import WindowDataset, collate
from episerve_tools.launch import DaemonProcess


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--slow-batches", type=int, default=6, help="for the per-entry loader")
    opts = p.parse_args()
    episodes = ensure_dataset(opts.root, opts.episodes)
    root = str(Path(opts.root).resolve())
    index = Index(episodes)
    rng = np.random.default_rng(0)
    indices = rng.permutation(len(index))[: (opts.batches + 1) * BATCH].tolist()
    slow = indices[: (opts.slow_batches + 1) * BATCH]
    keymaps = {"numeric": {k: v for k, v in NUMERIC_MECKA.items()}, "camera": MECKA}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, keymap in keymaps.items():
            with DaemonProcess(root, "--log-level", "WARNING", "--cache-bytes", "8GiB",
                               unix=f"{tmp}/{kind}.sock") as d:
                configs: dict[str, tuple[Dataset[Any], list[int], Callable[..., Any]]] = {
                    "(a) per entry, in process": (
                        ZarrDataset(PerEntryReader, root, keymap, episodes), slow,
                        default_collate),
                    "(b) per key, in process": (
                        ZarrDataset(PerKeyReader, root, keymap, episodes), indices,
                        default_collate),
                }
                if kind == "numeric":
                    configs["(c) TensorStore + cache pool"] = (
                        TensorStoreDataset(root, keymap, episodes), indices, default_collate)
                else:
                    frames = PerKeyReader(root, {"f": MECKA["observations.images.front_img_1"]})
                    mem = {index.locate(g): frames.sample(*index.locate(g))["f"]
                           for g in indices}
                    configs["decode-only bound"] = (DecodeOnly(mem, episodes), indices,
                                                    columns)
                configs["(d) WindowDataset, daemon"] = (WindowDataset(d.target, keymap),
                                                       indices, collate)
                for name, (ds, idx, coll) in configs.items():
                    cold, warm, rss = run(ds, idx, coll)
                    rows.append((kind, name, f"{cold:.0f}", f"{warm:.0f}", f"{rss:.0f}"))
                    print(rows[-1], flush=True)
                rows.append((kind, "daemon peak RSS", "", "", f"{peak_rss_mb(d.pid):.0f}"))
    print(table(rows, ("keymap", "loader", "samples/s first pass", "samples/s second pass",
                       "peak RSS MB (worker)")))


if __name__ == "__main__":
    main()
