"""``--workers 2`` against one process, side by side: loadtest throughput and the DataLoader.

    python benchmarks/bench_workers.py [--root data/bench] [--episodes 200]

1. ``episerve loadtest``, numeric mecka keymap, 16 clients x batch 64 over the first 24
   episodes, warm cache (a warm-up pass first), against ``--workers 1`` and ``--workers 2``,
   alternating (1, 2, 1, 2) so drift on the shared machine hits both. The load runs as one
   loadtest process (16 clients) and as two processes of 8 clients each (their samples/s
   summed): a single Python client process can itself be the bound on two cores.
   The daemon's CPU (front and workers, every thread, from /proc) is reported per 1k samples.
2. The DataLoader benchmark of ``bench_client.py`` (numeric keymap, 2 DataLoader workers,
   batch 64, the same indices twice): in-process TensorStore with its cache pool against
   ``WindowDataset`` through ``--workers 1`` and ``--workers 2`` daemons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from common import BATCH, NUMERIC_MECKA, ensure_dataset, table
from loaders import Index, TensorStoreDataset, run
from torch.utils.data import default_collate

from episerve_client import WindowDataset, collate
from episerve_tools.launch import DaemonProcess

CLIENTS = 16
EPISODES = 24


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def loadtests(target: str, keymap: Path, seconds: float, processes: int) -> float:
    """Aggregate samples/s of ``processes`` loadtest processes sharing CLIENTS clients."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "episerve_tools.cli", "loadtest", target, "--episodes",
             str(EPISODES), "-c", str(CLIENTS // processes), "--batch", str(BATCH),
             "--duration", str(seconds), "--warmup", "0", "--keymap", str(keymap),
             "--json", f"{tmp}/{k}.json", "--timeout-s", "120", "--quiet"],
            stdout=subprocess.DEVNULL) for k in range(processes)]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"loadtest exited with {p.returncode}")
        reports = [json.loads(Path(f"{tmp}/{k}.json").read_text()) for k in range(processes)]
    return float(sum(r["samples_per_s"] for r in reports))


def measure_loadtest(root: str, keymap: Path, workers: int, seconds: float,
                     sock: str) -> dict[str, float]:
    with DaemonProcess(root, "--cache-bytes", "8GiB", "--log-level", "WARNING",
                       "--rescan-s", "0", unix=sock, workers=workers) as d:
        pids = [d.pid, *children(d.pid)]
        loadtests(d.target, keymap, 15.0, 1)  # fill the cache
        out = {}
        for processes in (1, 2):
            before = cpu_s(pids)
            rate = loadtests(d.target, keymap, seconds, processes)
            used = cpu_s(pids) - before
            out[f"{processes}p"] = rate
            out[f"{processes}p_cpu"] = used / (rate * seconds) * 1e6
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=("loadtest", "dataloader"), default=None)
    opts = p.parse_args()
    episodes = ensure_dataset(opts.root, opts.episodes)
    root = str(Path(opts.root).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        keymap = Path(tmp) / "numeric.yaml"
        keymap.write_text(yaml.safe_dump(NUMERIC_MECKA))
        if opts.only != "dataloader":
            bench_loadtest(root, keymap, opts.rounds, opts.seconds, tmp)
        if opts.only != "loadtest":
            bench_dataloader(root, episodes, opts.rounds, opts.batches, tmp)


def bench_loadtest(root: str, keymap: Path, rounds: int, seconds: float, tmp: str) -> None:
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for r in range(rounds):
        for workers in (1, 2):
            runs[workers].append(measure_loadtest(root, keymap, workers, seconds,
                                                  f"{tmp}/lt{r}{workers}.sock"))
            print(workers, runs[workers][-1], flush=True)
    rows = []
    for procs in ("1p", "2p"):
        one = float(np.median([m[procs] for m in runs[1]]))
        two = float(np.median([m[procs] for m in runs[2]]))
        cpu1 = float(np.median([m[procs + "_cpu"] for m in runs[1]]))
        cpu2 = float(np.median([m[procs + "_cpu"] for m in runs[2]]))
        rows.append((f"{procs[0]} loadtest process(es), {CLIENTS} clients",
                     f"{one:,.0f}", f"{two:,.0f}", f"{two / one:.2f}x",
                     f"{cpu1:.1f}", f"{cpu2:.1f}"))
    print(f"loadtest: numeric mecka, batch {BATCH}, first {EPISODES} episodes, warm, "
          f"{seconds:g} s per run, median of {rounds} alternating runs")
    print(table(rows, ("load", "--workers 1 samples/s", "--workers 2 samples/s",
                       "ratio", "CPU ms/1k (1)", "CPU ms/1k (2)")))


def bench_dataloader(root: str, episodes: list[tuple[str, int]], rounds: int, batches: int,
                     tmp: str) -> None:
    index = Index(episodes)
    rng = np.random.default_rng(0)
    indices = rng.permutation(len(index))[: (batches + 1) * BATCH].tolist()
    names = ["(c) TensorStore + cache pool", "(d) WindowDataset, --workers 1",
             "(d) WindowDataset, --workers 2"]
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):  # alternating, so drift on the shared machine hits all three
        cold, warm, _ = run(TensorStoreDataset(root, NUMERIC_MECKA, episodes), indices,
                            default_collate)
        got[names[0]].append((cold, warm))
        for workers in (1, 2):
            with DaemonProcess(root, "--log-level", "WARNING", "--cache-bytes", "8GiB",
                               "--rescan-s", "0", unix=f"{tmp}/dl{r}{workers}.sock",
                               workers=workers) as d:
                cold, warm, _ = run(WindowDataset(d.target, NUMERIC_MECKA), indices, collate)
            got[names[workers]].append((cold, warm))
        print({n: [f"{c:.0f}/{w:.0f}" for c, w in v] for n, v in got.items()}, flush=True)
    base = float(np.median([w for _, w in got[names[0]]]))
    rows = []
    for n in names:
        cold = float(np.median([c for c, _ in got[n]]))
        warm = float(np.median([w for _, w in got[n]]))
        rows.append((n, f"{cold:.0f}", f"{warm:.0f}", f"{warm / base:.2f}x"))
    print(f"DataLoader: numeric mecka, 2 workers, batch {BATCH}, {batches} batches, median "
          f"of {rounds} alternating rounds")
    print(table(rows, ("loader", "samples/s first pass", "samples/s second pass",
                       "second pass vs TensorStore")))


if __name__ == "__main__":
    main()
