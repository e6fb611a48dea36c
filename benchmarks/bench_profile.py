"""Where the daemon's CPU goes on the warm path over the local plane: py-spy's shares.

    python benchmarks/bench_profile.py [--root data/bench] [--seconds 8] [--top 14]

One daemon on a unix socket, warm (8 GiB cache, a pass over the episodes first);
``episerve loadtest`` (16 clients x batch 64, first 24 episodes) over the local plane while
``py-spy record`` samples the daemon (200 Hz, without pausing it). Per keymap (numeric,
then with camera bytes), the daemon's CPU per 1,000 samples over that run and, for the
functions of episerve with the largest inclusive share of the samples, that share and
the part of the CPU figure it stands for. Samples are of threads running Python (idle
ones are left out), so the shares are of the daemon's busy time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from common import MECKA, NUMERIC_MECKA, cpu_s, ensure_dataset, table
from daemons import EPISODES, loadtest

from episerve_tools.launch import DaemonProcess


def py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or \
        shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (the bench extra has it)")
    return found


def shares(raw: Path) -> tuple[int, Counter[str]]:
    """(samples, per episerve function the samples it is on the stack of) from py-spy's
    raw output: one ``frame;frame;... count`` line per distinct stack. Only the frames the
    event loop runs count (start-up's frames under it are on every stack); a sample with
    none of episerve's is counted as ``(the event loop itself)``."""
    total, inclusive = 0, Counter[str]()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        loop = [k for k, f in enumerate(frames) if f.startswith("Runner.run ")]
        seen = set()
        for frame in frames[loop[-1] + 1 if loop else 0:]:
            name, _, where = frame.partition(" (")
            if "episerve_" not in where:
                continue
            module = where.split(":")[0].rsplit("/", 1)[-1].removesuffix(".py")
            fn = f"{module}.{name}"
            if fn not in seen:
                seen.add(fn)
                inclusive[fn] += n
        if not seen:
            inclusive["(the event loop itself)"] += n
    return total, inclusive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--top", type=int, default=14)
    opts = p.parse_args()
    spy = py_spy()
    ensure_dataset(opts.root, EPISODES)
    root = str(Path(opts.root).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        for label, km, warm_s in (("numeric", NUMERIC_MECKA, 4.0),
                                  ("with camera bytes", MECKA, 20.0)):
            keymap = Path(tmp) / "keymap.yaml"
            keymap.write_text(yaml.safe_dump(km))
            raw = Path(tmp) / "spy.txt"
            with DaemonProcess(root, "--cache-bytes", "8GiB", "--log-level", "WARNING",
                               "--rescan-s", "0", unix=f"{tmp}/d.sock") as daemon:
                loadtest(daemon.target, keymap, warm_s, "grpc", tmp)  # every chunk cached
                sampler = subprocess.Popen(
                    [spy, "record", "--pid", str(daemon.pid), "--format", "raw", "-o",
                     str(raw), "--rate", "200", "--nonblocking",
                     "-d", str(int(opts.seconds) + 2)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                time.sleep(1.0)  # py-spy attached
                before = cpu_s(daemon.pid)
                samples, _ = loadtest(daemon.target, keymap, opts.seconds, "local", tmp)
                ms = (cpu_s(daemon.pid) - before) / samples * 1e6
                _, err = sampler.communicate(timeout=opts.seconds + 60)
                if sampler.returncode != 0 or not raw.exists():
                    raise SystemExit(f"py-spy failed: {err.strip()[-400:]}")
            total, inclusive = shares(raw)
            print(f"{label}: daemon CPU {ms:.1f} ms per 1,000 warm samples over the local "
                  f"plane ({samples / opts.seconds:,.0f} samples/s), {total} samples")
            rows = [(fn, f"{n / total:.1%}", f"{ms * n / total:.1f}")
                    for fn, n in inclusive.most_common(opts.top)]
            print(table(rows, (f"{label}: function", "share", "ms per 1,000")))
            print()


if __name__ == "__main__":
    main()
