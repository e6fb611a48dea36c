"""Key statistics over flagship-size numeric data, through a real daemon.

    python benchmarks/bench_stats.py [--root /tmp/episerve-stats] [--episodes 1600]

The root holds ``--episodes`` episodes of ~200 frames (120..280, ~316k frames for 1,600)
with the five numeric keys of the human bimanual layout (63 + 63 + 7 + 7 + 7 values per
row, float32, sharded with 100-row chunks); it is written on first use and kept. One
episode is held out, then:

(a) first: ``key_stats`` of the five keys over every episode, on a fresh daemon
(b) after one new episode: the held-out episode is moved into the root, ``key_stats`` again
    (the daemon rescans, reads that episode only, merges it into the cached tails)
(c) asked again, nothing changed
(d) the pass users make today: every array read with zarr, then numpy over the rows (also
    the exactness check: min, max, q01, q99 bit for bit, mean and std to 1e-12)

The page cache is warm for every path (the root was just written or read).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from episerve_client import Client
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode

KEYS = {"left.obs_keypoints": 63, "right.obs_keypoints": 63, "left.obs_wrist_pose": 7,
        "right.obs_wrist_pose": 7, "obs_head_pose": 7}
HELD_OUT = "zz-held-out"


def write_root(root: Path, episodes: int, seed: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    have = len(list(root.glob("*.zarr"))) + (root.parent / f"{root.name}-{HELD_OUT}").exists()
    if have >= episodes:
        return
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i in range(episodes):
        total = int(rng.integers(120, 281))
        numeric = {k: np.cumsum(rng.normal(0, 0.01, (total, n)), axis=0).astype(np.float32)
                   + rng.normal(0, 1, n).astype(np.float32) for k, n in KEYS.items()}
        name = HELD_OUT if i == episodes - 1 else f"ep{i:05d}"
        write_episode(root, name, total_frames=total, fps=30, embodiment="human_bimanual",
                      numeric=numeric, jpeg={}, annotations=[])
        if i % 200 == 0:
            print(f"  writing {i}/{episodes} ({time.perf_counter() - start:.0f} s)", flush=True)
    shutil.move(root / f"{HELD_OUT}.zarr", root.parent / f"{root.name}-{HELD_OUT}")


def numpy_pass(root: Path) -> dict[str, dict[str, np.ndarray]]:
    rows: dict[str, list[np.ndarray]] = {k: [] for k in KEYS}
    for path in sorted(root.glob("*.zarr")):
        group = zarr.open_group(str(path), mode="r")
        total = group.attrs["total_frames"]
        for k in KEYS:
            rows[k].append(np.asarray(group[k][:total], np.float32))
    out = {}
    for k, parts in rows.items():
        x = np.concatenate(parts).astype(np.float64)
        out[k] = {"mean": x.mean(0), "std": x.std(0), "min": x.min(0), "max": x.max(0),
                  "q01": np.percentile(x, 1, axis=0), "q99": np.percentile(x, 99, axis=0),
                  "count": np.array(len(x))}
    return out


def check(got: dict[str, Any], want: dict[str, dict[str, np.ndarray]]) -> None:
    for k, w in want.items():
        g = got[k]
        assert g.count == int(w["count"]), (k, g.count, w["count"])
        for name in ("min", "max", "q01", "q99"):
            assert np.array_equal(getattr(g, name), w[name]), (k, name)
        for name in ("mean", "std"):
            np.testing.assert_allclose(getattr(g, name), w[name], rtol=1e-12, atol=1e-12,
                                       err_msg=f"{k} {name}")


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--root", default="/tmp/episerve-stats")
    p.add_argument("--episodes", type=int, default=1600)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    root = Path(opts.root)
    held = root.parent / f"{root.name}-{HELD_OUT}"
    if (root / f"{HELD_OUT}.zarr").exists():  # a run that stopped half way
        shutil.move(root / f"{HELD_OUT}.zarr", held)
    write_root(root, opts.episodes, opts.seed)
    keys = list(KEYS)
    firsts, afters, agains = [], [], []
    for rep in range(opts.reps):
        with DaemonProcess(root, "--rescan-s", "0") as d, Client(d.target) as c:
            t_first, first = timed(lambda: c.key_stats(keys))
            frames = first[keys[0]].count
            shutil.move(held, root / f"{HELD_OUT}.zarr")
            try:
                t_after, after = timed(lambda: c.key_stats(keys))
                t_again, _ = timed(lambda: c.key_stats(keys))
                counters = c.stats()
            finally:
                shutil.move(root / f"{HELD_OUT}.zarr", held)
        firsts.append(t_first)
        afters.append(t_after)
        agains.append(t_again)
        print(f"rep {rep}: first {t_first:.3f} s over {frames} frames, after one new "
              f"episode {t_after * 1e3:.1f} ms ({after[keys[0]].episodes} episodes), "
              f"again {t_again * 1e3:.1f} ms; parts computed "
              f"{counters['key_stats_parts_computed']}", flush=True)
    t_numpy, want = timed(lambda: numpy_pass(root))
    check(first, want)
    first_s, after_s = statistics.median(firsts), statistics.median(afters)
    print(f"\n{first[keys[0]].episodes} episodes, {frames} frames, "
          f"{sum(KEYS.values())} values per row; medians of {opts.reps}")
    print(f"(a) first computation         {first_s:8.3f} s")
    print(f"(b) after one new episode     {after_s * 1e3:8.1f} ms  = "
          f"{after_s / first_s:.1%} of (a) (target <= 5%)")
    print(f"(c) asked again, no change    {statistics.median(agains) * 1e3:8.1f} ms")
    print(f"(d) zarr + numpy, one pass    {t_numpy:8.3f} s  = {t_numpy / first_s:.1f}x (a)")
    print("exact: min, max, q01, q99 equal numpy's bit for bit; mean, std within 1e-12")


if __name__ == "__main__":
    main()
