"""The DataLoader side the client benchmarks share: baseline Datasets (in-process zarr,
TensorStore, decode only), the loop that times two passes over the same indices, and the
workers' peak RSS. ``bench_client.py`` compares them; others reuse them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from baselines import window_rows
from common import BATCH
from torch.utils.data import DataLoader, Dataset

from episerve_client.data.jpeg import decode_column, decode_rgb, to_chw

WORKERS = 2


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


def columns(batch: dict[str, Any]) -> dict[str, Any]:
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
