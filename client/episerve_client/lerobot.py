"""LeRobot-style window descriptions as keymaps (keymap rule 6, ``offsets_s``).

LeRobot describes the frames of a sample with ``delta_timestamps``: per feature, a list of
offsets in seconds from the sample's frame. The same list is an ``offsets_s`` keymap entry;
with ``masks="all"`` each such output also gets ``<name>_is_pad``, LeRobot's name and polarity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from episerve_client.errors import KeymapError
from episerve_proto.contract import did_you_mean
from episerve_proto.errors import shown
from episerve_proto.keyspec import checked_entry

__all__ = ["keymap_from_delta_timestamps"]


def keymap_from_delta_timestamps(
    delta_timestamps: Mapping[str, Sequence[float]],
    keys: Mapping[str, tuple[str, str]],
) -> dict[str, dict[str, Any]]:
    """A keymap from a LeRobot ``delta_timestamps`` dict.

    ``keys`` maps every output name to its ``(zarr_key, key_type)``. A name with a list in
    ``delta_timestamps`` becomes an ``offsets_s`` window, shape (len(offsets), *feature); a
    name without one is the sample's own frame, as in LeRobot. Offsets are rounded to the
    nearest frame of each episode (``round(o * fps)``, ties to even) and clamped into the
    episode. Each entry is checked as the daemon checks it (finite offsets, at most 3600 s,
    at most 4096 per key), and an error names the output key.

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
