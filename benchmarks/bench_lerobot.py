"""DataLoader samples/s over a LeRobot v3 dataset: WindowDataset through the daemon against
LeRobot's way of loading, with 1 and 2 cameras.

    python benchmarks/bench_lerobot.py [--batches 20] [--episodes 8] [--size 96x128]

Budget of the issue: 2 workers, batch 32, 2 observation frames, 16 actions, random samples.
Each configuration runs the same indices twice, cold then warm; throughput is timed from
each worker's second batch on, so worker start-up is excluded (workers are spawned: this process
talks gRPC to read the daemon's counters). The dataset is written with pyarrow and
PyAV in the v3 layout (``tests/support/lerobot.py``; keyframe every 2 frames, LeRobot's
writer default).

The baseline is ``LeRobotDataset`` (``video_backend="pyav"``) when ``lerobot`` imports;
where it does not (LeRobot 0.4 needs torch < 2.11), it is ``PerSampleLoader`` below, which
loads as LeRobot's pyav path does: per sample and camera, open the mp4, seek to the
keyframe before the first timestamp, decode to the last, take the nearest frames; numbers
from the parquet table held in memory. Its label says which one ran.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import table

from episerve_client import Client, WindowDataset, collate, keymap_from_lerobot
from episerve_tools.launch import DaemonProcess
from tests.support import lerobot as lr

WORKERS, BATCH = 2, 32
CAMERAS = ("observation.images.top", "observation.images.wrist")


def delta(cameras: tuple[str, ...]) -> dict[str, list[float]]:
    step = 1 / lr.FPS
    out = {"observation.state": [-step, 0.0], "action": [k * step for k in range(16)]}
    out |= {cam: [-step, 0.0] for cam in cameras}
    return out


class PerSampleLoader(Dataset[dict[str, Any]]):
    """LeRobot's pyav loading, per sample (see the module docstring)."""

    def __init__(self, root: Path, deltas: dict[str, list[float]], tolerance_s: float = 1e-4):
        import pyarrow.parquet as pq

        self.root, self.deltas, self.tol = root, deltas, tolerance_s
        self.episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet") \
            .to_pylist()
        tables = [pq.read_table(p) for p in sorted((root / "data").glob("chunk-*/file-*.parquet"))]
        cols = {c: np.concatenate([np.asarray(t.column(c).to_pylist(), np.float32)
                                   for t in tables]) for c in ("observation.state", "action")}
        self.cols = cols
        self.index = [(e, f) for e in self.episodes for f in range(e["length"])]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ep, frame = self.index[i]
        start, length = ep["dataset_from_index"], ep["length"]
        out: dict[str, Any] = {}
        for key, offsets in self.deltas.items():
            raw = [frame + round(o * lr.FPS) for o in offsets]
            rows = [min(max(r, 0), length - 1) for r in raw]
            out[f"{key}_is_pad"] = torch.tensor([not 0 <= r < length for r in raw])
            if key in self.cols:
                out[key] = torch.from_numpy(self.cols[key][[start + r for r in rows]])
            else:
                path = self.root / lr.VIDEO_PATH.format(
                    video_key=key, chunk_index=ep[f"videos/{key}/chunk_index"],
                    file_index=ep[f"videos/{key}/file_index"])
                base = ep[f"videos/{key}/from_timestamp"]
                out[key] = self._frames(path, [base + r / lr.FPS for r in rows])
        return out

    def _frames(self, path: Path, ts: list[float]) -> torch.Tensor:
        import av

        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            container.seek(int(min(ts) / stream.time_base), stream=stream, backward=True)
            loaded, times = [], []
            for frame in container.decode(stream):
                loaded.append(frame.to_ndarray(format="rgb24"))
                times.append(float(frame.time))
                if times[-1] >= max(ts):
                    break
        picked = []
        for t in ts:
            k = int(np.argmin(np.abs(np.asarray(times) - t)))
            assert abs(times[k] - t) < self.tol, (path, t, times[k])
            picked.append(torch.from_numpy(loaded[k]).permute(2, 0, 1).float() / 255)
        return torch.stack(picked)


def baseline(root: Path, deltas: dict[str, list[float]]) -> tuple[str, Dataset[Any]]:
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except Exception as exc:  # not installed, or a torchvision built for another torch
        why = f"{type(exc).__name__}: {str(exc)[:80]}"
        return f"per-sample loader (LeRobot's pyav way; LeRobotDataset: {why})", \
            PerSampleLoader(root, deltas)
    return "LeRobotDataset(pyav)", LeRobotDataset("bench", root=root, delta_timestamps=deltas,
                                                 video_backend="pyav")


def run(ds: Dataset[Any], order: list[int], collate_fn: Any) -> float:
    loader = DataLoader(ds, batch_size=BATCH, sampler=order, num_workers=WORKERS,
                        collate_fn=collate_fn, multiprocessing_context="spawn")
    it = iter(loader)
    for _ in range(WORKERS):  # each worker's first batch (its start-up) is not timed
        next(it)
    t0, n = time.perf_counter(), 0
    for _ in it:
        n += BATCH
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--size", default="96x128", help="HxW of each camera")
    p.add_argument("--frames", default="float32", choices=("float32", "uint8"),
                   help="WindowDataset's frames (the baseline gives float32 always)")
    a = p.parse_args()
    h, w = (int(x) for x in a.size.split("x"))
    rng = np.random.default_rng(0)
    caption = (f"{a.episodes} episodes x {a.length} frames, {h}x{w} h264 (keyframe every "
               f"2), {WORKERS} workers, batch {BATCH}, 2 obs frames, 16 actions, episerve "
               f"frames {a.frames}")
    label, rows = "", []
    with tempfile.TemporaryDirectory() as tmp:
        for n_cams in (1, 2):
            cams = CAMERAS[:n_cams]
            root = lr.write(Path(tmp) / f"ds{n_cams}", lr.Layout(
                lengths=(a.length,) * a.episodes, per_file=4, cameras=cams, size=(h, w),
                gop=2))
            deltas = delta(cams)
            total = a.length * a.episodes
            order = rng.integers(0, total, (a.batches + WORKERS) * BATCH).tolist()
            label, theirs = baseline(root, deltas)
            with DaemonProcess(root, "--rescan-s", "0", "--max-response-bytes", "200MiB",
                               unix=Path(tmp) / f"d{n_cams}.sock") as d:
                keymap = keymap_from_lerobot(root, deltas, features=[*deltas])
                ours = WindowDataset(d.target, keymap, masks="all", frames=a.frames)
                for pass_ in ("cold", "warm"):
                    with Client(d.target) as c:
                        before = c.stats().get("video_frames_decoded", 0)
                    ours_s = run(ours, order, collate)
                    with Client(d.target) as c:
                        decoded = c.stats().get("video_frames_decoded", 0) - before
                    theirs_s = run(theirs, order, None)
                    per = decoded / len(order)
                    rows.append((f"{n_cams} {pass_}", f"{ours_s:.0f}", f"{theirs_s:.0f}",
                                 f"{ours_s / theirs_s:.1f}x", f"{per:.2f}"))
                    print(*rows[-1], flush=True)
    print(caption)
    print(table(rows, ("cameras, pass", "episerve samples/s", "baseline samples/s", "ratio",
                       "frames decoded per sample")))
    print(f"baseline: {label}")


if __name__ == "__main__":
    main()
