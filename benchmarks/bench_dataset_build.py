"""How long building a ``WindowDataset`` takes over a flagship-size root (1,600 episodes).

    python benchmarks/bench_dataset_build.py [--root /tmp/episerve_1600] [--episodes 1600]

Writes the root first if it is missing: episodes of 200 frames with the mecka numeric keys,
a 32x24 front camera and annotations (their listing is what matters here, not their data).
Reports the median of ``--reps`` constructions of the mecka keymap's dataset over the whole
root (brief listing and the daemon's keymap check in the child process included), the probe
child alone (forked and as a fresh interpreter), the calls it makes timed in process, and
apart the parent's own share: unpickling the probe's reply, the broken-episode policy and
the manifest. For comparison, the full listing that construction used to fetch.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import simplejpeg
from common import MECKA

from episerve_client import Client, WindowDataset, _probe
from episerve_client.data.episodes import whole_root
from episerve_client.data.manifest import Manifest
from episerve_tools.launch import DaemonProcess

FRAMES = 200
NUMERIC = {"left.obs_keypoints": 63, "right.obs_keypoints": 63, "left.obs_wrist_pose": 7,
           "right.obs_wrist_pose": 7, "obs_head_pose": 7}


def ensure_root(root: Path, episodes: int) -> None:
    from episerve_tools.synth.writer import write_episode

    have = len(list(root.glob("*.zarr"))) if root.exists() else 0
    if have >= episodes:
        return
    root.mkdir(parents=True, exist_ok=True)
    frame = simplejpeg.encode_jpeg(np.zeros((24, 32, 3), np.uint8), quality=85)
    rng = np.random.default_rng(0)
    for n in range(have, episodes):
        write_episode(
            root, f"{n:016x}", total_frames=FRAMES, fps=30, embodiment="human_bimanual",
            numeric={k: rng.standard_normal((FRAMES, d)).astype(np.float32)
                     for k, d in NUMERIC.items()},
            jpeg={"images.front_1": [frame] * FRAMES},
            annotations=[{"text": "pick", "start_idx": 0, "end_idx": FRAMES}],
            extra_attrs={"task_name": "bench", "task_description": "pick the cup up"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="/tmp/episerve_1600")
    p.add_argument("--episodes", type=int, default=1600)
    p.add_argument("--reps", type=int, default=5)
    opts = p.parse_args()
    root = Path(opts.root)
    ensure_root(root, opts.episodes)
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(
            root, "--log-level", "WARNING", unix=f"{tmp}/d.sock") as d:
        builds = []
        for _ in range(opts.reps):
            start = time.perf_counter()
            ds = WindowDataset(d.target, MECKA)
            builds.append(time.perf_counter() - start)
        assert len(ds.manifest.hashes) == opts.episodes, len(ds.manifest.hashes)
        request = ("probe", (d.target, MECKA, 60.0, {}))
        paths: dict[str, list[float]] = {"forked": [], "spawned": []}
        for _ in range(opts.reps):  # alternating, so both see the same neighbours
            for name, run in (("forked", _probe._forked), ("spawned", _probe._spawned)):
                start = time.perf_counter()
                run(request, d.target, 90.0)
                paths[name].append(time.perf_counter() - start)
        blob = _probe._forked(request, d.target, 90.0)  # before this process uses gRPC
        calls: dict[str, list[float]] = {"brief": [], "check": [], "full": []}
        with Client(d.target) as client:
            for _ in range(opts.reps):
                for name, call in (("brief", lambda: client.list_episodes(brief=True)),
                                   ("check", lambda: client.check_keymap(MECKA)),
                                   ("full", lambda: client.list_episodes())):
                    start = time.perf_counter()
                    call()
                    calls[name].append(time.perf_counter() - start)
            full_blob = pickle.dumps(client.list_episodes())
        parents = []
        for _ in range(opts.reps):
            start = time.perf_counter()
            got = pickle.loads(blob)
            chosen = whole_root(got, "skip", d.target)
            Manifest(tuple((e.hash, e.total_frames) for e in chosen))
            parents.append(time.perf_counter() - start)
    print(f"{opts.episodes} episodes, {len(ds):,} frames")
    print(f"WindowDataset(...) over the root: median {statistics.median(builds):.3f} s "
          f"(min {min(builds):.3f}, max {max(builds):.3f}; listing and keymap check in the "
          "child process included)")
    for name, times in paths.items():
        print(f"probe child {name}: median {statistics.median(times):.3f} s "
              "(listing, keymap registration, pickled reply)")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} "
          "cores")
    ms = {name: statistics.median(times) * 1e3 for name, times in calls.items()}
    print(f"in process, medians: list_episodes(brief=True) {ms['brief']:.1f} ms, "
          f"check_keymap() {ms['check']:.1f} ms (what the probe asks for); "
          f"list_episodes() with full entries {ms['full']:.1f} ms (no longer asked for)")
    print(f"probe reply {len(blob) / 1e6:.3f} MB pickled (the full listing: "
          f"{len(full_blob) / 1e6:.2f} MB)")
    print(f"parent's share (unpickle, on_broken policy, manifest): median "
          f"{statistics.median(parents) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
