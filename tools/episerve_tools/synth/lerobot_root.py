"""Write the synthetic episodes as a LeRobot v3.0 root (``episerve make-dataset --layout
lerobot``), laid out as LeRobot's own writer lays it out, so the LeRobot examples of the docs
run on data this project makes:

- ``meta/info.json`` (features, fps, paths), ``meta/tasks.parquet``,
  ``meta/episodes/chunk-000/file-000.parquet`` (per episode: length, tasks, where its rows
  and video frames are);
- ``data/chunk-000/file-000.parquet``: every episode's rows, one after another;
- ``videos/observation.images.top/chunk-000/file-000.mp4``: every episode's frames, one after
  another (each episode's ``from_timestamp`` is where it starts), H.264 with a keyframe every
  2 frames, as LeRobot encodes (LeRobot's default codec is AV1; H.264 encodes in seconds).

Episode ``i`` is the same scene and motion as episode ``i`` of the zarr layouts for the same
``seed``: ``observation.state`` is the two wrist poses (14 floats), ``action`` the next frame's
(the last frame repeats its own), and the task is the episode's description.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from episerve_tools.synth.scene import CAMERA_KEY, synth_episode

CAMERA = "observation.images.top"
STATE_KEYS = ("left.obs_wrist_pose", "right.obs_wrist_pose")
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
#: LeRobot's encoder settings: a keyframe every 2 frames, no B-frames, yuv420p.
GOP = 2
CRF = 30


def write_lerobot_root(out: str | Path, *, episodes: int, seed: int = 0,
                       min_frames: int = 120, max_frames: int = 700, fps: int = 30,
                       progress: bool = True) -> Path:
    """Write ``episodes`` synthetic episodes as a LeRobot v3.0 root at ``out`` (replacing
    the root's files of the same names); returns ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    root = Path(out)
    rows: dict[str, list[Any]] = {k: [] for k in (
        "observation.state", "action", "timestamp", "frame_index", "episode_index", "index",
        "task_index")}
    tasks: dict[str, int] = {}
    meta: list[dict[str, Any]] = []
    frames: list[bytes] = []
    start_s, index = 0.0, 0
    for ep in tqdm(range(episodes), unit="episode", desc="writing", disable=not progress):
        rng = np.random.default_rng([seed, ep])
        total = int(rng.integers(min_frames, max_frames + 1))
        synth = synth_episode(rng, total, fps=fps)
        task = str(synth.extra_attrs["task_description"])
        task_index = tasks.setdefault(task, len(tasks))
        state = np.concatenate([synth.numeric[k] for k in STATE_KEYS], axis=1)
        action = np.concatenate([state[1:], state[-1:]])
        for t in range(total):
            rows["observation.state"].append(state[t].tolist())
            rows["action"].append(action[t].tolist())
            rows["timestamp"].append(t / fps)
            rows["frame_index"].append(t)
            rows["episode_index"].append(ep)
            rows["index"].append(index + t)
            rows["task_index"].append(task_index)
        frames += synth.jpeg[CAMERA_KEY]
        meta.append({
            "episode_index": ep, "length": total, "tasks": [task],
            "data/chunk_index": 0, "data/file_index": 0,
            "dataset_from_index": index, "dataset_to_index": index + total,
            f"videos/{CAMERA}/chunk_index": 0, f"videos/{CAMERA}/file_index": 0,
            f"videos/{CAMERA}/from_timestamp": start_s,
            f"videos/{CAMERA}/to_timestamp": start_s + total / fps,
        })
        start_s += total / fps
        index += total
    import simplejpeg

    size = write_mp4(root / VIDEO_PATH.format(video_key=CAMERA, chunk_index=0, file_index=0),
                     (simplejpeg.decode_jpeg(j, colorspace="RGB") for j in frames), fps)
    data = root / DATA_PATH.format(chunk_index=0, file_index=0)
    data.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "observation.state": pa.array(rows["observation.state"], pa.list_(pa.float32())),
        "action": pa.array(rows["action"], pa.list_(pa.float32())),
        "timestamp": pa.array(rows["timestamp"], pa.float32()),
        "frame_index": pa.array(rows["frame_index"], pa.int64()),
        "episode_index": pa.array(rows["episode_index"], pa.int64()),
        "index": pa.array(rows["index"], pa.int64()),
        "task_index": pa.array(rows["task_index"], pa.int64()),
    }), data)
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(meta),
                   root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(_tasks_table(tasks), root / "meta" / "tasks.parquet")
    info = _info(episodes, index, len(tasks), fps, size)
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    return root


def _tasks_table(tasks: dict[str, int]) -> Any:
    """``meta/tasks.parquet`` as LeRobot writes it from pandas: the task text is the frame's
    index (``LeRobotDataset`` reads a row's task as that index's label), ``task_index`` the
    one column; the pandas metadata says so, written here without needing pandas."""
    import pyarrow as pa

    table = pa.table({"task_index": pa.array(list(tasks.values()), pa.int64()),
                      "task": pa.array(list(tasks), pa.string())})
    column = {"pandas_type": "unicode", "numpy_type": "object", "metadata": None}
    pandas = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                            "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
        "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                     "numpy_type": "int64", "metadata": None},
                    {"name": "task", "field_name": "task", **column}],
        "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.3.3",
    }
    return table.replace_schema_metadata({"pandas": json.dumps(pandas)})


def write_mp4(path: Path, frames: Iterable[np.ndarray], fps: int, *, gop: int = GOP,
              crf: int = CRF) -> tuple[int, int]:
    """RGB frames (H, W, 3 uint8) into one H.264 file at ``fps``, a keyframe every ``gop``
    frames and no B-frames; returns (height, width)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    size = (0, 0)
    with av.open(str(path), "w") as out:
        stream = None
        for k, rgb in enumerate(frames):
            if stream is None:
                size = rgb.shape[:2]
                stream = out.add_stream("libx264", rate=fps)
                stream.height, stream.width = size
                stream.pix_fmt = "yuv420p"
                stream.options = {"g": str(gop), "bf": "0", "crf": str(crf)}
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = k, Fraction(1, fps)
            out.mux(stream.encode(frame))
        if stream is not None:
            out.mux(stream.encode(None))
    return size


def _info(episodes: int, frames: int, tasks: int, fps: int,
          size: tuple[int, int]) -> dict[str, Any]:
    h, w = size
    scalar = {"shape": [1], "names": None}
    return {
        "codebase_version": "v3.0", "robot_type": "human_bimanual",
        "total_episodes": episodes, "total_frames": frames, "total_tasks": tasks,
        "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 500,
        "fps": fps, "splits": {"train": f"0:{episodes}"},
        "data_path": DATA_PATH, "video_path": VIDEO_PATH,
        "features": {
            "observation.state": {"dtype": "float32", "shape": [14], "names": None},
            "action": {"dtype": "float32", "shape": [14], "names": None},
            CAMERA: {"dtype": "video", "shape": [h, w, 3],
                     "names": ["height", "width", "channels"],
                     "info": {"video.height": h, "video.width": w, "video.codec": "h264",
                              "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                              "video.fps": fps, "video.channels": 3, "has_audio": False}},
            "timestamp": {"dtype": "float32", **scalar},
            "frame_index": {"dtype": "int64", **scalar},
            "episode_index": {"dtype": "int64", **scalar},
            "index": {"dtype": "int64", **scalar},
            "task_index": {"dtype": "int64", **scalar},
        },
    }
