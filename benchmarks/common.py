"""Shared benchmark setup: the dataset (and copies of it), the keymap, random batches, timing,
tables. Each benchmark runs as ``python benchmarks/bench_NAME.py``, so this folder is on the
path and these modules import by name; none imports another benchmark."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
MECKA = yaml.safe_load((REPO / "client/episerve_client/keymaps/mecka_keypoints_k4.yaml")
                       .read_text())
NUMERIC_MECKA = {k: v for k, v in MECKA.items()
                 if v["key_type"] not in ("camera_keys", "annotation_keys")}
#: Samples per batch unless a benchmark says otherwise.
BATCH = 64


def args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--root", default="data/bench", help="dataset (written if missing)")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def ensure_dataset(root: str, episodes: int) -> list[tuple[str, int]]:
    """(hash, total_frames) of every episode, writing the dataset first if needed."""
    import json

    path = Path(root)
    if len(list(path.glob("*.zarr"))) < episodes:
        from episerve_tools.synth.writer import make_dataset

        make_dataset(path, episodes=episodes, seed=1)
    out = []
    for ep in sorted(path.glob("*.zarr"))[:episodes]:
        attrs = json.loads((ep / "zarr.json").read_text())["attributes"]
        out.append((ep.name[: -len(".zarr")], int(attrs["total_frames"])))
    return out


def random_batches(episodes: list[tuple[str, int]], n: int, batch: int,
                   seed: int) -> list[list[tuple[str, int]]]:
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum([t for _, t in episodes])])
    out = []
    for _ in range(n):
        gs = rng.integers(0, starts[-1], size=batch)
        e = np.searchsorted(starts, gs, side="right") - 1
        out.append([(episodes[k][0], int(g - starts[k])) for k, g in zip(e, gs)])
    return out


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far (``/proc``, user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def replicate(base: Path, root: Path, n: int) -> None:
    """``n`` episodes under ``root``, hard-linked from the episodes of ``base``."""
    sources = sorted(base.glob("*.zarr"))
    if not sources:  # the base of the docstring, written once
        from episerve_tools.synth.writer import make_dataset

        print(f"writing the base episodes under {base}", flush=True)
        make_dataset(base, episodes=100, min_frames=30, max_frames=60, seed=1)
        sources = sorted(base.glob("*.zarr"))
    root.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        src = sources[k % len(sources)]
        dst = root / f"{src.name[:-5]}x{k // len(sources):03d}.zarr"
        if dst.exists():
            continue
        for folder, _, files in os.walk(src):
            out = dst / Path(folder).relative_to(src)
            out.mkdir(parents=True, exist_ok=True)
            for f in files:
                os.link(Path(folder) / f, out / f)
