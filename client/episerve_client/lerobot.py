"""LeRobot-style window descriptions as keymaps (keymap rule 6, ``offsets_s``).

LeRobot describes the frames of a sample with ``delta_timestamps``: per feature, a list of
offsets in seconds from the sample's frame. The same list is an ``offsets_s`` keymap entry;
with ``masks="all"`` each such output also gets ``<name>_is_pad``, LeRobot's name and polarity.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from episerve_client.errors import KeymapError, surfaced
from episerve_client.keystats import KeyStats
from episerve_proto.contract import (
    ACTION_KEYS,
    ANNOTATION_KEYS,
    CAMERA_KEYS,
    PROPRIO_KEYS,
    did_you_mean,
)
from episerve_proto.errors import shown
from episerve_proto.keyspec import checked_entry

__all__ = ["keymap_from_delta_timestamps", "keymap_from_lerobot", "lerobot_stats"]

#: Numeric dtypes of LeRobot features the daemon serves (strings and images are not).
_NUMERIC = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                      "uint8", "uint16", "uint32", "uint64", "bool"})
#: The key under which the daemon serves a LeRobot episode's task texts.
TASK_KEY = "task"
#: LeRobot's own bookkeeping columns: left out unless ``features`` names them (each sample
#: already carries ``frame_index`` and ``episode_hash``, names a keymap may not take).
BOOKKEEPING = frozenset({"timestamp", "frame_index", "episode_index", "index", "task_index"})
_MAX_INFO_BYTES = 1 << 20
#: LeRobot's default ``tolerance_s``: how far an offset may be from the frame grid.
DEFAULT_TOLERANCE_S = 1e-4


@surfaced
def keymap_from_delta_timestamps(
    delta_timestamps: Mapping[str, Sequence[float]],
    keys: Mapping[str, tuple[str, str]],
    *,
    fps: float | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> dict[str, dict[str, Any]]:
    """A keymap from a LeRobot ``delta_timestamps`` dict.

    ``keys`` maps every output name to its ``(zarr_key, key_type)``. A name with a list in
    ``delta_timestamps`` becomes an ``offsets_s`` window, shape (len(offsets), *feature); a
    name without one is the sample's own frame, as in LeRobot. With ``fps`` (the episodes'
    rate), an offset more than ``tolerance_s`` off that frame grid is refused, as
    ``LeRobotDataset`` refuses it; without, each episode's reads round offsets to its
    nearest frame (``round(o * fps)``, ties to even), and clamp them into the episode.
    Each entry is checked as the daemon checks it (finite offsets, at most 3600 s, at most
    4096 per key), and an error names the output key.

    >>> keymap_from_delta_timestamps(
    ...     {"action": [0.0, 0.1]},
    ...     {"action": ("left.obs_wrist_pose", "action_keys"),
    ...      "observation.state": ("obs_head_pose", "proprio_keys")})["action"]
    {'zarr_key': 'left.obs_wrist_pose', 'key_type': 'action_keys', 'offsets_s': [0.0, 0.1]}
    """
    for name in delta_timestamps:
        if name not in keys:
            raise KeymapError(
                f"delta_timestamps names {shown(name)}, which is not in keys"
                f"{did_you_mean(str(name), list(keys))}; keys must give its (zarr_key, "
                f"key_type)")
    if fps is not None:
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
            raise KeymapError(f"fps must be a positive number of frames a second, got "
                              f"{shown(fps)}")
        check_tolerance(delta_timestamps, float(fps), tolerance_s)
    out: dict[str, dict[str, Any]] = {}
    for name, pair in keys.items():
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2 \
                or not all(isinstance(p, str) for p in pair):
            raise KeymapError(
                f"keys[{shown(name)}] must be a (zarr_key, key_type) pair of strings, "
                f"got {shown(pair)}")
        zarr_key, key_type = pair
        entry: dict[str, Any] = {"zarr_key": zarr_key, "key_type": key_type}
        if name in delta_timestamps:
            entry["offsets_s"] = _offsets(str(name), entry, delta_timestamps[name])
        out[str(name)] = entry
    return out


def _offsets(name: str, entry: dict[str, Any], value: Any) -> list[float]:
    """``value`` as the entry's ``offsets_s``, checked by the keymap's own entry check (so
    an error reads as it would from the daemon, naming the output key and the offset)."""
    if hasattr(value, "tolist"):  # a numpy array or a tensor
        value = value.tolist()
    fields = checked_entry(name, {**entry, "offsets_s": list(value) if isinstance(
        value, tuple) else value})
    return list(fields.offsets_s or ())


@surfaced
def keymap_from_lerobot(
    root_or_info: str | os.PathLike[str] | Mapping[str, Any],
    delta_timestamps: Mapping[str, Sequence[float]] | None = None,
    *,
    features: Iterable[str] | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> dict[str, dict[str, Any]]:
    """The keymap of a LeRobot v3 dataset, from its own ``meta/info.json``.

    ``root_or_info`` is the dataset's root folder or its parsed ``info.json``;
    ``delta_timestamps`` is the dict given to ``LeRobotDataset``, checked by its rule: an
    offset more than ``tolerance_s`` off the dataset's frame grid (``info.json``'s
    ``fps``) is refused, naming the key and the offset. Every output is named as
    the feature is, as ``LeRobotDataset.__getitem__`` names it: video features are
    ``camera_keys``, features whose name starts with ``action`` are ``action_keys``, every
    other numeric feature is ``proprio_keys``, and ``task`` is the task text
    (``annotation_keys``). ``features`` limits the outputs to those named (default: every
    numeric and video feature but LeRobot's bookkeeping columns ``BOOKKEEPING``, and
    ``task``).

    >>> km = keymap_from_lerobot(
    ...     {"fps": 10, "features": {"action": {"dtype": "float32", "shape": [2]},
    ...                              "observation.images.top": {"dtype": "video",
    ...                                                         "shape": [48, 64, 3]}}},
    ...     {"action": [0.0, 0.1]})
    >>> km["action"], km["observation.images.top"]["key_type"], km["task"]["key_type"]
    ({'zarr_key': 'action', 'key_type': 'action_keys', 'offsets_s': [0.0, 0.1]}, \
'camera_keys', 'annotation_keys')
    """
    info = _info(root_or_info)
    declared = info.get("features")
    if not isinstance(declared, Mapping):
        raise KeymapError(f"the dataset's info.json has no 'features' mapping, got "
                          f"{shown(declared)}")
    keys: dict[str, tuple[str, str]] = {}
    for name, spec in declared.items():
        dtype = spec.get("dtype") if isinstance(spec, Mapping) else None
        if dtype == "video":
            keys[name] = (name, CAMERA_KEYS)
        elif dtype in _NUMERIC:
            keys[name] = (name, ACTION_KEYS if name.startswith("action") else PROPRIO_KEYS)
    keys[TASK_KEY] = (TASK_KEY, ANNOTATION_KEYS)
    if features is None:
        keys = {n: k for n, k in keys.items() if n not in BOOKKEEPING}
    else:
        wanted = list(features)
        for name in wanted:
            if name not in keys:
                raise KeymapError(f"features names {shown(name)}, which the dataset does not "
                                  f"serve{did_you_mean(str(name), list(keys))}")
        keys = {n: keys[n] for n in wanted}
    delta = dict(delta_timestamps or {})
    if TASK_KEY in delta:
        raise KeymapError("delta_timestamps may not window 'task' (a text at the frame)",
                          key=TASK_KEY)
    for name in delta:
        if name not in keys:
            raise KeymapError(
                f"delta_timestamps names {shown(name)}, which is not among the outputs"
                f"{did_you_mean(str(name), list(keys))}: "
                + ("features= leaves it out" if features is not None and name in declared
                   else "the dataset's info.json declares no numeric or video feature of "
                   "that name"), key=str(name)[:200])
    if not delta:
        return keymap_from_delta_timestamps(delta, keys)
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
        raise KeymapError(f"the dataset's info.json has no positive 'fps' (got {shown(fps)}), "
                          "so delta_timestamps cannot be put on its frame grid")
    return keymap_from_delta_timestamps(delta, keys, fps=float(fps), tolerance_s=tolerance_s)


def check_tolerance(delta: Mapping[str, Sequence[float]], fps: float,
                    tolerance_s: float) -> None:
    """LeRobot's rule: each offset must be within ``tolerance_s`` of a multiple of 1/fps."""
    if isinstance(tolerance_s, bool) or not isinstance(tolerance_s, int | float) \
            or not tolerance_s >= 0:
        raise KeymapError(f"tolerance_s must be a number of seconds >= 0, got "
                          f"{shown(tolerance_s)}")
    for key, offsets in delta.items():
        if hasattr(offsets, "tolist"):
            offsets = offsets.tolist()
        if isinstance(offsets, str) or not isinstance(offsets, Sequence):
            continue  # the entry's own check names what is wrong with it
        off = [o for o in offsets if isinstance(o, int | float) and (
            not math.isfinite(o * fps) or abs(o * fps - round(o * fps)) / fps > tolerance_s)]
        if off:
            raise KeymapError(
                f"delta_timestamps[{key!r}]: offsets {off!r} are more than tolerance_s="
                f"{tolerance_s!r} from the {fps:g} fps frame grid (multiples of {1 / fps:.6g} "
                "s); LeRobotDataset refuses them too", key=str(key))


def _info(root_or_info: str | os.PathLike[str] | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(root_or_info, Mapping):
        return root_or_info
    path = Path(root_or_info) / "meta" / "info.json"
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_INFO_BYTES + 1)
    except OSError as exc:
        raise KeymapError(f"cannot read {str(path)!r}: {exc}") from exc
    if len(data) > _MAX_INFO_BYTES:
        raise KeymapError(f"{str(path)!r} is over {_MAX_INFO_BYTES} bytes")
    try:
        info = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise KeymapError(f"{str(path)!r} is not JSON ({type(exc).__name__})") from exc
    if not isinstance(info, Mapping):
        raise KeymapError(f"{str(path)!r} must hold a JSON object, got {shown(info)}")
    return info


def lerobot_stats(stats: Mapping[str, KeyStats]) -> dict[str, dict[str, list[Any]]]:
    """The daemon's statistics (``WindowDataset.stats()``) in the shape of a LeRobot
    dataset's ``meta/stats.json``: per feature, ``min``, ``max``, ``mean``, ``std``
    (population), ``q01`` and ``q99`` as nested lists of the feature's shape, and ``count``
    as ``[rows]``. Video features have no statistics here."""
    out: dict[str, dict[str, list[Any]]] = {}
    for name, s in stats.items():
        out[name] = {"min": s.min.tolist(), "max": s.max.tolist(), "mean": s.mean.tolist(),
                     "std": s.std.tolist(), "count": [s.count], "q01": s.q01.tolist(),
                     "q99": s.q99.tolist()}
    return out
