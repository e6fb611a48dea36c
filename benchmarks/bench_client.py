"""DataLoader throughput: in-process zarr and TensorStore Datasets against WindowDataset.

    python benchmarks/bench_client.py [--root data/bench] [--batches 30]

DataLoader with 2 workers, batch 64, random samples over all frames. Two keymaps: the
mecka keymap's numeric entries, and the whole mecka keymap with the 640x360 front camera
decoded. Each configuration runs the same indices twice: a first pass (cold caches) and a
second (warm). Throughput is timed from the first batch on, so worker start-up is excluded.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from baselines import PerEntryReader, PerKeyReader, window_rows
from common import MECKA, NUMERIC_MECKA, ensure_dataset, table
from torch.utils.data import DataLoader, Dataset, default_collate

from episerve_client import WindowDataset, collate
from episerve_client.data.jpeg import decode_column, decode_rgb, to_chw
from episerve_tools.launch import DaemonProcess

WORKERS, BATCH = 2, 64


def _chw(jpeg: bytes) -> np.ndarray:
    img = decode_rgb(jpeg)
    out = np.empty((3, *img.shape[:2]), np.float32)
    to_chw(img, out)
    return out


def _tensors(sample: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sample.items():
        if isinstance(v, bytes):
            out[k] = torch.from_numpy(_chw(v))
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            out[k] = torch.from_numpy(np.stack([_chw(x) for x in v]))
        elif isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(v)
        elif isinstance(v, list):
            out[k] = " | ".join(v)
    return out


class Index(Dataset[dict[str, Any]]):
    """Global index over (hash, total_frames) episodes sorted by hash."""

    def __init__(self, episodes: list[tuple[str, int]]) -> None:
        self.episodes = episodes
        self.starts = np.concatenate([[0], np.cumsum([t for _, t in episodes])])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, g: int) -> tuple[str, int]:
        e = int(np.searchsorted(self.starts, g, side="right")) - 1
        return self.episodes[e][0], g - int(self.starts[e])


class ZarrDataset(Index):
    def __init__(self, cls: type, root: str, keymap: dict[str, Any],
                 episodes: list[tuple[str, int]]) -> None:
        super().__init__(episodes)
        self.cls, self.root, self.keymap, self.reader = cls, root, keymap, None

    def __getitem__(self, g: int) -> dict[str, Any]:
        if self.reader is None:
            self.reader = self.cls(self.root, self.keymap)
        return _tensors(self.reader.sample(*self.locate(g)))


class TensorStoreDataset(Index):
    """Numeric keys through TensorStore's zarr3 driver, with its cache pool enabled."""

    def __init__(self, root: str, keymap: dict[str, Any], episodes: list[tuple[str, int]],
                 cache_bytes: int = 1 << 30) -> None:
        super().__init__(episodes)
        self.root, self.keymap, self.cache_bytes = root, keymap, cache_bytes
        self.arrays: dict[tuple[str, str], Any] = {}
        self.context: Any = None

    def _array(self, episode: str, key: str) -> Any:
        import tensorstore as ts

        if self.context is None:
            self.context = ts.Context({"cache_pool": {"total_bytes_limit": self.cache_bytes}})
        if (episode, key) not in self.arrays:
            spec = {"driver": "zarr3", "kvstore": {
                "driver": "file", "path": f"{self.root}/{episode}.zarr/{key}"}}
            self.arrays[episode, key] = ts.open(spec, context=self.context, read=True).result()
        return self.arrays[episode, key]

    def __getitem__(self, g: int) -> dict[str, Any]:
        episode, i = self.locate(g)
        total = dict(self.episodes)[episode]
        plans: dict[str, list[tuple[str, list[int], bool]]] = {}
        for name, spec in self.keymap.items():
            rows, axis = window_rows(spec, i, total, 30.0)
            plans.setdefault(spec["zarr_key"], []).append((name, rows, axis))
        out = {}
        for key, entries in plans.items():
            lo = min(min(r) for _, r, _ in entries)
            hi = max(max(r) for _, r, _ in entries) + 1
            block = self._array(episode, key)[lo:hi].read().result()
            for name, rows, axis in entries:
                data = np.asarray(block[[r - lo for r in rows]], dtype=np.float32)
                out[name] = torch.from_numpy(data if axis else data[0])
        return out


class DecodeOnly(Index):
    """The decode-only bound: the same frames, already in memory, decoded per batch straight
    into one [B, 3, H, W] array (as WindowDataset does), with nothing else to do."""

    def __init__(self, frames: dict[tuple[str, int], bytes], episodes: list[tuple[str, int]]):
        super().__init__(episodes)
        self.frames = frames

    def __getitem__(self, g: int) -> dict[str, Any]:
        return {"front": torch.from_numpy(_chw(self.frames[self.locate(g)]))}

    def __getitems__(self, gs: list[int]) -> dict[str, Any]:
        frames = [self.frames[self.locate(g)] for g in gs]
        out, _ = decode_column(frames, np.arange(len(frames), dtype=np.int32))
        return {"front": torch.from_numpy(out)}


def _columns(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker_pids() -> list[int]:
    pids = []
    for task in Path("/proc/self/task").iterdir():
        children = (task / "children").read_text().split()
        pids += [int(p) for p in children]
    return pids


def run(ds: Dataset[Any], indices: list[int], coll: Callable[..., Any],
        then: Callable[[Any], Any] | None = None) -> tuple[float, float, float]:
    """(first-pass samples/s, second-pass samples/s, peak worker RSS MB); ``then`` runs on
    each batch in the main process, as a training step's first line would."""
    loader = DataLoader(ds, batch_size=BATCH, sampler=indices, num_workers=WORKERS,
                        collate_fn=coll, persistent_workers=True, prefetch_factor=2)
    step = then or (lambda batch: batch)
    rates = []
    for _ in range(2):
        it = iter(loader)
        step(next(it))
        start, n = time.perf_counter(), 0
        for batch in it:
            n += len(next(iter(step(batch).values())))
        rates.append(n / (time.perf_counter() - start))
    rss = max((peak_rss_mb(p) for p in worker_pids()), default=float("nan"))
    del it, loader
    return rates[0], rates[1], rss


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
                                                    _columns)
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
