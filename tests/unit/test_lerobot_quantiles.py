"""LeRobot's statistics rule (``episerve_client.lerobot_quantiles``) against plain oracles:
the histogram quantile is within one bin of the exact quantile, the fold of episodes is the
row-weighted mean, and the tolerance check refuses what LeRobot refuses."""

from __future__ import annotations

import numpy as np
import pytest

from episerve_client.errors import InvalidArgument, KeymapError
from episerve_client.lerobot import (
    check_tolerance,
    keymap_from_delta_timestamps,
    keymap_from_lerobot,
)
from episerve_client.lerobot_quantiles import BINS, QUANTILES, dataset_stats, episode_stats


def test_one_episode_quantiles_are_within_a_bin_of_the_exact_ones() -> None:
    rng = np.random.default_rng(3)
    values = (rng.normal(size=(4000, 3)) * [1, 10, 100]).astype(np.float32)
    stats = episode_stats(values)
    width = (values.max(axis=0) - values.min(axis=0)) / BINS
    ordered = np.sort(values.astype(np.float64), axis=0)
    for name, q in QUANTILES:
        k = q * len(values)  # the rows at or below the quantile
        lo, hi = ordered[int(np.floor(k)) - 1], ordered[int(np.ceil(k))]
        assert np.all(stats[name] >= lo - width) and np.all(stats[name] <= hi + width), name
    assert np.array_equal(stats["min"], values.min(axis=0))
    assert np.array_equal(stats["max"], values.max(axis=0))
    np.testing.assert_allclose(stats["mean"], values.astype(np.float64).mean(axis=0),
                               rtol=1e-5)
    np.testing.assert_allclose(stats["std"], values.astype(np.float64).std(axis=0), rtol=1e-4)
    assert stats["count"].tolist() == [4000]
    assert stats["q50"].shape == (3,)


def test_episodes_fold_with_row_weights() -> None:
    rng = np.random.default_rng(4)
    episodes = [rng.uniform(size=(n, 2)) for n in (50, 7, 300)]
    parts = [episode_stats(e) for e in episodes]
    total = dataset_stats(episodes)
    n = np.array([len(e) for e in episodes], np.float64)[:, None]
    for name, _ in QUANTILES:
        want = (np.stack([p[name] for p in parts]) * n).sum(axis=0) / n.sum()
        np.testing.assert_allclose(total[name], want, rtol=1e-12)
    everything = np.concatenate(episodes)
    np.testing.assert_allclose(total["mean"], everything.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(total["std"], everything.std(axis=0), rtol=1e-10)
    assert total["count"].tolist() == [357]
    assert np.array_equal(total["min"], everything.min(axis=0))


def test_a_one_row_episode_has_its_mean_as_every_quantile() -> None:
    stats = episode_stats(np.array([[2.0, -1.0]], np.float32))
    for name, _ in QUANTILES:
        assert stats[name].tolist() == [2.0, -1.0]
    scalar = episode_stats(np.arange(5, dtype=np.int64))  # a shape [1] column
    assert scalar["q50"].shape == (1,) and scalar["count"].tolist() == [5]


def test_offsets_off_the_frame_grid_are_refused_naming_key_and_offset() -> None:
    check_tolerance({"action": [0.0, 0.1, -0.2], "s": [1 / 30]}, 30.0, 1e-4)
    check_tolerance({"action": [0.1 + 5e-5]}, 10.0, 1e-4)
    with pytest.raises(InvalidArgument, match=r"delta_timestamps\['action'\]: offsets \[0\.01\]"):
        check_tolerance({"action": [0.0, 0.01]}, 30.0, 1e-4)
    with pytest.raises(InvalidArgument, match="nan"):
        check_tolerance({"s": [float("nan")]}, 30.0, 1e-4)


def test_every_helper_that_takes_delta_timestamps_refuses_the_same_off_grid_offset() -> None:
    """One rule wherever a ``delta_timestamps`` is taken: ``keymap_from_lerobot`` (the fps of
    the root's info.json) and ``keymap_from_delta_timestamps`` given the fps refuse what
    ``LeRobotWindowDataset`` refuses, instead of rounding it to the nearest frame."""
    info = {"fps": 30, "features": {"action": {"dtype": "float32", "shape": [2]}}}
    off_grid = {"action": [0.0, 0.01]}
    for build in (lambda: keymap_from_lerobot(info, off_grid),
                  lambda: keymap_from_delta_timestamps(
                      off_grid, {"action": ("action", "action_keys")}, fps=30)):
        with pytest.raises(KeymapError, match=r"offsets \[0\.01\] are more than tolerance_s"):
            build()
    on_grid = keymap_from_lerobot(info, {"action": [0.0, 1 / 30]})
    assert on_grid["action"]["offsets_s"] == [0.0, 1 / 30]
    loose = keymap_from_lerobot(info, off_grid, tolerance_s=0.02)  # as LeRobot's option
    assert loose["action"]["offsets_s"] == [0.0, 0.01]
    with pytest.raises(KeymapError, match="no positive 'fps'"):
        keymap_from_lerobot({"features": info["features"]}, {"action": [0.0]})
