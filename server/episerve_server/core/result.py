"""The planner's output: one columnar batch, plus a per-sample view for tests and tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def utf8_len(text: str) -> int:
    """A string's UTF-8 bytes; an ASCII one (the flag CPython keeps) without encoding it."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class ImageColumn:
    """Frames of one camera output: ``index`` points into ``BatchResult.frames[source]``.

    ``index`` is (B, W) for a window, (B,) without a time axis.
    """

    source: str
    index: np.ndarray


@dataclass(slots=True)
class BatchResult:
    episodes: list[str]
    frame_index: np.ndarray  # (B,) int64
    fps: np.ndarray  # (B,) float32
    embodiments: list[str]
    arrays: dict[str, np.ndarray]  # numeric outputs and masks, float32 (``_is_pad``: bool)
    images: dict[str, ImageColumn]
    frames: dict[str, list[bytes]]  # zarr key -> the distinct JPEG frames of the batch
    texts: dict[str, list[list[str]]]
    # With all_masks: each sample's episode length T (the ``_is_pad`` masks are in ``arrays``)
    total_frames: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def nbytes(self) -> int:
        """Every byte the answer carries: arrays, frames, and each sample's texts and strings
        (its annotation texts, embodiment and episode hash) as UTF-8, so a batch whose size
        is in its strings (a long text on every sample) meets the response limit too."""
        # (comprehensions and ``map``: this is asked of every batch, and a batch of
        # frames and texts has a few hundred of them)
        n = sum([a.nbytes for a in self.arrays.values()])
        n += sum([c.index.nbytes for c in self.images.values()])
        n += sum([sum(map(len, fs)) for fs in self.frames.values()])
        n += 0 if self.total_frames is None else self.total_frames.nbytes
        n += sum(map(utf8_len, self.embodiments)) + sum(map(utf8_len, self.episodes))
        return n + sum([sum(map(utf8_len, s)) for ts in self.texts.values() for s in ts])

    def sample(self, b: int) -> dict[str, Any]:
        """Sample ``b`` as plain values: arrays (copies), raw JPEG bytes, lists of texts."""
        out: dict[str, Any] = {name: arr[b, ...].copy() for name, arr in self.arrays.items()}
        for name, col in self.images.items():
            frames = self.frames[col.source]
            idx = col.index[b]
            out[name] = frames[int(idx)] if idx.ndim == 0 else [frames[int(k)] for k in idx]
        for name, texts in self.texts.items():
            out[name] = list(texts[b])
        out["episode_hash"] = self.episodes[b]
        out["embodiment"] = self.embodiments[b]
        out["fps"] = float(self.fps[b])
        out["frame_index"] = int(self.frame_index[b])
        if self.total_frames is not None:
            out["total_frames"] = int(self.total_frames[b])
        return out
