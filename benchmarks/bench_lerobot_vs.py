"""``LeRobotDataset`` itself against ``LeRobotWindowDataset`` on the same root, written by
LeRobot's own writer: DataLoader samples/s, cold and warm, float32 and uint8 frames, each
side's worker RSS and summed RSS (its workers', and the daemon's on episerve's side; the
main process holds both datasets, so it counts on neither), and what the daemon decoded.

    python benchmarks/bench_lerobot_vs.py [--size 96x128] [--episodes 4] [--length 200]
                                          [--fps 10] [--codec h264|default]
                                          [--cache 2GiB | --cache-share 0.25,1] [--spill]
                                          [--batches N] [--buffered-bytes 1GiB]

Runs in LeRobot's venv (``make lerobot-env``): started from any other interpreter, it runs
itself again with ``.venv-lerobot/bin/python`` (``--lerobot-python``), and the daemon runs
from the interpreter that started it. 2 cameras, 2 workers, batch 32, 2 observation frames
per camera (``delta_timestamps`` one frame apart) and the state, 16 actions; both sides hand
their items to torch's default collate, as a LeRobot training loop does.

``--codec default`` writes the videos with the writer's own defaults (LeRobot 0.6: AV1 by
SVT-AV1, a keyframe every 2 frames), as a LeRobot user's root is; ``h264`` passes an h264
encoder config. ``--cache-share`` sizes the daemon's cache as shares of the decoded frames
(frames x (H x W x 3 + header)), one daemon per share; ``--cache`` gives it in bytes.
``--spill`` runs each with the spill tier off and on (``--spill-dir`` in the run's
temporary folder, 8 GiB): cold, warm, and a third pass after the daemon is stopped and
started again on the same folder ("restarted", the warm pass's order); per pass, the
frames read back from the tier per sample beside those decoded.

Each pass is a shuffled order of every sample (a new permutation per pass, as a shuffled
DataLoader's epochs are; ``--batches`` cuts it shorter), timed from each worker's second
batch on (worker start-up is excluded); "cold" is the daemon's first pass (its cache
empty; LeRobotDataset has no cache, so its two passes are alike). Worker RSS is the
largest VmRSS of the loader's worker processes, read every 4th batch of the pass; the
summed RSS the largest sum of them (with the daemon's, on episerve's side). After
each of the daemon's passes a line gives, per sample, the video frames its decoder gave,
those it converted to RGB, and its CPU (``/proc``); LeRobot's frames decoded per sample
are counted from its rule (seek to the keyframe at or before the first time less a tick,
decode through the first frame at or after the last) over the files' own keyframes.

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
WORKERS, BATCH = 2, 32
KEYS = ("video_frames_decoded", "video_frames_converted", "spill_hits", "samples_read")
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


def v21() -> bool:
    """LeRobot 0.3.x: its writer and reader are v2.1's."""
    from importlib.metadata import version

    return version("lerobot").startswith("0.3.")


def pixels(ep: int, f: int, size: tuple[int, int]) -> dict[str, Any]:
    """Each camera's frame ``f`` of episode ``ep``: gradients that move frame to frame."""
    import numpy as np

    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    out = {}
    for c, cam in enumerate(CAMERAS):
        img = np.empty((h, w, 3), np.uint8)
        img[..., 0] = (x * 5 + f * 9) % 256
        img[..., 1] = (y * 7 + ep * 40) % 256
        img[..., 2] = 60 + 90 * c
        out[cam] = img
    return out


def write(root: Path, episodes: int, length: int, size: tuple[int, int], fps: int,
          codec: str) -> None:
    """The root, by the LeRobot of this venv's own writer. LeRobot 0.3.3 (v2.1) takes the
    task as an argument of ``add_frame`` and the codec as its encoder's argument
    (``save_episode`` leaves it at AV1, what ``default`` keeps); 0.6 takes both in its
    frame and its ``rgb_encoder``, and needs ``finalize``."""
    import functools

    import numpy as np
    from lerobot.datasets import lerobot_dataset

    old = v21()
    h, w = size
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": (6,), "names": None},
        "action": {"dtype": "float32", "shape": (6,), "names": None}}
    for cam in CAMERAS:
        features[cam] = {"dtype": "video", "shape": (h, w, 3),
                         "names": ["height", "width", "channels"]}
    encoder: dict[str, Any] = {}
    if codec != "default" and old:
        from lerobot.datasets import video_utils

        lerobot_dataset.encode_video_frames = functools.partial(
            video_utils.encode_video_frames, vcodec=codec)
    elif codec != "default":
        from lerobot.configs.video import RGBEncoderConfig

        encoder = {"rgb_encoder": RGBEncoderConfig(vcodec=codec)}
    ds = lerobot_dataset.LeRobotDataset.create(repo_id="bench/vs", fps=fps, root=root,
                                               features=features, use_videos=True, **encoder)
    for ep in range(episodes):
        for f in range(length):
            frame: dict[str, Any] = {
                "observation.state": np.full(6, ep * 1000 + f, np.float32),
                "action": np.full(6, -(ep * 1000 + f), np.float32)}
            frame |= pixels(ep, f, (h, w))
            task = f"task {ep % 3}"
            if old:
                ds.add_frame(frame, task=task)
            else:
                ds.add_frame(frame | {"task": task})
        ds.save_episode()
    if not old:
        ds.finalize()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run(ds: Any, order: list[int], extra: tuple[int, ...] = ()) -> tuple[float, float, float]:
    """(samples/s, the largest worker's RSS MB, the largest sum of the workers' RSS and
    ``extra``'s, the daemon on episerve's side) of one pass."""
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=BATCH, sampler=order, num_workers=WORKERS,
                        multiprocessing_context="spawn")
    it = iter(loader)
    for _ in range(WORKERS):  # each worker's first batch (its start-up) is not timed
        next(it)
    workers = getattr(it, "_workers", [])
    t0, n, rss, summed = time.perf_counter(), 0, 0.0, 0.0
    for _ in it:
        n += BATCH
        if n % (4 * BATCH) == 0:  # every 4th batch, while the workers still run
            each = [rss_mb(w.pid) for w in workers if w.is_alive()]
            rss = max([rss, *each])
            summed = max(summed, sum(each) + sum(rss_mb(p) for p in extra))
    rate = n / (time.perf_counter() - t0)
    del it
    return rate, rss, summed


def lerobot_decodes(ds: Any, order: list[int], delta: dict[str, list[float]]) -> float:
    """Frames per sample LeRobot's pyav loop decodes for ``order``: per camera, from the
    keyframe at or before (the first time less a tick) through the first frame at or after
    the last, over each file's own packets (demuxed, not decoded)."""
    import av

    fps = ds.meta.fps
    packets: dict[str, tuple[list[float], list[bool], float]] = {}
    total = 0
    for g in order:
        item = ds.hf_dataset[g]
        ep = int(item["episode_index"])
        length = int(ds.meta.episodes[ep]["length"])
        ts = float(item["timestamp"])
        for cam in CAMERAS:
            path = str(ds.root / ds.meta.get_video_file_path(ep, cam))
            if path not in packets:
                with av.open(path) as c:
                    st = c.streams.video[0]
                    ps = sorted((float(p.pts * st.time_base), bool(p.is_keyframe))
                                for p in c.demux(st) if p.pts is not None)
                    packets[path] = ([t for t, _ in ps], [k for _, k in ps],
                                     float(st.time_base))
            times, keys, tick = packets[path]
            shift = 0.0 if v21() else float(ds.meta.episodes[ep][f"videos/{cam}/from_timestamp"])
            query = [min(max(ts + d, 0.0), (length - 1) / fps) + shift for d in delta[cam]]
            seek = (round(query[0] / tick) - 1) * tick
            start = max((i for i, t in enumerate(times) if keys[i] and t <= seek + tick / 4),
                        default=0)
            end = next((i for i in range(start, len(times)) if times[i] >= max(query)),
                       len(times) - 1)
            total += end - start + 1
    return total / max(1, len(order))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="96x128", help="HxW of each camera")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--fps", type=int, default=10)
    p.add_argument("--codec", default="h264", help="h264, or default: the writer's own")
    p.add_argument("--batches", type=int, default=0,
                   help="batches per pass after the workers' first (0: every sample)")
    p.add_argument("--cache", default="", help="the daemon's --cache-bytes")
    p.add_argument("--cache-share", default="",
                   help="comma-separated shares of the decoded frames, a daemon each")
    p.add_argument("--buffered-bytes", default="1GiB", help="the daemon's --max-buffered-bytes")
    p.add_argument("--spill", action="store_true",
                   help="each cache size with the spill tier off and on (and a pass after "
                        "the daemon restarts on its folder)")
    p.add_argument("--lerobot-python", type=Path, default=REPO / ".venv-lerobot/bin/python")
    a = p.parse_args()
    try:
        import lerobot  # noqa: F401
    except ImportError:
        raise SystemExit(rerun_in_lerobot_venv(a.lerobot_python)) from None

    import numpy as np
    from common import cpu_s, table
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from episerve_client import Client, LeRobotWindowDataset
    from episerve_tools.launch import DaemonProcess

    h, w = (int(v) for v in a.size.split("x"))
    step = 1 / a.fps
    delta = {"observation.state": [-step, 0.0], "action": [k * step for k in range(16)]}
    delta |= {cam: [-step, 0.0] for cam in CAMERAS}
    total = a.episodes * a.length
    decoded_bytes = total * len(CAMERAS) * (h * w * 3 + 16)
    caches = [(f"{float(x):g} of the frames", str(int(float(x) * decoded_bytes)))
              for x in a.cache_share.split(",") if x] or [(a.cache or "2GiB", a.cache or "2GiB")]
    rng = np.random.default_rng(0)
    per_pass = min(total, (a.batches + WORKERS) * BATCH) if a.batches else total
    orders = {pass_: rng.permutation(total)[:per_pass].tolist() for pass_ in ("cold", "warm")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        t0 = time.perf_counter()
        write(root, a.episodes, a.length, (h, w), a.fps, a.codec)
        written_s = time.perf_counter() - t0
        ref = LeRobotDataset("bench/vs", root=root, delta_timestamps=delta,
                             video_backend="pyav")
        theirs_decoded = {k: lerobot_decodes(ref, o[: len(o) - len(o) % BATCH], delta)
                          for k, o in orders.items()}
        print(f"LeRobotDataset decodes {theirs_decoded['cold']:.1f} / "
              f"{theirs_decoded['warm']:.1f} frames a sample (its rule, these orders)",
              flush=True)
        tiers = ("off", "on") if a.spill else ("",)
        order_of = {"cold": "cold", "warm": "warm", "restarted": "warm"}
        for label, cache in caches:
            for tier in tiers:
                for uint8 in (False,) if v21() else (False, True):  # (0.3.3: float32 only)
                    frames = "uint8" if uint8 else "float32"
                    theirs = LeRobotDataset("bench/vs", root=root, delta_timestamps=delta,
                                            video_backend="pyav",
                                            **({"return_uint8": True} if uint8 else {}))
                    spill = ["--spill-dir", str(Path(tmp) / f"spill-{label}-{frames}"),
                             "--spill-bytes", "8GiB"] if tier == "on" else []
                    passes = [("cold", 0), ("warm", 0)] + ([("restarted", 1)] if spill else [])
                    pid, daemon = -1, None
                    try:
                        for pass_, generation in passes:
                            if daemon is None or generation:
                                if daemon is not None:
                                    daemon.stop()
                                daemon = DaemonProcess(
                                    root, "--rescan-s", "0", "--max-response-bytes", "250MiB",
                                    "--cache-bytes", cache, *spill,
                                    "--max-buffered-bytes", a.buffered_bytes,
                                    unix=Path(tmp) / f"d{int(uint8)}.sock",
                                    python=os.environ.get("DAEMON_PYTHON"))
                                ours = LeRobotWindowDataset(daemon.target, root, delta,
                                                            return_uint8=uint8)
                                counts = Client(daemon.target)
                                seen = {k: 0 for k in KEYS}
                                pid = daemon.proc.pid
                                cpu = cpu_s(pid)
                            order = orders[order_of[pass_]]
                            ours_s, ours_rss, ours_sum = run(ours, order, (pid,))
                            now = {k: int(counts.stats().get(k, 0)) for k in KEYS}
                            done = {k: now[k] - seen[k] for k in KEYS}
                            seen = now
                            n = max(1, done["samples_read"])
                            used, cpu = cpu_s(pid) - cpu, cpu_s(pid)
                            where = f"{label}{f', spill {tier}' if tier else ''}"
                            print(f"daemon, cache {where}, {frames} {pass_}: per sample "
                                  f"{done['video_frames_decoded'] / n:.2f} frames decoded, "
                                  f"{done['video_frames_converted'] / n:.2f} converted, "
                                  f"{done['spill_hits'] / n:.2f} read back from the spill "
                                  f"tier, {1e3 * used / n:.1f} ms CPU ({n} samples)",
                                  flush=True)
                            theirs_s, theirs_rss, theirs_sum = run(theirs, order)
                            rows.append((where, f"{frames} {pass_}", f"{ours_s:.1f}",
                                         f"{theirs_s:.1f}", f"{ours_s / theirs_s:.2f}x",
                                         f"{done['video_frames_decoded'] / n:.2f}",
                                         f"{theirs_decoded[order_of[pass_]]:.1f}",
                                         f"{1e3 * used / n:.1f}", f"{ours_rss:.0f}",
                                         f"{theirs_rss:.0f}", f"{ours_sum:.0f}",
                                         f"{theirs_sum:.0f}"))
                            print(*rows[-1], flush=True)
                    finally:
                        if daemon is not None:
                            daemon.stop()
    from importlib.metadata import version

    print(f"{a.episodes} episodes x {a.length} frames at {a.fps} fps written by LeRobot "
          f"{version('lerobot')}'s writer in {written_s:.0f} s, 2 cameras of {h}x{w} "
          f"({a.codec} codec), "
          f"{decoded_bytes / 2**20:.0f} MiB of decoded frames; {WORKERS} workers, batch "
          f"{BATCH}, {per_pass} samples a pass")
    print(table(rows, ("daemon cache", "frames, pass", "LeRobotWindowDataset samples/s",
                       "LeRobotDataset samples/s", "ratio", "episerve frames decoded/sample",
                       "LeRobot frames decoded/sample", "daemon CPU ms/sample",
                       "episerve worker RSS MB", "LeRobot worker RSS MB",
                       "episerve workers + daemon RSS MB", "LeRobot workers RSS MB")))


if __name__ == "__main__":
    main()
