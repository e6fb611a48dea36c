"""In-process baselines the benchmarks compare against.

- ``PerEntryReader``: the old loader. One zarr call per keymap entry per sample, and each
  call opens the group and the array again.
- ``PerKeyReader``: better. Arrays held open; within one sample, one read per distinct
  zarr key covering the union of that key's windows, then sliced.

Both follow the window rules of docs/KEYMAP.md with plain loops, and return per-sample
dicts of float32 arrays
and raw JPEG bytes. The annotation cutoff is not used by the benchmark keymaps.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

warnings.filterwarnings("ignore", message=".*VariableLengthBytes.*")


def frames(x: float, fps: float) -> int:
    return max(1, round(x * fps))


def window_rows(spec: Mapping[str, Any], i: int, total: int, fps: float) -> tuple[list[int], bool]:
    """(row indices, has a time axis) for one entry at frame i (rules 2-5)."""
    horizon, history, lag = spec.get("horizon"), spec.get("history"), spec.get("lag_s")
    if horizon is not None:
        end = min(i + horizon, total)
        return [min(i + k, end - 1) for k in range(horizon)], True
    if history is not None and (history > 1 or spec["key_type"] == "camera_keys"):
        newest = i - frames(lag, fps) if lag is not None else i
        stride = (frames(spec["history_stride_s"], fps) if spec.get("history_stride_s")
                  else spec.get("history_stride", 1))
        idx = [newest - stride * (history - 1 - k) for k in range(history)]
        real = [r for r in idx if r >= 0]
        fill = real[0] if real else 0
        return [r if r >= 0 else fill for r in idx], True
    if lag is not None:
        return [max(0, i - frames(lag, fps))], False
    return [i], False


def _texts(raw: Any, i: int) -> list[str]:
    out = []
    for item in raw:
        doc = json.loads(bytes(item))
        if doc["start_idx"] >= 0 and doc["end_idx"] > doc["start_idx"] \
                and doc["start_idx"] <= i < doc["end_idx"]:
            out.append(doc["text"])
    return out


class PerEntryReader:
    def __init__(self, root: str | Path, keymap: Mapping[str, Mapping[str, Any]]) -> None:
        self.root, self.keymap = Path(root), keymap

    def sample(self, episode: str, i: int) -> dict[str, Any]:
        path = self.root / f"{episode}.zarr"
        attrs = zarr.open_group(path, mode="r").attrs
        total, fps = attrs["total_frames"], attrs["fps"]
        out: dict[str, Any] = {}
        for name, spec in self.keymap.items():
            array = zarr.open_group(path, mode="r")[spec["zarr_key"]]
            if spec["key_type"] == "annotation_keys":
                out[name] = _texts(array[:], i)
                continue
            rows, axis = window_rows(spec, i, total, fps)
            data = array.get_orthogonal_selection((rows,))
            out[name] = _finish(data, axis)
        return out


class PerKeyReader:
    def __init__(self, root: str | Path, keymap: Mapping[str, Mapping[str, Any]]) -> None:
        self.root, self.keymap = Path(root), keymap
        self._open: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def _episode(self, episode: str) -> tuple[dict[str, Any], dict[str, Any]]:
        if episode not in self._open:
            group = zarr.open_group(self.root / f"{episode}.zarr", mode="r")
            arrays = {k: group[k] for k in {s["zarr_key"] for s in self.keymap.values()}}
            self._open[episode] = (dict(group.attrs), arrays)
        return self._open[episode]

    def sample(self, episode: str, i: int) -> dict[str, Any]:
        attrs, arrays = self._episode(episode)
        total, fps = attrs["total_frames"], attrs["fps"]
        plans: dict[str, list[tuple[str, list[int], bool]]] = {}
        out: dict[str, Any] = {}
        for name, spec in self.keymap.items():
            if spec["key_type"] == "annotation_keys":
                out[name] = _texts(arrays[spec["zarr_key"]][:], i)
                continue
            rows, axis = window_rows(spec, i, total, fps)
            plans.setdefault(spec["zarr_key"], []).append((name, rows, axis))
        for key, entries in plans.items():
            lo = min(min(r) for _, r, _ in entries)
            hi = max(max(r) for _, r, _ in entries) + 1
            block = arrays[key][lo:hi] if hi - lo > 1 else arrays[key][lo : lo + 1]
            for name, rows, axis in entries:
                out[name] = _finish(block[[r - lo for r in rows]], axis)
        return out


def _finish(data: Any, axis: bool) -> Any:
    if data.dtype == object:
        items = [bytes(b) for b in data]
        return items if axis else items[0]
    arr = np.asarray(data, dtype=np.float32)
    return arr if axis else arr[0]


def read_all(reader: PerEntryReader | PerKeyReader,
             samples: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
    return [reader.sample(e, i) for e, i in samples]
