"""Per-feature statistics of one key, merged exactly from per-episode parts.

The moments of an episode (count, mean, sum of squared deviations, min, max) merge by the
parallel formula of Chan et al., vectorized over episodes. The percentiles need values: the
1st (99th) percentile of N rows is an interpolation between two order statistics near the
bottom (top) 1%, so :class:`Tails` keeps, per feature, the lowest and the highest values of
a set of episodes, a little more than the percentiles need. The lowest ``m`` values of
``S | A`` lie among the lowest ``m`` of ``S`` and the values of ``A``, so adding episodes to
a set only merges their values into its tails; a set that grew past its tails' slack is
rebuilt. Percentiles are interpolated exactly as numpy's default (``method="linear"``).

Every value is a float32 as the daemon serves it; the statistics are computed in float64.
No zarr, grpc or protobuf here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: The percentiles reported, as numpy quantiles (``np.percentile(x, 1)`` is 1 / 100).
Q_LOW, Q_HIGH = 1 / 100, 99 / 100
#: Values buffered by a :class:`TailBuilder` before they are folded into its tails.
FOLD_VALUES = 1 << 22


@dataclass(frozen=True, slots=True)
class Moments:
    """One episode's (or one set's) moments, per feature: float64 arrays of shape (F,)."""

    count: int
    mean: np.ndarray
    m2: np.ndarray  # sum of squared deviations from the mean
    min: np.ndarray
    max: np.ndarray
    nan: np.ndarray  # bool: the feature holds a NaN

    @property
    def nbytes(self) -> int:
        return 5 * self.mean.nbytes + self.nan.nbytes

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        """Moments of (F, T) float32 values."""
        x = values.astype(np.float64)
        mean = x.mean(axis=1)
        dev = x - mean[:, None]
        m2 = np.einsum("ft,ft->f", dev, dev)
        return cls(values.shape[1], mean, m2, x.min(axis=1), x.max(axis=1),
                   np.asarray(np.isnan(values).any(axis=1)))


def combine(parts: Sequence[Moments]) -> Moments:
    """The moments of the union of ``parts`` (Chan et al.'s pairwise formula, all at once)."""
    counts = np.array([p.count for p in parts], np.float64)
    means = np.stack([p.mean for p in parts])
    n = counts.sum()
    mean = (counts[:, None] * means).sum(axis=0) / n
    dev = means - mean
    m2 = np.stack([p.m2 for p in parts]).sum(axis=0) + (counts[:, None] * dev * dev).sum(axis=0)
    return Moments(int(n), mean, m2, np.stack([p.min for p in parts]).min(axis=0),
                   np.stack([p.max for p in parts]).max(axis=0),
                   np.asarray(np.stack([p.nan for p in parts]).any(axis=0)))


def _lower_index(n: int, q: float) -> int:
    return math.floor((n - 1) * q)


def tail_need(n: int) -> tuple[int, int]:
    """Values needed at the bottom and at the top of ``n`` rows for both percentiles."""
    low = min(n, _lower_index(n, Q_LOW) + 2)
    high = min(n, n - _lower_index(n, Q_HIGH))
    return low, high


def tail_room(n: int) -> tuple[int, int]:
    """The tails kept for ``n`` rows: what they need, plus a quarter for episodes added."""
    low, high = tail_need(n)
    return min(n, low + low // 4 + 16), min(n, high + high // 4 + 16)


@dataclass(frozen=True, slots=True)
class Tails:
    """Per feature, the lowest and the highest of ``count`` values, sorted ascending
    (float32): ``min(count, room[0])`` and ``min(count, room[1])`` of them."""

    count: int
    low: np.ndarray  # (F, min(count, room[0]))
    high: np.ndarray  # (F, min(count, room[1]))
    room: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.low.nbytes + self.high.nbytes)

    def covers(self, n: int) -> bool:
        """Whether these tails, grown to ``n`` values, still hold what the percentiles need."""
        low, high = tail_need(n)
        return low <= self.room[0] and high <= self.room[1]

    def percentiles(self) -> tuple[np.ndarray, np.ndarray]:
        """The 1st and 99th percentiles per feature, as ``np.percentile`` gives them."""
        n = self.count
        q01 = _interpolate(self.low.astype(np.float64), n, Q_LOW, 0)
        q99 = _interpolate(self.high.astype(np.float64), n, Q_HIGH,
                           n - self.high.shape[1])
        return q01, q99


def _interpolate(sorted_part: np.ndarray, n: int, q: float, offset: int) -> np.ndarray:
    """numpy's ``linear`` quantile of ``n`` values, ``sorted_part`` holding the sorted values
    from rank ``offset`` on (per feature, on axis 1)."""
    virtual = (n - 1) * np.float64(q)
    lo = math.floor(virtual)
    hi = lo + 1
    if virtual >= n - 1:
        lo = hi = n - 1
    gamma = np.float64(virtual - lo)
    a, b = sorted_part[:, lo - offset], sorted_part[:, hi - offset]
    diff = b - a
    out = a + diff * gamma
    if gamma >= 0.5:
        out = b - diff * (1 - gamma)
    return np.asarray(out, np.float64)


class TailBuilder:
    """Folds values (F, t) into the lowest ``m_low`` and highest ``m_high`` per feature.

    Thread-safe: episodes computed in worker threads add their values as they finish.
    Values are buffered up to :data:`FOLD_VALUES` and folded with one partition, so memory
    stays at the tails plus the buffer, whatever the number of rows.
    """

    def __init__(self, features: int, room: tuple[int, int],
                 start: Tails | None = None) -> None:
        self.features, (self.m_low, self.m_high) = features, room
        self.count = 0
        self._low = np.empty((features, 0), np.float32)
        self._high = np.empty((features, 0), np.float32)
        if start is not None:
            self.count, self._low, self._high = start.count, start.low, start.high
        self._pending: list[np.ndarray] = []
        self._buffered = 0
        self._lock = threading.Lock()

    def add(self, values: np.ndarray) -> None:
        with self._lock:
            self._pending.append(values)
            self.count += values.shape[1]
            self._buffered += values.size
            if self._buffered >= FOLD_VALUES:
                self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        low = np.concatenate([self._low, *self._pending], axis=1)
        high = np.concatenate([self._high, *self._pending], axis=1)
        self._pending, self._buffered = [], 0
        width = low.shape[1]
        if width > self.m_low:
            low = np.partition(low, self.m_low - 1, axis=1)[:, : self.m_low]
        if width > self.m_high:
            high = np.partition(high, width - self.m_high, axis=1)[:, width - self.m_high:]
        self._low, self._high = low, high

    def finish(self) -> Tails:
        with self._lock:
            self._fold()
            return Tails(self.count, np.sort(self._low, axis=1), np.sort(self._high, axis=1),
                         (self.m_low, self.m_high))


@dataclass(frozen=True, slots=True)
class KeyStats:
    """Statistics of one key over the real rows of a set of episodes (float64, feature shape)."""

    key: str
    count: int
    episodes: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    q01: np.ndarray
    q99: np.ndarray


def key_stats(key: str, feature: tuple[int, ...], episodes: int, moments: Moments,
              tails: Tails) -> KeyStats:
    """The reported statistics; a feature holding a NaN is NaN throughout, as in numpy."""
    q01, q99 = tails.percentiles()
    std = np.sqrt(np.maximum(moments.m2, 0.0) / moments.count)
    values = [moments.mean, std, moments.min, moments.max, q01, q99]
    out = []
    for v in values:
        v = np.where(moments.nan, np.nan, v)
        out.append(np.asarray(v, np.float64).reshape(feature))
    return KeyStats(key, moments.count, episodes, *out)
