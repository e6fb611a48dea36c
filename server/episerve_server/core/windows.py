"""Window rules (docs/KEYMAP.md), vectorized.

A window is a (B, W) array of row indices, already clamped: padding is clamping, so a
padded row is just a real row read again, and ``mask`` says which rows are real.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from episerve_server.core.kernel import CORE, CoreLoops
from episerve_server.core.keymap import KeySpec, Rule

IntArray = np.ndarray


@dataclass(slots=True)
class Window:
    rows: IntArray  # (B, W) int64 row indices into the episode
    mask: IntArray | None  # (B, W) bool, True for a real row; None without a time axis


def frames(seconds: float, fps: IntArray) -> IntArray:
    """``max(1, round(seconds * fps))`` per sample (round half to even, as Python's)."""
    return np.maximum(1, np.round(seconds * fps)).astype(np.int64)


def window(spec: KeySpec, frame: IntArray, total: IntArray, fps: IntArray,
           cutoff_end: IntArray | None = None, loops: CoreLoops = CORE) -> Window:
    """Rows of ``spec`` for samples at ``frame`` in episodes of ``total`` frames (the
    horizon and history rules by ``loops``)."""
    rule = spec.rule
    if rule is Rule.OFFSETS:
        return _offsets(spec.offsets_s or (), frame, total, fps)
    if rule is Rule.HORIZON:
        return _horizon(spec.horizon or 1, frame, total, cutoff_end, loops)
    if rule is Rule.HISTORY:
        return _history(spec, frame, fps, loops)
    if rule is Rule.LAG:
        lag = frames(spec.lag_s or 0.0, fps)
        return Window(np.maximum(0, frame - lag)[:, None], None)
    return Window(frame[:, None].astype(np.int64), None)


def _offsets(offsets: tuple[float, ...], frame: IntArray, total: IntArray,
             fps: IntArray) -> Window:
    """Rule 6: frames ``i + round(o * fps)`` (half to even, as Python's ``round``), clamped
    into [0, T-1]; a row is real where the unclamped frame lies in [0, T)."""
    steps = np.round(np.asarray(offsets, np.float64)[None, :] * fps[:, None]).astype(np.int64)
    idx = frame[:, None] + steps
    mask = (idx >= 0) & (idx < total[:, None])
    return Window(np.clip(idx, 0, (total - 1)[:, None]), mask)


def _horizon(h: int, frame: IntArray, total: IntArray, cutoff_end: IntArray | None,
             loops: CoreLoops) -> Window:
    if cutoff_end is not None:
        total = np.minimum(total, cutoff_end)
    return Window(*loops.horizon(h, frame, total))


def _history(spec: KeySpec, frame: IntArray, fps: IntArray, loops: CoreLoops) -> Window:
    k = spec.history or 1
    newest = frame - frames(spec.lag_s, fps) if spec.lag_s is not None else frame
    stride = frames(spec.history_stride_s, fps) if spec.history_stride_s is not None \
        else spec.history_stride or 1
    return Window(*loops.history(k, newest, stride))
