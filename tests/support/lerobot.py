"""A small LeRobot v3.0 dataset written with pyarrow and PyAV, laid out as LeRobot's own
writer lays it out: ``meta/info.json``, ``meta/tasks.parquet``,
``meta/episodes/chunk-000/file-000.parquet``, ``data/chunk-000/file-NNN.parquet`` (several
episodes per file) and ``videos/<key>/chunk-000/file-NNN.mp4`` (the same episodes, one after
the other; each episode's ``from_timestamp`` is where it starts in its file).

Values are known from the episode and frame (``state_value``, ``frame_pixels``), so tests
can compare what the daemon serves with the truth; frames of an mp4 are lossy, so tests
compare them with PyAV's own decode of the file (``decoded_frames``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from episerve_tools.synth.lerobot_root import write_mp4 as write_video

FPS = 10
STATE_DIM = 3
ACTION_DIM = 2
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"


@dataclass(frozen=True)
class Layout:
    lengths: Sequence[int] = (12, 7, 20, 9)
    per_file: int = 2  # episodes per data (and video) file
    cameras: Sequence[str] = ("observation.images.top", "observation.images.wrist")
    size: tuple[int, int] = (32, 48)  # (H, W)
    gop: int = 5
    tasks: Sequence[str] = ("pick the cube", "place the cube")
    #: per episode, the task of each frame (index into ``tasks``); default: episode % 2
    frame_tasks: dict[int, list[int]] = field(default_factory=dict)


def state_value(episode: int, frame: int) -> np.ndarray:
    return (episode * 1000 + frame + np.arange(STATE_DIM) / 8).astype(np.float32)


def action_value(episode: int, frame: int) -> np.ndarray:
    return (-(episode * 1000 + frame) - np.arange(ACTION_DIM) / 4).astype(np.float32)


def frame_pixels(episode: int, frame: int, camera: int, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    img = np.empty((h, w, 3), np.uint8)
    img[..., 0] = (x * 5 + frame * 9) % 256
    img[..., 1] = (y * 7 + episode * 40) % 256
    img[..., 2] = 60 + 90 * camera
    return img


def task_of(layout: Layout, episode: int, frame: int) -> int:
    tasks = layout.frame_tasks.get(episode)
    return tasks[frame] if tasks is not None else episode % len(layout.tasks)


def write(root: Path, layout: Layout = Layout()) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    n = len(layout.lengths)
    files = [list(range(k, min(n, k + layout.per_file))) for k in range(0, n, layout.per_file)]
    episode_rows: list[dict[str, Any]] = []
    index = 0
    for file_index, episodes in enumerate(files):
        cols: dict[str, list[Any]] = {c: [] for c in (
            "observation.state", "action", "timestamp", "frame_index", "episode_index",
            "index", "task_index")}
        starts = {}
        at_s = 0.0
        for ep in episodes:
            length = layout.lengths[ep]
            starts[ep] = at_s
            at_s += length / FPS
            row: dict[str, Any] = {
                "episode_index": ep, "length": length,
                "tasks": sorted({layout.tasks[task_of(layout, ep, f)] for f in range(length)}),
                "data/chunk_index": 0, "data/file_index": file_index,
                "dataset_from_index": index, "dataset_to_index": index + length,
            }
            for cam in layout.cameras:
                row |= {f"videos/{cam}/chunk_index": 0, f"videos/{cam}/file_index": file_index,
                        f"videos/{cam}/from_timestamp": starts[ep],
                        f"videos/{cam}/to_timestamp": starts[ep] + length / FPS}
            episode_rows.append(row)
            for f in range(length):
                cols["observation.state"].append(state_value(ep, f).tolist())
                cols["action"].append(action_value(ep, f).tolist())
                cols["timestamp"].append(f / FPS)
                cols["frame_index"].append(f)
                cols["episode_index"].append(ep)
                cols["index"].append(index)
                cols["task_index"].append(task_of(layout, ep, f))
                index += 1
        table = pa.table({
            "observation.state": pa.array(cols["observation.state"], pa.list_(pa.float32())),
            "action": pa.array(cols["action"], pa.list_(pa.float32())),
            "timestamp": pa.array(cols["timestamp"], pa.float32()),
            "frame_index": pa.array(cols["frame_index"], pa.int64()),
            "episode_index": pa.array(cols["episode_index"], pa.int64()),
            "index": pa.array(cols["index"], pa.int64()),
            "task_index": pa.array(cols["task_index"], pa.int64()),
        })
        path = root / DATA_PATH.format(chunk_index=0, file_index=file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=8)  # several row groups per file
        for c, cam in enumerate(layout.cameras):
            frames = [frame_pixels(ep, f, c, layout.size)
                      for ep in episodes for f in range(layout.lengths[ep])]
            vpath = root / VIDEO_PATH.format(video_key=cam, chunk_index=0, file_index=file_index)
            write_mp4(vpath, frames, layout.gop)
    pq.write_table(pa.Table.from_pylist(episode_rows),
                   root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(pa.table({"task": list(layout.tasks),
                             "task_index": list(range(len(layout.tasks)))}),
                   root / "meta" / "tasks.parquet")
    (root / "meta" / "info.json").write_text(json.dumps(info(layout, index), indent=2))
    return root


V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"


def write_v21(root: Path, layout: Layout = Layout()) -> Path:
    """The same episodes as a LeRobot v2.1 root: one data file and one video per episode
    and camera (each starting at 0 s), ``meta/episodes.jsonl`` and ``meta/tasks.jsonl``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "meta").mkdir(parents=True, exist_ok=True)
    lines = []
    index = 0
    for ep, length in enumerate(layout.lengths):
        frames = range(length)
        table = pa.table({
            "observation.state": pa.array([state_value(ep, f).tolist() for f in frames],
                                          pa.list_(pa.float32())),
            "action": pa.array([action_value(ep, f).tolist() for f in frames],
                               pa.list_(pa.float32())),
            "timestamp": pa.array([f / FPS for f in frames], pa.float32()),
            "frame_index": pa.array(list(frames), pa.int64()),
            "episode_index": pa.array([ep] * length, pa.int64()),
            "index": pa.array(list(range(index, index + length)), pa.int64()),
            "task_index": pa.array([task_of(layout, ep, f) for f in frames], pa.int64()),
        })
        path = root / V21_DATA_PATH.format(episode_chunk=0, episode_index=ep)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=8)
        for c, cam in enumerate(layout.cameras):
            write_mp4(root / V21_VIDEO_PATH.format(episode_chunk=0, video_key=cam,
                                                   episode_index=ep),
                      [frame_pixels(ep, f, c, layout.size) for f in frames], layout.gop)
        tasks = sorted({layout.tasks[task_of(layout, ep, f)] for f in frames})
        lines.append(json.dumps({"episode_index": ep, "tasks": tasks, "length": length}))
        index += length
    (root / "meta" / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    (root / "meta" / "tasks.jsonl").write_text("".join(
        json.dumps({"task_index": k, "task": t}) + "\n" for k, t in enumerate(layout.tasks)))
    doc = info(layout, index) | {"codebase_version": "v2.1", "data_path": V21_DATA_PATH,
                                 "video_path": V21_VIDEO_PATH if layout.cameras else None,
                                 "total_chunks": 1}
    (root / "meta" / "info.json").write_text(json.dumps(doc, indent=2))
    return root


def v21_video(root: Path, camera: str, episode: int) -> Path:
    return root / V21_VIDEO_PATH.format(episode_chunk=0, video_key=camera,
                                        episode_index=episode)


def info(layout: Layout, total_frames: int) -> dict[str, Any]:
    h, w = layout.size
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": [STATE_DIM], "names": None},
        "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    for cam in layout.cameras:
        features[cam] = {"dtype": "video", "shape": [h, w, 3],
                         "names": ["height", "width", "channels"],
                         "info": {"video.fps": FPS, "video.codec": "h264"}}
    return {
        "codebase_version": "v3.0", "robot_type": "test_arm",
        "total_episodes": len(layout.lengths), "total_frames": total_frames,
        "total_tasks": len(layout.tasks), "chunks_size": 1000,
        "data_files_size_in_mb": 100, "video_files_size_in_mb": 500, "fps": FPS,
        "splits": {"train": f"0:{len(layout.lengths)}"},
        "data_path": DATA_PATH, "video_path": VIDEO_PATH if layout.cameras else None,
        "features": features,
    }


def write_mp4(path: Path, frames: Sequence[np.ndarray], gop: int) -> None:
    write_video(path, frames, FPS, gop=gop, crf=18)


def decoded_frames(path: Path) -> dict[float, np.ndarray]:
    """Every frame of an mp4 as PyAV decodes it from the start, by timestamp (seconds)."""
    import av

    with av.open(str(path)) as container:
        return {round(float(f.time), 6): f.to_ndarray(format="rgb24")
                for f in container.decode(container.streams.video[0])}


# -- what a sample must hold (LeRobot's own rule, written out) --------------------------------

def window(length: int, frame: int, offsets: Sequence[float]) -> tuple[list[int], list[bool]]:
    """LeRobot's rule: frame + round(o * fps), clamped into the episode; padded outside."""
    raw = [frame + round(o * FPS) for o in offsets]
    return [min(max(r, 0), length - 1) for r in raw], [not 0 <= r < length for r in raw]


def place(layout: Layout, name: str) -> tuple[int, int, int, float]:
    """Episode ``name``'s index, length, data/video file, and start time in that file."""
    ep = int(name.split("_")[1])
    file = ep // layout.per_file
    start_s = sum(layout.lengths[e] for e in range(file * layout.per_file, ep)) / FPS
    return ep, layout.lengths[ep], file, start_s


def videos(root: Path, layout: Layout) -> dict[tuple[str, int], dict[float, np.ndarray]]:
    """Every camera's decoded frames per video file, by timestamp."""
    files = range((len(layout.lengths) + layout.per_file - 1) // layout.per_file)
    return {(cam, f): decoded_frames(root / VIDEO_PATH.format(
        video_key=cam, chunk_index=0, file_index=f)) for cam in layout.cameras for f in files}
