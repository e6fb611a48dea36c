"""The per-entry reference reader: the window rules of docs/KEYMAP.md written out literally.

Everything else in the test suite that checks a read (the batch planner, the daemon, the client
Dataset) is compared against :func:`oracle_sample`. It is deliberately naive:

- every frame index is computed in a plain Python loop, straight from the rule text;
- each keymap entry is one zarr call through zarr's plain sync API, on its own;
- it shares no code with ``episerve_server`` or ``episerve_client``.

It is slow on purpose. Do not make it clever: its only job is to be obviously right.

Values are returned undecoded and untensored: numeric windows as float32 ``np.ndarray``, JPEG (or
any variable-length-bytes) frames as raw ``bytes`` (a ``list[bytes]`` for a window), annotation
texts as ``list[str]``.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

KEY_TYPES = frozenset(
    {"camera_keys", "proprio_keys", "action_keys", "annotation_keys", "metadata_keys"}
)
ANNOTATIONS_ARRAY = "annotations"  # the array the annotation cutoff reads, whatever the keymap says

RULE_ANNOTATION = 1
RULE_HORIZON = 2
RULE_HISTORY = 3
RULE_LAG = 4
RULE_SINGLE = 5
RULE_OFFSETS = 6


class OracleReadError(Exception):
    """A store, array or attribute cannot serve the sample. The message names episode and key."""


@dataclass(frozen=True, slots=True)
class Span:
    """One valid annotation span [start_idx, end_idx), in the order listed in the array."""

    text: str
    start_idx: int
    end_idx: int

    def contains(self, i: int) -> bool:
        return self.start_idx <= i < self.end_idx


def frames(x: float, fps: float) -> int:
    """docs/KEYMAP.md: ``frames(x) = max(1, round(x * fps))`` with Python's built-in round."""
    return max(1, round(x * fps))


def entry_rule(spec: Mapping[str, Any]) -> int:
    """The number of the first window rule (docs/KEYMAP.md) that matches this keymap entry."""
    key_type = spec["key_type"]
    if key_type not in KEY_TYPES:
        raise ValueError(f"unknown key_type {key_type!r}; expected one of {sorted(KEY_TYPES)}")
    if key_type == "annotation_keys":
        return RULE_ANNOTATION
    if spec.get("offsets_s") is not None:  # rule 6 is checked before rules 2-5
        return RULE_OFFSETS
    if spec.get("horizon") is not None:
        return RULE_HORIZON
    history = spec.get("history")
    if history is not None and history > 1:
        return RULE_HISTORY
    if key_type == "camera_keys" and history is not None:
        return RULE_HISTORY
    if spec.get("lag_s") is not None:
        return RULE_LAG
    return RULE_SINGLE


def action_chunk_indices(
    i: int, horizon: int, total_frames: int, cutoff_end: int | None = None
) -> tuple[list[int], list[float]]:
    """Rule 2: rows [i, min(i+H, T, cutoff_end)), then the last of them repeated up to H rows.

    Returns the H row indices and the mask (1.0 real row, 0.0 padded row).
    """
    end = min(i + horizon, total_frames)
    if cutoff_end is not None:
        end = min(end, cutoff_end)
    indices: list[int] = []
    mask: list[float] = []
    for h in range(horizon):
        row = i + h
        if row < end:
            indices.append(row)
            mask.append(1.0)
        else:
            indices.append(end - 1)
            mask.append(0.0)
    return indices, mask


def history_indices(
    i: int, history: int, stride: int, lag: int | None
) -> tuple[list[int], list[float]]:
    """Rule 3: K indices oldest first, ending at ``i - lag`` (or i), spaced ``stride``.

    An index below 0 is replaced by the oldest index (in list order) that is >= 0, or by 0 if
    there is none; a replaced index is a padded row (mask 0.0).
    """
    newest = i - lag if lag is not None else i
    raw = [newest - stride * (history - 1 - k) for k in range(history)]
    replacement = 0
    for index in raw:
        if index >= 0:
            replacement = index
            break
    indices: list[int] = []
    mask: list[float] = []
    for index in raw:
        if index >= 0:
            indices.append(index)
            mask.append(1.0)
        else:
            indices.append(replacement)
            mask.append(0.0)
    return indices, mask


def offset_indices(
    i: int, offsets_s: Sequence[float], total_frames: int, fps: float
) -> tuple[list[int], list[float]]:
    """Rule 6: for each offset o in the order given, the frame ``i + round(o * fps)`` (Python's
    round: nearest, ties to even), clamped into [0, T-1]. A row is padding (mask 0.0) when its
    unclamped frame lies outside [0, T)."""
    indices: list[int] = []
    mask: list[float] = []
    for o in offsets_s:
        wanted = i + round(o * fps)
        if wanted < 0:
            indices.append(0)
            mask.append(0.0)
        elif wanted > total_frames - 1:
            indices.append(total_frames - 1)
            mask.append(0.0)
        else:
            indices.append(wanted)
            mask.append(1.0)
    return indices, mask


def lag_index(i: int, lag: int) -> int:
    """Rule 4: the single frame ``max(0, i - frames(lag_s))``."""
    return max(0, i - lag)


def read_spans(group: zarr.Group, episode_hash: str, key: str) -> list[Span]:
    """Every valid span of annotation array ``key``, in listed order.

    Spans with ``end_idx <= start_idx`` or a negative ``start_idx`` are dropped here, so they are
    ignored everywhere.
    """
    arr = _open_array(group, episode_hash, key)
    raw = arr[...]
    spans: list[Span] = []
    for n, element in enumerate(np.asarray(raw, dtype=object).reshape(-1)):
        try:
            record = json.loads(_as_bytes(element).decode("utf-8"))
            span = Span(str(record["text"]), int(record["start_idx"]), int(record["end_idx"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise OracleReadError(
                f"episode {episode_hash!r} key {key!r}: annotation {n} is not "
                f"JSON {{text, start_idx, end_idx}}: {element!r}"
            ) from exc
        if span.end_idx <= span.start_idx or span.start_idx < 0:
            continue
        spans.append(span)
    return spans


def cutoff_end(spans: list[Span], i: int) -> int | None:
    """The end of the span listed LAST among those containing i, or None if none contains i."""
    end: int | None = None
    for span in spans:
        if span.contains(i):
            end = span.end_idx
    return end


def oracle_sample(
    root: str | Path,
    episode_hash: str,
    frame: int,
    keymap: Mapping[str, Mapping[str, Any]],
    *,
    annotation_cutoff: bool = False,
    all_masks: bool = False,
) -> dict[str, Any]:
    """Read one sample of ``<root>/<episode_hash>.zarr`` at ``frame``, entry by entry.

    With ``all_masks`` (masks="all"), every windowed output (horizon, history,
    offsets_s) also gets ``<output_key>_is_pad``, a bool array that is True where the row is
    padding, and the sample carries ``total_frames``.
    """
    group = _open_episode(root, episode_hash)
    total_frames, fps, embodiment = _episode_attrs(group, episode_hash)
    i = operator.index(frame)
    if not 0 <= i < total_frames:
        raise IndexError(
            f"episode {episode_hash!r}: frame {i} is outside [0, {total_frames}) (total_frames)"
        )

    cutoff_spans: list[Span] | None = None
    out: dict[str, Any] = {}
    masks: dict[str, np.ndarray] = {}
    is_pad: dict[str, list[bool]] = {}
    for output_key, spec in keymap.items():
        key = spec["zarr_key"]
        key_type = spec["key_type"]
        rule = entry_rule(spec)

        if rule == RULE_ANNOTATION:
            spans = read_spans(group, episode_hash, key)
            out[output_key] = [span.text for span in spans if span.contains(i)]
            continue

        arr = _open_array(group, episode_hash, key)
        if rule == RULE_HORIZON:
            horizon = _positive_int(spec, "horizon", episode_hash, output_key)
            end: int | None = None
            if annotation_cutoff and key_type == "action_keys":
                if cutoff_spans is None:
                    cutoff_spans = read_spans(group, episode_hash, ANNOTATIONS_ARRAY)
                end = cutoff_end(cutoff_spans, i)
            indices, mask = action_chunk_indices(i, horizon, total_frames, end)
            out[output_key] = _read_window(arr, indices, episode_hash, key)
            is_pad[f"{output_key}_is_pad"] = [m == 0.0 for m in mask]
            if key_type == "action_keys" and "action_pad_mask" not in masks:
                masks["action_pad_mask"] = np.array(mask, dtype=np.float32)
        elif rule == RULE_HISTORY:
            history = _positive_int(spec, "history", episode_hash, output_key)
            if spec.get("history_stride_s") is not None:
                stride = frames(spec["history_stride_s"], fps)
            else:
                stride = operator.index(spec.get("history_stride", 1))
            lag = frames(spec["lag_s"], fps) if spec.get("lag_s") is not None else None
            indices, mask = history_indices(i, history, stride, lag)
            out[output_key] = _read_window(arr, indices, episode_hash, key)
            is_pad[f"{output_key}_is_pad"] = [m == 0.0 for m in mask]
            if key_type == "camera_keys":
                masks[f"{output_key}_mask"] = np.array(mask, dtype=np.float32)
            elif "proprio_history_mask" not in masks:
                masks["proprio_history_mask"] = np.array(mask, dtype=np.float32)
        elif rule == RULE_OFFSETS:
            indices, mask = offset_indices(i, spec["offsets_s"], total_frames, fps)
            out[output_key] = _read_window(arr, indices, episode_hash, key)
            is_pad[f"{output_key}_is_pad"] = [m == 0.0 for m in mask]
        elif rule == RULE_LAG:
            index = lag_index(i, frames(spec["lag_s"], fps))
            out[output_key] = _single(_read_window(arr, [index], episode_hash, key))
        else:
            out[output_key] = _single(_read_window(arr, [i], episode_hash, key))

    for mask_key, mask_value in masks.items():
        if mask_key in out:
            raise ValueError(f"keymap output key {mask_key!r} collides with a mask of that name")
        out[mask_key] = mask_value
    if all_masks:
        for pad_key, pads in is_pad.items():
            if pad_key in out:
                raise ValueError(f"keymap output key {pad_key!r} collides with a mask of that name")
            out[pad_key] = np.array(pads, dtype=bool)
        if "total_frames" in out:
            raise ValueError("keymap output key 'total_frames' collides with a metadata key")
        out["total_frames"] = total_frames
    for meta_key in ("episode_hash", "embodiment", "fps", "frame_index"):
        if meta_key in out:
            raise ValueError(f"keymap output key {meta_key!r} collides with a metadata key")
    out["episode_hash"] = episode_hash
    out["embodiment"] = embodiment
    out["fps"] = float(fps)
    out["frame_index"] = i
    return out


# --- plain zarr access -------------------------------------------------------------------------


def _open_episode(root: str | Path, episode_hash: str) -> zarr.Group:
    path = Path(root) / f"{episode_hash}.zarr"
    try:
        return zarr.open_group(path, mode="r")
    except Exception as exc:
        raise OracleReadError(f"episode {episode_hash!r}: cannot open group {str(path)!r}") from exc


def _episode_attrs(group: zarr.Group, episode_hash: str) -> tuple[int, float, str]:
    try:
        attrs: dict[str, Any] = dict(group.attrs)
        return int(attrs["total_frames"]), attrs["fps"], str(attrs["embodiment"])
    except Exception as exc:
        raise OracleReadError(
            f"episode {episode_hash!r}: unreadable attributes total_frames/fps/embodiment"
        ) from exc


def _open_array(group: zarr.Group, episode_hash: str, key: str) -> zarr.Array[Any]:
    try:
        arr = group[key]
    except Exception as exc:
        raise OracleReadError(f"episode {episode_hash!r} key {key!r}: missing array") from exc
    if not isinstance(arr, zarr.Array):
        raise OracleReadError(f"episode {episode_hash!r} key {key!r}: is a group, not an array")
    return arr


def _read_window(arr: zarr.Array[Any], indices: list[int], episode_hash: str, key: str) -> Any:
    """One zarr call for all rows of one entry: float32 ndarray or list[bytes], one per index."""
    rows = arr.shape[0]
    for index in indices:
        if index >= rows:
            raise OracleReadError(
                f"episode {episode_hash!r} key {key!r}: array has {rows} rows, "
                f"window needs row {index}"
            )
    try:
        data: Any = arr.get_orthogonal_selection((np.array(indices, dtype=np.int64),))
    except Exception as exc:
        raise OracleReadError(
            f"episode {episode_hash!r} key {key!r}: read of rows {indices} failed: {exc}"
        ) from exc
    if arr.dtype == np.dtype(object):
        return [_as_bytes(element) for element in data]
    return np.array(data, dtype=np.float32, copy=True)


def _single(window: Any) -> Any:
    """The one row of a one-index window, without the time axis (an ndarray even if 0-d)."""
    if isinstance(window, list):
        return window[0]
    return window[0, ...].copy()


def _as_bytes(element: Any) -> bytes:
    if isinstance(element, (bytes, bytearray, memoryview, np.bytes_)):
        return bytes(element)
    if isinstance(element, str):
        return element.encode("utf-8")
    raise TypeError(f"expected a bytes element, got {type(element).__name__}")


def _positive_int(spec: Mapping[str, Any], name: str, episode_hash: str, output_key: str) -> int:
    value = operator.index(spec[name])
    if value < 1:
        raise ValueError(
            f"episode {episode_hash!r} entry {output_key!r}: {name} must be >= 1, got {value!r}"
        )
    return value


def entry_indices(fields: dict[str, Any], i: int, total: int, fps: int,
                  cutoff: int | None) -> tuple[list[int], list[float] | None]:
    """Row indices (and mask, for windows) one keymap entry reads at frame i (rules 2-6)."""
    rule = entry_rule(fields)
    if rule == RULE_OFFSETS:
        return offset_indices(i, fields["offsets_s"], total, fps)
    if rule == RULE_HORIZON:
        return action_chunk_indices(i, fields["horizon"], total, cutoff)
    if rule == RULE_HISTORY:
        if fields.get("history_stride_s") is not None:
            stride = frames(fields["history_stride_s"], fps)
        else:
            stride = fields.get("history_stride", 1)
        lag = frames(fields["lag_s"], fps) if fields.get("lag_s") is not None else None
        return history_indices(i, fields["history"], stride, lag)
    if rule == RULE_LAG:
        return [lag_index(i, frames(fields["lag_s"], fps))], None
    return [i], None


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive distinct rows, as half-open intervals."""
    runs: list[list[int]] = []
    for r in sorted(set(rows)):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [(a, b) for a, b in runs]


def merge_intervals(intervals: Sequence[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """The merge rule, literally: sort the half-open intervals by (start, end)
    and fold one into the current group when ``start // chunk <= (group_end - 1) // chunk + 1``;
    the group's end becomes the larger end."""
    groups: list[list[int]] = []
    for start, end in sorted(intervals):
        if groups and start // chunk <= (groups[-1][1] - 1) // chunk + 1:
            groups[-1][1] = max(groups[-1][1], end)
        else:
            groups.append([start, end])
    return [(a, b) for a, b in groups]
