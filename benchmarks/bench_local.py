"""The local shared-memory plane against gRPC, side by side in one run, on one daemon.

    python benchmarks/bench_local.py [--root data/bench] [--episodes 24] [--seconds 10]

1. ``episerve loadtest --transport grpc|local``, 16 clients x batch 64 over the first 24
   episodes, warm cache (one warm-up pass first), numeric mecka keymap and the full one
   (camera bytes, not decoded), alternating transports round by round. Reported per 1,000
   samples: the daemon's CPU (every thread, from /proc) and the loadtest process's own CPU
   (its rusage at exit, less that of a run of a few reads: start-up and listing).
2. The DataLoader benchmark of ``bench_client.py`` (2 workers, batch 64, the same indices
   twice, the second pass warm): ``WindowDataset(transport="grpc")`` against
   ``transport="local"``, numeric keymap and with the camera decoded.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import yaml
from common import BATCH, MECKA, NUMERIC_MECKA, cpu_s, ensure_dataset, table
from daemons import CLIENTS, EPISODES, loadtest
from loaders import Index, run

from episerve_client import WindowDataset, collate
from episerve_tools.launch import DaemonProcess

TRANSPORTS = ("grpc", "local")


def bench_loadtest(root: str, rounds: int, seconds: float, tmp: str) -> None:
    rows = []
    for label, km in (("numeric", NUMERIC_MECKA), ("with camera bytes", MECKA)):
        keymap = Path(tmp) / "keymap.yaml"
        keymap.write_text(yaml.safe_dump(km))
        got: dict[str, list[tuple[float, float, float]]] = {t: [] for t in TRANSPORTS}
        with DaemonProcess(root, "--cache-bytes", "8GiB", "--log-level", "WARNING",
                           "--rescan-s", "0", unix=f"{tmp}/lt.sock") as d:
            loadtest(d.target, keymap, seconds, "grpc", tmp)  # fill the cache
            # A loadtest's start-up (imports, listing) costs CPU whatever it then reads:
            # measured once per transport on a run of a few reads, and taken off.
            start = {t: loadtest(d.target, keymap, 0.05, t, tmp) for t in TRANSPORTS}
            for _ in range(rounds):
                for transport in TRANSPORTS:
                    before = cpu_s(d.pid)
                    samples, client_cpu = loadtest(d.target, keymap, seconds, transport, tmp)
                    daemon_cpu = cpu_s(d.pid) - before
                    extra = samples - start[transport][0]
                    got[transport].append((samples / seconds, daemon_cpu / samples * 1e6,
                                           (client_cpu - start[transport][1]) / extra * 1e6))
                    print(label, transport, got[transport][-1], flush=True)
        med = {t: [float(np.median([m[k] for m in got[t]])) for k in range(3)]
               for t in TRANSPORTS}
        g, loc = med["grpc"], med["local"]
        rows.append((label, f"{g[0]:,.0f}", f"{loc[0]:,.0f}", f"{g[1]:.1f}", f"{loc[1]:.1f}",
                     f"{loc[1] / g[1]:.2f}x", f"{g[2]:.1f}", f"{loc[2]:.1f}",
                     f"{loc[2] / g[2]:.2f}x"))
    print(f"loadtest: {CLIENTS} clients x batch {BATCH}, first {EPISODES} episodes, warm, "
          f"{seconds:g} s per run, median of {rounds} alternating runs; CPU in ms per 1,000 "
          "samples")
    print(table(rows, ("keymap", "gRPC samples/s", "local samples/s", "daemon CPU gRPC",
                       "daemon CPU local", "ratio", "loadtest CPU gRPC",
                       "loadtest CPU local", "ratio")))


def bench_dataloader(root: str, episodes: list[tuple[str, int]], rounds: int, batches: int,
                     tmp: str) -> None:
    index = Index(episodes)
    rng = np.random.default_rng(0)
    indices = rng.permutation(len(index))[: (batches + 1) * BATCH].tolist()
    rows = []
    with DaemonProcess(root, "--log-level", "WARNING", "--cache-bytes", "8GiB",
                       "--rescan-s", "0", unix=f"{tmp}/dl.sock") as d:
        for label, km in (("numeric", NUMERIC_MECKA), ("camera decoded", MECKA)):
            got: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            for _ in range(rounds):
                for transport in TRANSPORTS:
                    _, warm, _ = run(WindowDataset(d.target, km, transport=transport),
                                     indices, collate)
                    got[transport].append(warm)
                    print(label, transport, f"{warm:.0f}", flush=True)
            g = float(np.median(got["grpc"]))
            loc = float(np.median(got["local"]))
            rows.append((label, f"{g:,.0f}", f"{loc:,.0f}", f"{loc / g:.2f}x"))
    print(f"DataLoader: 2 workers, batch {BATCH}, {batches} batches, warm (second pass), "
          f"median of {rounds} alternating rounds")
    print(table(rows, ("keymap", "gRPC samples/s", "local samples/s", "ratio")))


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--episodes", type=int, default=EPISODES)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=("loadtest", "dataloader"), default=None)
    opts = p.parse_args()
    episodes = ensure_dataset(opts.root, opts.episodes)
    root = str(Path(opts.root).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        if opts.only != "dataloader":
            bench_loadtest(root, opts.rounds, opts.seconds, tmp)
        if opts.only != "loadtest":
            bench_dataloader(root, episodes, opts.rounds, opts.batches, tmp)


if __name__ == "__main__":
    main()
