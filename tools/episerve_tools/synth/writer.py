"""Write episode stores in the layout of docs/FORMAT.md, for tests and benchmarks.

``write_episode`` writes one ``<episode_hash>.zarr`` group from in-memory arrays, in one of
three layouts: ``sharded`` (zarr v3, one shard per array, 100-row inner chunks), ``unsharded``
(zarr v3, plain chunks) and ``v2`` (zarr v2, numcodecs Zstd, vlen-bytes object codec).
``make_dataset`` fills a dataset root with synthetic human bimanual episodes from
:mod:`episerve_tools.synth.scene`, in parallel processes, deterministically per ``(seed, index)``.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal

import numcodecs
import numpy as np
import simplejpeg
import zarr
from tqdm import tqdm
from zarr.codecs import ZstdCodec
from zarr.errors import UnstableSpecificationWarning

from episerve_tools.synth.scene import synth_episode

Layout = Literal["sharded", "unsharded", "v2"]
LAYOUTS: tuple[Layout, ...] = ("sharded", "unsharded", "v2")
ZSTD_LEVEL = 3
EMBODIMENT = "human_bimanual"


def write_episode(
    root: str | Path,
    episode_hash: str,
    *,
    total_frames: int,
    fps: int,
    embodiment: str,
    numeric: Mapping[str, np.ndarray],
    jpeg: Mapping[str, Sequence[bytes]],
    annotations: Sequence[Mapping[str, Any]],
    extra_attrs: Mapping[str, Any] | None = None,
    layout: Literal["sharded", "unsharded", "v2"] = "sharded",
    chunk_rows: int = 100,
    numeric_pad: Literal["zeros", "edge"] = "zeros",
) -> Path:
    """Write one episode group and return its path, ``root / f"{episode_hash}.zarr"``.

    An existing folder of that name is replaced.  Numeric arrays are padded to a multiple
    of ``chunk_rows`` with zeros or with their last row; JPEG arrays repeat their last frame.
    """
    _validate(episode_hash, total_frames, numeric, jpeg, layout, chunk_rows, numeric_pad)
    path = Path(root) / f"{episode_hash}.zarr"
    if path.exists():
        shutil.rmtree(path)
    padded = math.ceil(total_frames / chunk_rows) * chunk_rows
    fmt: Literal[2, 3] = 2 if layout == "v2" else 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableSpecificationWarning)
        group = zarr.open_group(path, mode="w", zarr_format=fmt)
        for key, values in numeric.items():
            data = _pad_numeric(np.asarray(values), padded, numeric_pad)
            _write_numeric(group, key, data, layout, chunk_rows)
        for key, frames in jpeg.items():
            _write_bytes(group, key, _pad_frames(frames, padded), layout)
        encoded = [json.dumps(dict(a), separators=(",", ":")).encode() for a in annotations]
        _write_bytes(group, "annotations", encoded, layout)
        group.attrs.update(_group_attrs(total_frames, fps, embodiment, numeric, jpeg, extra_attrs))
    return path


def _validate(
    episode: str,
    total_frames: int,
    numeric: Mapping[str, np.ndarray],
    jpeg: Mapping[str, Sequence[bytes]],
    layout: str,
    chunk_rows: int,
    numeric_pad: str,
) -> None:
    if not episode or "/" in episode or "\\" in episode or episode in (".", ".."):
        raise ValueError(f"episode {episode!r}: expected a folder name, not a path")
    if layout not in LAYOUTS:
        raise ValueError(f"episode {episode!r}: layout {layout!r} is not one of {LAYOUTS}")
    if numeric_pad not in ("zeros", "edge"):
        raise ValueError(f"episode {episode!r}: numeric_pad {numeric_pad!r} is not zeros/edge")
    if chunk_rows < 1 or total_frames < 1:
        raise ValueError(
            f"episode {episode!r}: expected chunk_rows >= 1 and total_frames >= 1, "
            f"got chunk_rows={chunk_rows!r}, total_frames={total_frames!r}"
        )
    for key, values in numeric.items():
        shape, kind = np.shape(values), np.asarray(values).dtype.kind
        if kind not in "biuf":
            raise ValueError(
                f"episode {episode!r}, key {key!r}: expected a numeric dtype, "
                f"got {np.asarray(values).dtype!r}"
            )
        if not shape or shape[0] != total_frames:
            raise ValueError(
                f"episode {episode!r}, key {key!r}: expected {total_frames} rows "
                f"(total_frames), got shape {shape!r}"
            )
    for key, frames in jpeg.items():
        if len(frames) != total_frames:
            raise ValueError(
                f"episode {episode!r}, key {key!r}: expected {total_frames} JPEG frames "
                f"(total_frames), got {len(frames)!r}"
            )


def _pad_numeric(values: np.ndarray, padded: int, mode: str) -> np.ndarray:
    extra = padded - values.shape[0]
    if extra == 0:
        return values
    if mode == "edge":
        tail = np.repeat(values[-1:], extra, axis=0)
    else:
        tail = np.zeros((extra, *values.shape[1:]), dtype=values.dtype)
    return np.concatenate([values, tail])


def _pad_frames(frames: Sequence[bytes], padded: int) -> list[bytes]:
    out = [bytes(f) for f in frames]
    return out + [out[-1]] * (padded - len(out))


def _write_numeric(
    group: zarr.Group, key: str, data: np.ndarray, layout: str, chunk_rows: int
) -> None:
    chunks = (chunk_rows, *data.shape[1:])
    if layout == "v2":
        compressors: Any = numcodecs.Zstd(level=ZSTD_LEVEL)
    else:
        compressors = ZstdCodec(level=ZSTD_LEVEL)
    shards = data.shape if layout == "sharded" else None
    array = group.create_array(
        key, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards,
        compressors=compressors, fill_value=0,
    )
    array[...] = data


def _write_bytes(group: zarr.Group, key: str, items: Sequence[bytes], layout: str) -> None:
    """One element per chunk; sharded layouts put all elements in one shard."""
    n = len(items)
    shards = (max(n, 1),) if layout == "sharded" else None
    array = group.create_array(
        key, shape=(n,), dtype=zarr.dtype.VariableLengthBytes(), chunks=(1,), shards=shards,
        compressors=None,
    )
    if n:
        data = np.empty(n, dtype=object)
        data[:] = list(items)
        array[...] = data


def _group_attrs(
    total_frames: int,
    fps: int,
    embodiment: str,
    numeric: Mapping[str, np.ndarray],
    jpeg: Mapping[str, Sequence[bytes]],
    extra_attrs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    features: dict[str, Any] = {}
    for key, values in numeric.items():
        arr = np.asarray(values)
        shape = list(arr.shape[1:])
        names = feature_names(key, shape)
        features[key] = {"dtype": str(arr.dtype), "shape": shape, "names": names}
    for key, frames in jpeg.items():
        height, width, _, _ = simplejpeg.decode_jpeg_header(frames[0])
        features[key] = {"dtype": "jpeg", "shape": [int(height), int(width), 3]}
    features["annotations"] = {"dtype": "json"}
    attrs: dict[str, Any] = {
        "total_frames": int(total_frames),
        "fps": int(fps),
        "embodiment": str(embodiment),
        "features": features,
    }
    attrs.update(extra_attrs or {})
    return attrs


def feature_names(key: str, shape: Sequence[int]) -> list[str]:
    """Per-column names for a numeric key: keypoints, poses, else ``x0, x1, ...``."""
    size = math.prod(shape)
    if key.endswith("keypoints") and size % 3 == 0:
        return [f"p{i}_{axis}" for i in range(size // 3) for axis in "xyz"]
    if key.endswith("pose") and size == 7:
        return ["x", "y", "z", "qw", "qx", "qy", "qz"]
    return [f"x{i}" for i in range(size)]


def episode_hash(seed: int, index: int) -> str:
    """A deterministic 16-hex-char episode name for episode ``index`` of dataset ``seed``."""
    return hashlib.sha256(f"episerve-synth:{seed}:{index}".encode()).hexdigest()[:16]


def make_dataset(
    out: str | Path,
    *,
    episodes: int,
    seed: int = 0,
    min_frames: int = 120,
    max_frames: int = 700,
    fps: int = 30,
    layout: Layout = "sharded",
    progress: bool = True,
    workers: int | None = None,
) -> list[Path]:
    """Write ``episodes`` synthetic human bimanual episodes under ``out``; return their paths.

    Episode ``i`` depends only on ``(seed, i)``, so the output is the same for any
    ``workers``.  Episodes already in ``out`` with the same names are overwritten.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if not 1 <= min_frames <= max_frames:
        raise ValueError(f"expected 1 <= min_frames <= max_frames, got {min_frames}, {max_frames}")
    Path(out).mkdir(parents=True, exist_ok=True)
    jobs = [(str(out), seed, i, min_frames, max_frames, fps, layout) for i in range(episodes)]
    workers = min(os.cpu_count() or 1, episodes) if workers is None else workers
    with tqdm(total=episodes, unit="episode", disable=not progress, desc="writing") as bar:
        if workers <= 1:
            return [_tick(bar, _write_synth(*job)) for job in jobs]
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
            futures = [pool.submit(_write_synth, *job) for job in jobs]
            for done in as_completed(futures):
                _tick(bar, done.result())
            return [f.result() for f in futures]


def _tick(bar: tqdm[Any], path: Path) -> Path:
    bar.update(1)
    return path


def _write_synth(
    out: str, seed: int, index: int, min_frames: int, max_frames: int, fps: int, layout: Layout
) -> Path:
    """Synthesise and write episode ``index``; a top-level function, so spawn can pickle it."""
    rng = np.random.default_rng([seed, index])
    total = int(rng.integers(min_frames, max_frames + 1))
    ep = synth_episode(rng, total, fps=fps)
    return write_episode(
        out, episode_hash(seed, index), total_frames=total, fps=fps, embodiment=EMBODIMENT,
        numeric=ep.numeric, jpeg=ep.jpeg, annotations=ep.annotations,
        extra_attrs=ep.extra_attrs, layout=layout,
    )
