"""The daemon's CPU per 1,000 warm samples against an earlier commit's daemon.

    python benchmarks/bench_warm_daemon.py [--root data/bench] [--seconds 5] [--rounds 5]
                                           [--before bd73ad1]

Two daemons on unix sockets at once over the same root, warm (8 GiB cache, one pass
first): this tree's and the one of commit ``--before`` (``git archive`` of it into a
temporary folder, its compiled loops built there if it has them, run with that folder
first on ``PYTHONPATH``). ``episerve loadtest``
(16 clients x batch 64, first 24 episodes) runs against each in turn, over gRPC and over
the local plane, round by round; the daemon's CPU (every thread, /proc) per 1,000
samples, counted by the loadtest (``--daemon-pid``) over its timed phase, after a 1 s
warm-up of the same clients: a run's start-up (listing the episodes rescans the root and
checks every episode's files, ~0.1 s of daemon CPU here; the clients connect and their
first segments are made) is not a per-sample cost, and in a 5 s camera run it was ~5 ms
per 1,000 samples. The whole run's figures are printed too. The numeric mecka keymap and
the full one (camera bytes, not decoded).

Then the miss path: the same two codes with the cache off (``--cache-bytes 0``: every
batch fetches and decodes its chunks), over the local plane, round by round
(``--miss-rounds``). The target, warm and missing: this tree's daemon costs at most 1.1x
the daemon CPU per 1,000 samples of the code before (``bd73ad1``, two read paths: a
compiled plan for warm batches, a general path for the rest).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import numpy as np
import yaml
from common import MECKA, NUMERIC_MECKA, cpu_s, ensure_dataset, table
from daemons import EPISODES, loadtest, warm_loadtest

from episerve_tools.launch import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
TRANSPORTS = ("grpc", "local")


def checkout(commit: str, into: Path) -> dict[str, str]:
    """The tree of ``commit`` under ``into``; the environment that runs its daemon."""
    blob = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    if (into / "setup.py").exists():  # its compiled loops, built in place as this tree's are
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into,
                       check=True, capture_output=True)
    paths = [str(into / d) for d in ("server", "protos", "client", "tools")]
    return {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=5)  # five: a run-to-run spread of ~20% here
    p.add_argument("--miss-rounds", type=int, default=3)
    p.add_argument("--before", default="bd73ad1")
    opts = p.parse_args()
    ensure_dataset(opts.root, EPISODES)
    root = str(Path(opts.root).resolve())
    rows = []
    miss_rows = []
    loads: list[float] = []
    runs: dict[tuple[str, str, str], list[float]] = {}  # the whole loadtest's CPU, setup too
    with tempfile.TemporaryDirectory() as tmp:
        env = {"after": {}, "before": checkout(opts.before, Path(tmp) / "before")}
        for label, km in (("numeric", NUMERIC_MECKA), ("with camera bytes", MECKA)):
            keymap = Path(tmp) / "keymap.yaml"
            keymap.write_text(yaml.safe_dump(km))
            cpu: dict[tuple[str, str], list[float]] = {}
            daemons = daemons_of(root, "8GiB", tmp, env)
            try:
                for d in daemons.values():
                    loadtest(d.target, keymap, opts.seconds, "grpc", tmp)  # fill the cache
                for _ in range(opts.rounds):
                    for transport in TRANSPORTS:
                        for code, d in daemons.items():
                            before = cpu_s(d.pid)
                            samples, ms = warm_loadtest(d.target, keymap, opts.seconds,
                                                        transport, tmp, d.pid)
                            whole = (cpu_s(d.pid) - before) / samples * 1e6
                            cpu.setdefault((code, transport), []).append(ms)
                            runs.setdefault((label, code, transport), []).append(whole)
                            loads.append(os.getloadavg()[0])
                            print(label, code, transport, f"{ms:.1f} (whole run {whole:.1f})",
                                  flush=True)
            finally:
                for d in daemons.values():
                    d.stop()
            med = {k: float(np.median(v)) for k, v in cpu.items()}
            rows.append((label, f"{med[('before', 'grpc')]:.1f}",
                         f"{med[('before', 'local')]:.1f}", f"{med[('after', 'grpc')]:.1f}",
                         f"{med[('after', 'local')]:.1f}",
                         f"{med[('after', 'local')] / med[('after', 'grpc')]:.2f}x",
                         f"{med[('after', 'local')] / med[('before', 'local')]:.2f}x"))
            miss_rows.append(miss_path(label, root, keymap, tmp, env, opts, loads))
    print(f"loadtest: 16 clients x batch 64, first {EPISODES} episodes, warm, 1 s warm-up "
          f"then {opts.seconds:g} s timed, median of {opts.rounds} rounds; daemon CPU (every "
          "thread, /proc) over the timed phase in ms per 1,000 samples; before = "
          f"{opts.before}; load average (1 min) {min(loads):.1f}-{max(loads):.1f}")
    print(table(rows, ("keymap", "before gRPC", "before local", "after gRPC", "after local",
                       "after local / after gRPC", "after local / before local")))
    print(f"\nThe miss path: cache off (--cache-bytes 0), local plane, {opts.seconds:g} s timed "
          f"after a 1 s warm-up, median of {opts.miss_rounds} rounds; daemon CPU in ms per "
          "1,000 samples; target: after / before at most 1.1x")
    print(table(miss_rows, ("keymap", "before", "after", "after / before", "rounds (after)")))
    print("Over the whole loadtest process instead (its start-up too: listing the episodes "
          "rescans the root, the clients connect), medians in the same units:")
    for (label, code, transport), v in runs.items():
        print(f"  {label}, {code}, {transport}: {float(np.median(v)):.1f}")


def daemons_of(root: str, cache: str, tmp: str,
               env: dict[str, dict[str, str]]) -> dict[str, DaemonProcess]:
    return {code: DaemonProcess(root, "--cache-bytes", cache, "--log-level", "WARNING",
                                "--rescan-s", "0", unix=f"{tmp}/{code}.sock", env=env[code])
            for code in env}


def miss_path(label: str, root: str, keymap: Path, tmp: str, env: dict[str, dict[str, str]],
              opts: argparse.Namespace, loads: list[float]) -> tuple[str, ...]:
    """One row of the miss-path table: both codes with the cache off, rounds alternating
    which goes first."""
    cpu: dict[str, list[float]] = {code: [] for code in env}
    daemons = daemons_of(root, "0", tmp, env)
    try:
        for r in range(opts.miss_rounds):
            for code in (list(daemons) if r % 2 == 0 else list(daemons)[::-1]):
                d = daemons[code]
                _, ms = warm_loadtest(d.target, keymap, opts.seconds, "local", tmp, d.pid)
                cpu[code].append(ms)
                loads.append(os.getloadavg()[0])
                print(label, code, "cache off", f"{ms:.1f}", flush=True)
    finally:
        for d in daemons.values():
            d.stop()
    before, after = (float(np.median(cpu[c])) for c in ("before", "after"))
    return (label, f"{before:.1f}", f"{after:.1f}", f"{after / before:.2f}x",
            " ".join(f"{x:.0f}" for x in cpu["after"]))


if __name__ == "__main__":
    main()
