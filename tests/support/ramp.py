"""Ramped test episodes: every stored value says where it came from.

- Numeric keys hold ramps, ``value[t, d] = t*1000 + d + offset``, with ``d`` the flat feature
  index and an offset that differs per (episode, key), so a row read from the wrong frame, key
  or episode shows up as a wrong number. All values are integers below 2**24 in magnitude, so
  they are exact in float32 (for t < 1000 and fewer than 1000 features).
- Camera frames are small uniform JPEGs whose decoded mean colour gives back the frame index t
  (exactly, for t < 1024) and the episode number (mod 32); see :func:`decode_frame_id`.
- Default annotations include overlapping spans, invalid spans (end <= start, negative start)
  and spans that end mid-episode, so the annotation cutoff matters.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg

MECKA_KEYS: dict[str, tuple[int, ...]] = {
    "left.obs_keypoints": (63,),
    "right.obs_keypoints": (63,),
    "left.obs_wrist_pose": (7,),
    "right.obs_wrist_pose": (7,),
    "obs_head_pose": (7,),
}
CAMERA_KEY = "images.front_1"
EMBODIMENT = "human_bimanual"

# One "slot" of 1e6 per (episode, key): t*1000 + d stays below 1e6 for t < 1000, d < 1000.
# Slots run from -16e6 upwards so that 6 episodes x 5 keys stay within float32's exact
# integer range (|x| <= 2**24 = 16_777_216); episode numbers repeat their slots mod 6.
_SLOT = 1_000_000
_FIRST_SLOT = -16 * _SLOT
_EPISODE_SLOTS = 6

# Frame colour code: each channel is a multiple of 8 plus 4, so JPEG error up to +-3 is harmless.
_STEP = 8
_HALF = 4

# (episode hash, episode number, total frames, fps) of the standard dataset.
RAMP_DATASET: tuple[tuple[str, int, int, int], ...] = (
    ("ep000a", 0, 37, 30),  # shorter than one 100-row chunk
    ("ep001b", 1, 100, 30),  # exactly one chunk
    ("ep002c", 2, 101, 15),  # one row past a chunk, and a different fps
    ("ep003d", 3, 257, 30),  # several chunks
)


def ramp_values(
    total_frames: int, feature: tuple[int, ...], dtype: Any = "float32", offset: float = 0
) -> np.ndarray:
    """Array of shape (total_frames, *feature) with ``value[t, d] = t*1000 + d + offset``."""
    size = int(np.prod(feature, dtype=np.int64))
    t = np.arange(total_frames, dtype=np.float64)[:, None]
    d = np.arange(size, dtype=np.float64)[None, :]
    values = t * 1000 + d + offset
    return values.reshape((total_frames, *feature)).astype(dtype)


def ramp_offset(episode_no: int, key: str) -> float:
    """The offset of MECKA key ``key`` in episode ``episode_no`` (distinct for episodes mod 6)."""
    key_no = list(MECKA_KEYS).index(key)
    slot = (episode_no % _EPISODE_SLOTS) * len(MECKA_KEYS) + key_no
    return float(_FIRST_SLOT + slot * _SLOT)


def ramp_row(episode_no: int, key: str, t: int) -> np.ndarray:
    """Row t of MECKA key ``key`` in episode ``episode_no``, as written by write_ramp_episode."""
    values = ramp_values(t + 1, MECKA_KEYS[key], offset=ramp_offset(episode_no, key))
    return np.array(values[t])


def frame_colour(episode_no: int, t: int) -> tuple[int, int, int]:
    """The RGB colour of frame t of episode ``episode_no`` (t mod 1024, episode mod 32)."""
    low, high, episode = t % 32, t // 32 % 32, episode_no % 32
    return (low * _STEP + _HALF, high * _STEP + _HALF, episode * _STEP + _HALF)


@functools.lru_cache(maxsize=8192)
def frame_jpeg(episode_no: int, t: int, *, width: int = 32, height: int = 24) -> bytes:
    """A uniform RGB JPEG (quality 95) coloured by :func:`frame_colour`."""
    rgb = np.empty((height, width, 3), dtype=np.uint8)
    rgb[...] = frame_colour(episode_no, t)
    return bytes(simplejpeg.encode_jpeg(rgb, quality=95, colorspace="RGB"))


def _mean_colour(rgb: np.ndarray) -> np.ndarray:
    """Mean colour as 0..255 floats, from HxWx3 uint8 or 3xHxW float in [0, 1]."""
    image = np.asarray(rgb)
    if image.ndim != 3:
        raise ValueError(f"expected an HxWx3 or 3xHxW image, got shape {image.shape!r}")
    if image.shape[-1] != 3 and image.shape[0] == 3:
        image = np.moveaxis(image, 0, -1)
    if image.shape[-1] != 3:
        raise ValueError(f"expected an HxWx3 or 3xHxW image, got shape {image.shape!r}")
    mean: np.ndarray = image.reshape(-1, 3).astype(np.float64).mean(axis=0)
    if np.issubdtype(image.dtype, np.floating):
        mean = mean * 255.0
    return mean


def decode_frame_id(rgb: np.ndarray) -> int:
    """Frame index t (mod 1024) of a decoded frame_jpeg image (HxWx3 uint8 or CHW float)."""
    r, g, _ = (int(np.rint((c - _HALF) / _STEP)) for c in _mean_colour(rgb))
    return g * 32 + r


def decode_frame_episode(rgb: np.ndarray) -> int:
    """Episode number (mod 32) of a decoded frame_jpeg image (HxWx3 uint8 or CHW float)."""
    blue = _mean_colour(rgb)[2]
    return int(np.rint((blue - _HALF) / _STEP))


def default_annotations(total_frames: int) -> list[dict[str, Any]]:
    """Spans for an episode of length T, listed in this order:

    - ``whole``   [0, T): contains every frame, listed first so it never decides a cutoff;
    - ``reach``   [0, T//3);
    - ``grasp``   [T//4, T//2): overlaps ``reach``, listed later, so it decides there;
    - ``backwards`` [T//2, T//4) and ``empty`` [10, 10): end <= start, ignored;
    - ``negative`` [-5, T//5): negative start, ignored;
    - ``place``   [2T//3, T-3): ends mid-episode;
    - ``tail``    [T-5, T+10): runs past the end (T bounds the chunk there).
    """
    t = total_frames
    spans = [
        ("whole", 0, t),
        ("reach", 0, t // 3),
        ("grasp", t // 4, t // 2),
        ("backwards", t // 2, t // 4),
        ("empty", 10, 10),
        ("negative", -5, t // 5),
        ("place", 2 * t // 3, t - 3),
        ("tail", t - 5, t + 10),
    ]
    return [{"text": text, "start_idx": start, "end_idx": end} for text, start, end in spans]


def write_ramp_episode(
    root: str | Path,
    episode_hash: str,
    *,
    episode_no: int,
    total_frames: int,
    fps: int = 30,
    layout: str = "sharded",
    annotations: Sequence[Mapping[str, Any]] | None = None,
    extra_numeric: Mapping[str, np.ndarray] | None = None,
    chunk_rows: int = 100,
    frame_size: tuple[int, int] = (24, 32),
) -> Path:
    """Write one ramped episode (MECKA keys, ``images.front_1`` frames of ``frame_size``
    (H, W), annotations); return its path."""
    # Imported here so that this module loads (for frame_jpeg, decode_frame_id) without the server.
    from episerve_tools.synth.writer import write_episode

    numeric: dict[str, np.ndarray] = {
        key: ramp_values(total_frames, feature, offset=ramp_offset(episode_no, key))
        for key, feature in MECKA_KEYS.items()
    }
    numeric.update(extra_numeric or {})
    height, width = frame_size
    jpeg = {CAMERA_KEY: [frame_jpeg(episode_no, t, width=width, height=height)
                         for t in range(total_frames)]}
    if annotations is None:
        annotations = default_annotations(total_frames)
    return write_episode(
        root,
        episode_hash,
        total_frames=total_frames,
        fps=fps,
        embodiment=EMBODIMENT,
        numeric=numeric,
        jpeg=jpeg,
        annotations=annotations,
        extra_attrs={"episode_no": episode_no, "task_name": "ramp"},
        layout=layout,  # type: ignore[arg-type]
        chunk_rows=chunk_rows,
    )


def write_ramp_dataset(root: str | Path, *, layout: str = "sharded") -> list[str]:
    """Write the standard ramped dataset (:data:`RAMP_DATASET`); return its hashes, sorted."""
    Path(root).mkdir(parents=True, exist_ok=True)
    for episode_hash, episode_no, total_frames, fps in RAMP_DATASET:
        write_ramp_episode(
            root,
            episode_hash,
            episode_no=episode_no,
            total_frames=total_frames,
            fps=fps,
            layout=layout,
        )
    return sorted(episode_hash for episode_hash, *_ in RAMP_DATASET)
