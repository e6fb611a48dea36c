"""``LeRobotDataset`` itself against ``LeRobotWindowDataset`` on the same root, written by
LeRobot's own writer: DataLoader samples/s, cold and warm, float32 and uint8 frames, and
each side's worker RSS.

    python benchmarks/bench_lerobot_vs.py [--size 96x128] [--episodes 4] [--length 200]
                                          [--batches 20] [--cache-bytes 2GiB]
                                          [--buffered-bytes 1GiB]

Runs in LeRobot's venv (``make lerobot-env``): started from any other interpreter, it runs
itself again with ``.venv-lerobot/bin/python`` (``--lerobot-python``), and the daemon runs
from the interpreter that started it. 2 cameras, h264, 2 workers, batch 32, 2 observation
frames per camera and state, 16 actions, random samples; both sides hand their items to
torch's default collate, as a LeRobot training loop does. Each pass times from each
worker's second batch on (worker start-up is excluded); "cold" is the daemon's first pass
(its cache empty; LeRobotDataset has no cache, so its two passes are alike). Worker RSS is
the largest VmRSS of the loader's worker processes, read every 4th batch of the pass.
After each of the daemon's passes a line gives the video frames it converted (decoded to
RGB) per sample.

The daemon's ``--max-buffered-bytes`` is 1 GiB here: at 480x640 one batch's answer is
~140 MB, and a DataLoader worker waiting for its next indices keeps its last answer
charged to that budget, so under the default 256 MiB the other worker's read was refused
until its deadline (the loader's order keeps the first waiting for the second).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKERS, BATCH, FPS = 2, 32, 10
CAMERAS = ("observation.images.top", "observation.images.wrist")


def rerun_in_lerobot_venv(python: Path) -> int:
    if not python.exists():
        print(f"no {python}: run `make lerobot-env` first", file=sys.stderr)
        return 1
    paths = [REPO / "protos", REPO / "client", REPO / "tools", REPO, REPO / "benchmarks"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)),
           "DAEMON_PYTHON": sys.executable}
    return subprocess.run([str(python), __file__, *sys.argv[1:]], env=env,
                          check=False).returncode


def write(root: Path, episodes: int, length: int, size: tuple[int, int]) -> None:
    import numpy as np
    from lerobot.configs.video import RGBEncoderConfig
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    h, w = size
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": (6,), "names": None},
        "action": {"dtype": "float32", "shape": (6,), "names": None}}
    for cam in CAMERAS:
        features[cam] = {"dtype": "video", "shape": (h, w, 3),
                         "names": ["height", "width", "channels"]}
    ds = LeRobotDataset.create(repo_id="bench/vs", fps=FPS, root=root, features=features,
                               use_videos=True, rgb_encoder=RGBEncoderConfig(vcodec="h264"))
    y, x = np.mgrid[0:h, 0:w]
    for ep in range(episodes):
        for f in range(length):
            frame: dict[str, Any] = {
                "observation.state": np.full(6, ep * 1000 + f, np.float32),
                "action": np.full(6, -(ep * 1000 + f), np.float32), "task": f"task {ep % 3}"}
            for c, cam in enumerate(CAMERAS):
                img = np.empty((h, w, 3), np.uint8)
                img[..., 0] = (x * 5 + f * 9) % 256
                img[..., 1] = (y * 7 + ep * 40) % 256
                img[..., 2] = 60 + 90 * c
                frame[cam] = img
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run(ds: Any, order: list[int]) -> tuple[float, float]:
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=BATCH, sampler=order, num_workers=WORKERS,
                        multiprocessing_context="spawn")
    it = iter(loader)
    for _ in range(WORKERS):  # each worker's first batch (its start-up) is not timed
        next(it)
    workers = getattr(it, "_workers", [])
    t0, n, rss = time.perf_counter(), 0, 0.0
    for _ in it:
        n += BATCH
        if n % (4 * BATCH) == 0:  # every 4th batch, while the workers still run
            rss = max([rss, *(rss_mb(w.pid) for w in workers if w.is_alive())])
    rate = n / (time.perf_counter() - t0)
    del it
    return rate, rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="96x128", help="HxW of each camera")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--cache-bytes", default="2GiB", help="the daemon's --cache-bytes")
    p.add_argument("--buffered-bytes", default="1GiB", help="the daemon's --max-buffered-bytes")
    p.add_argument("--lerobot-python", type=Path, default=REPO / ".venv-lerobot/bin/python")
    a = p.parse_args()
    try:
        import lerobot  # noqa: F401
    except ImportError:
        raise SystemExit(rerun_in_lerobot_venv(a.lerobot_python)) from None

    import numpy as np
    from common import table
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from episerve_client import Client, LeRobotWindowDataset
    from episerve_tools.launch import DaemonProcess

    h, w = (int(v) for v in a.size.split("x"))
    step = 1 / FPS
    delta = {"observation.state": [-step, 0.0], "action": [k * step for k in range(16)]}
    delta |= {cam: [-step, 0.0] for cam in CAMERAS}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        t0 = time.perf_counter()
        write(root, a.episodes, a.length, (h, w))
        written_s = time.perf_counter() - t0
        total = a.episodes * a.length
        order = np.random.default_rng(0).integers(
            0, total, (a.batches + WORKERS) * BATCH).tolist()
        for uint8 in (False, True):
            theirs = LeRobotDataset("bench/vs", root=root, delta_timestamps=delta,
                                    video_backend="pyav", return_uint8=uint8)
            sock = Path(tmp) / f"d{int(uint8)}.sock"
            with DaemonProcess(root, "--rescan-s", "0", "--max-response-bytes", "250MiB",
                               "--cache-bytes", a.cache_bytes,
                               "--max-buffered-bytes", a.buffered_bytes, unix=sock,
                               python=os.environ.get("DAEMON_PYTHON")) as d:
                ours = LeRobotWindowDataset(d.target, root, delta, return_uint8=uint8)
                counts = Client(d.target)
                seen = {"video_frames_decoded": 0, "samples_read": 0}
                for pass_ in ("cold", "warm"):
                    ours_s, ours_rss = run(ours, order)
                    now = {k: int(counts.stats().get(k, 0)) for k in seen}
                    done = {k: now[k] - seen[k] for k in seen}
                    seen = now
                    print(f"daemon, {pass_}: {done['video_frames_decoded']} video frames "
                          f"converted for {done['samples_read']} samples "
                          f"({done['video_frames_decoded'] / max(1, done['samples_read']):.1f}"
                          f" a sample)", flush=True)
                    theirs_s, theirs_rss = run(theirs, order)
                    rows.append((f"{'uint8' if uint8 else 'float32'} {pass_}",
                                 f"{ours_s:.0f}", f"{theirs_s:.0f}",
                                 f"{ours_s / theirs_s:.1f}x", f"{ours_rss:.0f}",
                                 f"{theirs_rss:.0f}"))
                    print(*rows[-1], flush=True)
    print(f"{a.episodes} episodes x {a.length} frames written by LeRobot's writer in "
          f"{written_s:.0f} s, 2 cameras of {h}x{w} h264, {WORKERS} workers, batch {BATCH}, "
          f"daemon --cache-bytes {a.cache_bytes}")
    print(table(rows, ("frames, pass", "LeRobotWindowDataset samples/s",
                       "LeRobotDataset samples/s", "ratio", "episerve worker RSS MB",
                       "LeRobot worker RSS MB")))


if __name__ == "__main__":
    main()
