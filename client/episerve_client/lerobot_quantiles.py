"""Per-feature statistics by LeRobot's own rule, so they agree with a dataset's
``meta/stats.json``.

LeRobot's writer computes statistics per episode when it saves one, then folds them into the
dataset's running total, one episode after another:

- per episode (at least 2 rows): min, max, mean and population std (``E[x^2] - E[x]^2``,
  clipped at 0) of each feature column, in the column's own precision (float32 stays
  float32, integers widen to float64), and each quantile read off a 5000-bin histogram
  spanning [min - 1e-10, max + 1e-10], interpolated linearly inside the bin where the
  cumulative count reaches ``q * rows``. An episode of one row has its quantiles set to its
  mean.
- folded: min of mins, max of maxes, row-weighted means and quantiles, and the parallel
  variance rule for std.

Quantiles so made are approximations of the true ones (a weighted mean of each episode's
histogram quantile); they are given here because a LeRobot policy was normalized with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

#: The quantiles LeRobot writes, under the names it writes them.
QUANTILES = (("q01", 0.01), ("q10", 0.10), ("q50", 0.50), ("q90", 0.90), ("q99", 0.99))
BINS = 5000
Stats = dict[str, np.ndarray]


def episode_stats(values: np.ndarray) -> Stats:
    """One episode's statistics of a feature: ``values`` is (rows, *shape) or (rows,)."""
    rows = values.reshape(len(values), -1)
    if len(rows) < 2:
        mean = np.mean(rows, axis=0)
        out = {"min": np.min(rows, axis=0), "max": np.max(rows, axis=0), "mean": mean,
               "std": np.std(rows, axis=0)}
        out |= {name: mean.copy() for name, _ in QUANTILES}
    else:
        rows = rows.astype(np.result_type(rows.dtype, np.float32), copy=False)
        lo, hi = np.min(rows, axis=0), np.max(rows, axis=0)
        mean = np.mean(rows, axis=0)
        spread = np.mean(rows**2, axis=0) - mean**2
        out = {"min": lo, "max": hi, "mean": mean, "std": np.sqrt(np.maximum(0, spread))}
        columns = [_histogram(rows[:, i], lo[i], hi[i]) for i in range(rows.shape[1])]
        for name, q in QUANTILES:
            out[name] = np.array([_quantile(counts, edges, q * len(rows))
                                  for counts, edges in columns])
    shape = (1,) if values.ndim == 1 else values.shape[1:]
    stats = {k: v.reshape(shape) for k, v in out.items()}
    stats["count"] = np.array([len(values)])
    return stats


def _histogram(column: np.ndarray, lo: Any, hi: Any) -> tuple[np.ndarray, np.ndarray]:
    edges = np.linspace(lo - 1e-10, hi + 1e-10, BINS + 1)
    counts = np.zeros(BINS) + np.histogram(column, bins=edges)[0]
    return counts, edges


def _quantile(counts: np.ndarray, edges: np.ndarray, target: float) -> Any:
    running = np.cumsum(counts)
    k = int(np.searchsorted(running, target))
    if k == 0:
        return edges[0]
    if k >= len(running):
        return edges[-1]
    below = running[k - 1]
    inside = running[k] - below
    if inside == 0:
        return edges[k]
    return edges[k] + (target - below) / inside * (edges[k + 1] - edges[k])


def fold(total: Stats | None, part: Stats) -> Stats:
    """``total`` with one more episode's ``part`` folded in, as LeRobot's writer folds them."""
    if total is None:
        return part
    parts = (total, part)
    counts = np.stack([p["count"] for p in parts])
    n = counts.sum(axis=0)
    means = np.stack([p["mean"] for p in parts])
    weights = counts
    while weights.ndim < means.ndim:
        weights = np.expand_dims(weights, axis=-1)
    mean = (means * weights).sum(axis=0) / n
    var = ((np.stack([p["std"] ** 2 for p in parts]) + (means - mean) ** 2)
           * weights).sum(axis=0) / n
    out = {"min": np.min(np.stack([p["min"] for p in parts]), axis=0),
           "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
           "mean": mean, "std": np.sqrt(var), "count": n}
    for name, _ in QUANTILES:
        out[name] = (np.stack([p[name] for p in parts]) * weights).sum(axis=0) / n
    return out


def dataset_stats(episodes: Iterable[np.ndarray]) -> Stats:
    """A feature's statistics over episodes (in the order LeRobot saved them)."""
    total: Stats | None = None
    for values in episodes:
        total = fold(total, episode_stats(values))
    if total is None:
        raise ValueError("no episodes to compute statistics over")
    return total


def as_json(stats: Mapping[str, Stats]) -> dict[str, dict[str, list[Any]]]:
    """``stats`` as nested lists, the way ``meta/stats.json`` holds them."""
    return {key: {name: np.asarray(v).tolist() for name, v in s.items()}
            for key, s in stats.items()}
