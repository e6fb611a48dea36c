"""A LeRobot dataset's metadata, parsed and checked before anything is served: v3
(``meta/info.json``, ``meta/episodes/*/*.parquet``, ``meta/tasks.parquet``) and v2.1 / v2.0
(``meta/info.json``, ``meta/episodes.jsonl``, ``meta/tasks.jsonl``; one data file and one
video per episode).

Everything here comes from files nobody vetted, so every value is checked against a bound
before it sizes anything, and every path is built from integers through a template that may
name only ``chunk_index``, ``file_index`` and ``video_key`` (v3) or ``episode_chunk``,
``episode_index`` and ``video_key`` (v2), then refused if it is absolute or climbs out of the
root (the confined store refuses links leaving it when it opens the file).
An episode whose metadata is inconsistent is kept with its reason, as the catalog keeps a
broken zarr episode; only a dataset whose ``info.json`` cannot be read is refused whole.
"""

from __future__ import annotations

import json
import math
import posixpath
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from episerve_proto.contract import MAX_EPISODE_FRAMES
from episerve_server.storage.listed_once import episode_name
from episerve_server.storage.readers.bounds import (
    MAX_FEATURE_ELEMENTS,
    MAX_FPS,
    MAX_ROWS,
    MIN_FPS,
)

INFO_PATH = "meta/info.json"
EPISODES_DIR = "meta/episodes"
TASKS_PATH = "meta/tasks.parquet"
#: v2.1 and v2.0: one JSON object a line.
EPISODES_JSONL = "meta/episodes.jsonl"
TASKS_JSONL = "meta/tasks.jsonl"
#: The most bytes ``episodes.jsonl`` or ``tasks.jsonl`` may hold (read whole).
MAX_JSONL_BYTES = 256 << 20
MAX_JSONL_LINE = 1 << 20
#: The most episodes, tasks and files one dataset may list.
MAX_EPISODES = 1 << 20
MAX_TASKS = 1 << 20
MAX_FILES = 1 << 16
MAX_TASK_BYTES = 64 << 10  # one task's text, UTF-8
MAX_PATH_CHARS = 1024
#: LeRobot's default ``tolerance_s``: a frame is served when a decoded frame's timestamp is
#: strictly closer than this to the one asked for.
DEFAULT_TOLERANCE_S = 1e-4
NUMERIC_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                            "uint8", "uint16", "uint32", "uint64", "bool"})
_FIELDS = frozenset({"chunk_index", "file_index", "video_key"})
_V2_FIELDS = frozenset({"episode_chunk", "episode_index", "video_key"})
#: The bounds of the numeric fields of ``info.json`` (low, high, whether an int).
_NUMBER_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "fps": (MIN_FPS, MAX_FPS, False),
    "video.fps": (MIN_FPS, MAX_FPS, False),
    "total_episodes": (0, MAX_EPISODES, True),
    "total_frames": (0, MAX_ROWS * 64, True),
    "total_tasks": (0, MAX_TASKS, True),
    "total_videos": (0, MAX_EPISODES * 64, True),
    "total_chunks": (0, MAX_FILES, True),
    "chunks_size": (1, MAX_ROWS * 64, True),
    "data_files_size_in_mb": (0, 1 << 20, False),
    "video_files_size_in_mb": (0, 1 << 20, False),
    "video.height": (1, 1 << 16, True),
    "video.width": (1, 1 << 16, True),
    "video.channels": (1, 4, True),
}


class MetaError(ValueError):
    """The dataset's metadata cannot be served; the message names the file and the value."""


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    kind: str  # "numeric" or "video"
    shape: tuple[int, ...]  # numeric: per row; video: (H, W, 3)
    dtype: str


@dataclass(frozen=True, slots=True)
class VideoSpan:
    path: str  # under the root
    from_s: float  # the episode's first frame in the file


@dataclass(frozen=True, slots=True)
class EpisodeMeta:
    index: int
    length: int
    data_path: str
    from_index: int  # global row of the episode's first frame
    videos: tuple[tuple[str, VideoSpan], ...]

    @property
    def name(self) -> str:
        return episode_name(self.index)


@dataclass(frozen=True, slots=True)
class Info:
    fps: float
    robot_type: str
    features: Mapping[str, Feature]
    data_path: str  # template
    video_path: str  # template ("" when there are no videos)
    raw_features: Mapping[str, Any]  # as listed (for ``features`` attributes)
    version: str = "v3.0"  # codebase_version: "v3.x", "v2.1" or "v2.0"
    chunks_size: int = 1000  # v2: episodes a chunk folder holds

    @property
    def v2(self) -> bool:
        """A v2.x layout: one data file and one video per episode, JSON-lines metadata."""
        return self.version.startswith("v2.")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} chars)"


def parse_info(data: bytes) -> Info:
    """``meta/info.json``; ``MetaError`` names the field and the value when it cannot be
    served (a version other than v2.0, v2.1 and v3.x, no fps, bad templates)."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise MetaError(f"{INFO_PATH} is not JSON ({type(exc).__name__})") from exc
    if not isinstance(doc, dict):
        raise MetaError(f"{INFO_PATH} must be a JSON object, got {type(doc).__name__}")
    version = doc.get("codebase_version")
    if not isinstance(version, str) or not (version.startswith("v3.")
                                            or version in ("v2.0", "v2.1")):
        raise MetaError(f"{INFO_PATH}: 'codebase_version' must be v2.0, v2.1 or a LeRobot "
                        f"v3.x version, got {_shown(version)}")
    fields = _V2_FIELDS if version.startswith("v2.") else _FIELDS
    fps = doc.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) \
            or not MIN_FPS <= fps <= MAX_FPS:
        raise MetaError(f"{INFO_PATH}: 'fps' must be a number in [{MIN_FPS}, {MAX_FPS}], got "
                        f"{_shown(fps)}")
    _check_numbers(doc)
    robot = doc.get("robot_type") or ""
    raw = doc.get("features")
    if not isinstance(raw, dict) or len(raw) > 4096:
        raise MetaError(f"{INFO_PATH}: 'features' must be a mapping of at most 4096 features, "
                        f"got {_shown(raw)}")
    features = {}
    for name, spec in raw.items():
        feature = _feature(name, spec)
        if feature is not None:
            features[name] = feature
    data_path = _template(doc.get("data_path"), "data_path", fields)
    videos = any(f.kind == "video" for f in features.values())
    video_path = _template(doc.get("video_path"), "video_path", fields) if videos else ""
    chunks = doc.get("chunks_size", 1000)
    return Info(float(fps), str(robot)[:200], features, data_path, video_path, raw,
                version, chunks if isinstance(chunks, int) and chunks > 0 else 1000)


def _check_numbers(doc: Mapping[str, Any]) -> None:
    """Every number of ``info.json`` at the top level and in the features' ``info`` within
    its field's bounds (unknown fields: finite and at most 2**53 in size), so no value a
    later version might use sizes or divides anything it should not."""
    places: list[tuple[str, Mapping[str, Any]]] = [("", doc)]
    features = doc.get("features")
    if isinstance(features, dict):
        places += [(f"features.{name}.info.", spec["info"]) for name, spec in features.items()
                   if isinstance(spec, dict) and isinstance(spec.get("info"), dict)]
    for prefix, fields in places:
        for key, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            low, high, integer = _NUMBER_BOUNDS.get(str(key), (-2.0**53, 2.0**53, False))
            if not math.isfinite(value) or not low <= value <= high \
                    or (integer and not isinstance(value, int)):
                kind = "an int" if integer else "a number"
                raise MetaError(f"{INFO_PATH}: {prefix + str(key)!r} must be {kind} in "
                                f"[{low:g}, {high:g}], got {_shown(value)}")


def _feature(name: object, spec: object) -> Feature | None:
    """A servable feature, or None for those not served (strings, images in parquet)."""
    if not isinstance(name, str) or not name or len(name) > 200 or "/" in name:
        raise MetaError(f"{INFO_PATH}: feature name {_shown(name)} must be a plain string")
    if not isinstance(spec, dict):
        raise MetaError(f"{INFO_PATH}: feature {name!r} is not an object of dtype and shape "
                        f"({_shown(spec)})")
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if dtype not in NUMERIC_DTYPES and dtype != "video":
        return None
    if not isinstance(shape, list) or not shape or len(shape) > 4 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise MetaError(f"{INFO_PATH}: feature {name!r} has shape {_shown(shape)}, expected "
                        "a list of 1 to 4 positive ints")
    if dtype == "video":
        hwc = _video_shape(name, shape, spec.get("names"))
        return Feature(name, "video", hwc, "uint8")
    if math.prod(shape) > MAX_FEATURE_ELEMENTS:
        raise MetaError(f"{INFO_PATH}: feature {name!r} has shape {shape!r}, more than "
                        f"{MAX_FEATURE_ELEMENTS} values per frame")
    return Feature(name, "numeric", tuple(shape), str(dtype))


def _video_shape(name: str, shape: list[int], names: object) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise MetaError(f"{INFO_PATH}: video feature {name!r} has shape {shape!r}, expected "
                        "[height, width, 3]")
    order = list(names) if isinstance(names, list) else []
    if order[:1] == ["channels"]:  # [C, H, W]
        shape = [shape[1], shape[2], shape[0]]
    h, w, c = shape
    if c != 3 or h * w > 2**25:
        raise MetaError(f"{INFO_PATH}: video feature {name!r} has shape {shape!r}, expected "
                        "[height, width, 3] of at most 2**25 pixels")
    return h, w, c


def _template(value: object, field: str, fields: frozenset[str] = _FIELDS) -> str:
    """A path template that names only ``fields``, with integer format specs."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PATH_CHARS:
        raise MetaError(f"{INFO_PATH}: {field!r} must be a path template, got {_shown(value)}")
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise MetaError(f"{INFO_PATH}: {field!r} {value!r} is not a template ({exc})") from exc
    for _, name, given, conversion in parts:
        if name is None:
            continue
        spec = given or ""
        int_spec = spec == "" or (spec.endswith("d") and spec[:-1].isdigit()
                                  and len(spec) <= 3)
        if name not in fields or conversion is not None \
                or not (int_spec if name != "video_key" else spec == ""):
            ints = " and ".join(sorted(fields - {"video_key"}))
            raise MetaError(f"{INFO_PATH}: {field!r} {value!r} may name only {ints} (as "
                            f"ints) and video_key, got {{{name}}}")
    return value


def fill(template: str, *, chunk: int, file: int, video_key: str = "") -> str:
    """A file's path under the root; ``MetaError`` if it is absolute or leaves the root."""
    path = template.format(chunk_index=chunk, file_index=file, video_key=video_key)
    return safe_path(path)


def fill_v2(template: str, info: Info, episode: int, video_key: str = "") -> str:
    """A v2 episode's data or video path under the root (its chunk: index // chunks_size)."""
    path = template.format(episode_chunk=episode // info.chunks_size, episode_index=episode,
                           video_key=video_key)
    return safe_path(path)


def episode_of_v2(row: object, info: Info, from_index: int) -> EpisodeMeta:
    """One line of ``meta/episodes.jsonl`` (its frames start at global row ``from_index``);
    ``MetaError`` names the field and the value."""
    if not isinstance(row, dict):
        raise MetaError(f"a line is {_shown(row)}, not an object")
    index = index_of(row.get("episode_index"), "'episode_index'", MAX_EPISODES * 16)
    length = _length(row.get("length"))
    videos = tuple((name, VideoSpan(fill_v2(info.video_path, info, index, name), 0.0))
                   for name, feature in info.features.items() if feature.kind == "video")
    return EpisodeMeta(index, length, fill_v2(info.data_path, info, index), from_index, videos)


def safe_path(path: str) -> str:
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or "\0" in path or len(path) > MAX_PATH_CHARS \
            or any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path:
        raise MetaError(f"path {path!r} is not a plain relative path under the root")
    return path


def index_of(value: object, what: str, top: int = MAX_ROWS * 64) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise MetaError(f"{what} must be an int in [0, {top}], got {_shown(value)}")
    return value


def seconds_of(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 <= value <= 1e9:
        raise MetaError(f"{what} must be a finite time in seconds >= 0, got {_shown(value)}")
    return float(value)


def _length(length: object) -> int:
    if isinstance(length, bool) or not isinstance(length, int) \
            or not 0 < length <= min(MAX_ROWS, MAX_EPISODE_FRAMES):
        raise MetaError(f"'length' must be a positive int of at most {MAX_ROWS}, got "
                        f"{_shown(length)}")
    return length


def episode_of(row: Mapping[str, Any], info: Info) -> EpisodeMeta:
    """One row of ``meta/episodes``; ``MetaError`` names the column and the value."""
    index = index_of(row.get("episode_index"), "'episode_index'", MAX_EPISODES * 16)
    length = _length(row.get("length"))
    start = index_of(row.get("dataset_from_index"), "'dataset_from_index'")
    stop = index_of(row.get("dataset_to_index"), "'dataset_to_index'")
    if stop - start != length:
        raise MetaError(f"'dataset_to_index' - 'dataset_from_index' is {stop} - {start} = "
                        f"{stop - start}, but 'length' is {length}")
    data = fill(info.data_path,
                chunk=index_of(row.get("data/chunk_index"), "'data/chunk_index'", MAX_FILES),
                file=index_of(row.get("data/file_index"), "'data/file_index'", MAX_FILES))
    videos = []
    for name, feature in info.features.items():
        if feature.kind != "video":
            continue
        col = f"videos/{name}/"
        path = fill(info.video_path, video_key=name,
                    chunk=index_of(row.get(col + "chunk_index"), repr(col + "chunk_index"),
                                   MAX_FILES),
                    file=index_of(row.get(col + "file_index"), repr(col + "file_index"),
                                  MAX_FILES))
        videos.append((name, VideoSpan(path, seconds_of(row.get(col + "from_timestamp"),
                                                        repr(col + "from_timestamp")))))
    return EpisodeMeta(index, length, data, start, tuple(videos))


def episode_columns(info: Info) -> list[str]:
    cols = ["episode_index", "length", "dataset_from_index", "dataset_to_index",
            "data/chunk_index", "data/file_index"]
    for name, feature in info.features.items():
        if feature.kind == "video":
            cols += [f"videos/{name}/{c}" for c in ("chunk_index", "file_index",
                                                      "from_timestamp")]
    return cols


def file_offsets(episodes: Sequence[EpisodeMeta]) -> dict[str, int]:
    """Each data file's first global row: the first row of its first episode (LeRobot
    writes a file's episodes one after the other)."""
    first: dict[str, int] = {}
    for e in episodes:
        first[e.data_path] = min(first.get(e.data_path, e.from_index), e.from_index)
    return first
