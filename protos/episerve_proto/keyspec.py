"""One keymap entry checked field by field: the same code, and so the same messages, on
both sides.

The client runs :func:`checked_entry` on every entry before it builds the request (the
message cannot carry an unknown field, so a misspelt one has to be answered there), and the
daemon runs it again on every entry it parses. A user therefore sees the same words from
either side, alias hints included (``chunk_size`` -> ``horizon``). What depends on the
daemon's configuration or on the whole keymap (the number of entries, reserved output
names, names given twice) is checked by the daemon only.

Pure Python: importing this module imports neither grpc nor protobuf.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from episerve_proto.contract import (
    ANNOTATION_KEYS,
    CAMERA_KEYS,
    FIELD_ALIASES,
    KEY_TYPES,
    KEYMAP_FIELDS,
    MAX_NAME_CHARS,
    MAX_SECONDS,
    MAX_WINDOW,
    did_you_mean,
)
from episerve_proto.errors import KeymapError, shown

_FIELDS = frozenset(KEYMAP_FIELDS)


@dataclass(frozen=True, slots=True)
class EntryFields:
    """The fields of one entry, each of its type and within its bounds; a window field the
    entry does not give is None."""

    name: str
    zarr_key: str
    key_type: str
    horizon: int | None = None
    history: int | None = None
    history_stride: int | None = None
    history_stride_s: float | None = None
    lag_s: float | None = None
    offsets_s: tuple[float, ...] | None = None


E = TypeVar("E", bound=EntryFields)


@overload
def checked_entry(name: object, spec: object) -> EntryFields: ...


@overload
def checked_entry(name: object, spec: object, make: type[E]) -> E: ...


def checked_entry(name: object, spec: object, make: type[EntryFields] = EntryFields) -> EntryFields:
    """Check one keymap entry (``name: spec``); a ``KeymapError`` names the entry, the field
    and the value received. ``make``: the class the checked fields are given to (the
    daemon's ``KeySpec``, a subclass), so each side holds one shape of an entry."""
    if not isinstance(name, str) or not name:
        raise KeymapError(f"output keys are non-empty strings, got {shown(name)}")
    _check_length("output key (entry name)", name)
    if not isinstance(spec, Mapping):
        raise KeymapError(
            f"output key {shown(name)}: the spec must be a mapping, got {shown(spec)}")
    for field in spec:
        if field not in _FIELDS:
            key = spec.get("zarr_key")
            raise KeymapError(
                f"output key {shown(name)}: unknown field {shown(field)}{_hint(field)} "
                f"(the fields are {', '.join(KEYMAP_FIELDS)})",
                key=key if isinstance(key, str) else "")
    zarr_key = spec.get("zarr_key")
    if isinstance(zarr_key, str):
        _check_length(f"output key {shown(name)}: zarr_key", zarr_key)
    if not isinstance(zarr_key, str) or not zarr_key or "/" in zarr_key or zarr_key in {".", ".."}:
        raise KeymapError(
            f"output key {shown(name)}: zarr_key must be an array name, got {shown(zarr_key)}")
    key_type = spec.get("key_type")
    if isinstance(key_type, str):
        _check_length(f"output key {shown(name)}: key_type", key_type, zarr_key)
    if key_type not in KEY_TYPES:
        hint = did_you_mean(key_type, KEY_TYPES) if isinstance(key_type, str) else ""
        raise KeymapError(
            f"output key {shown(name)}: key_type {shown(key_type)} is not one of "
            f"{KEY_TYPES!r}{hint}", key=zarr_key)
    out = make(
        name=name,
        zarr_key=zarr_key,
        key_type=key_type,
        horizon=_count(name, spec, "horizon", zarr_key),
        history=_count(name, spec, "history", zarr_key),
        history_stride=_count(name, spec, "history_stride", zarr_key),
        history_stride_s=_seconds(name, spec, "history_stride_s", zarr_key),
        lag_s=_seconds(name, spec, "lag_s", zarr_key),
        offsets_s=_offsets(name, spec, zarr_key),
    )
    _check_applies(out, {f for f in KEYMAP_FIELDS[2:] if spec.get(f) is not None}, spec)
    return out


def too_long(what: str, value: str) -> str | None:
    """Why ``value`` (a name: an output key, a zarr key, an episode id) is refused, when it
    is longer than ``MAX_NAME_CHARS``; None when it is not."""
    if len(value) <= MAX_NAME_CHARS:
        return None
    return (f"{what} {shown(value)} is {len(value)} characters long, over the limit of "
            f"{MAX_NAME_CHARS}")


def _check_length(what: str, value: str, key: str = "") -> None:
    why = too_long(what, value)
    if why is not None:
        raise KeymapError(why, key=key)


def _hint(field: object) -> str:
    if not isinstance(field, str):
        return ""
    if field in FIELD_ALIASES:
        return f"; did you mean {FIELD_ALIASES[field]!r}?"
    return did_you_mean(field, KEYMAP_FIELDS)


#: Window fields that make no sense together with another one, and why (docs/KEYMAP.md).
_EXCLUSIVE: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("offsets_s", ("horizon", "history", "history_stride", "history_stride_s", "lag_s"),
     "offsets_s lists every frame of the window itself (keymap rule 6); put any lag or "
     "stride into the offsets"),
    ("horizon", ("history", "history_stride", "history_stride_s", "lag_s"),
     "the entry is an action chunk (keymap rule 2), which has no history, stride or lag; "
     "make a second entry for them"),
    ("history_stride_s", ("history_stride",),
     "the stride in seconds would win and history_stride would be ignored; keep one"),
)


def _check_applies(e: EntryFields, given: set[str], spec: Mapping[str, Any]) -> None:
    """Every window field given must change the entry's window: anything else is refused."""
    def refuse(field: str, why: str) -> KeymapError:
        return KeymapError(
            f"output key {shown(e.name)}: field {field!r} (= {shown(spec[field])}) does not "
            f"apply {why}", key=e.zarr_key)

    if e.key_type == ANNOTATION_KEYS:
        for field in sorted(given, key=KEYMAP_FIELDS.index):
            raise refuse(field, "to annotation_keys: an annotation entry is the texts of the "
                                "spans at the sample's frame, not a window (keymap rule 1); "
                                "give only zarr_key and key_type")
    for field, others, why in _EXCLUSIVE:
        if field in given:
            for other in others:
                if other in given:
                    raise refuse(other, f"together with {field!r}: {why}")
    if "horizon" in given and e.key_type == CAMERA_KEYS:
        raise refuse("horizon", "to camera_keys: a horizon is an action chunk; give a camera "
                                "window as history (past frames) or offsets_s (any frames)")
    for field in ("history_stride", "history_stride_s"):
        if field in given and "history" not in given:
            raise refuse(field, "without 'history': a stride spaces the frames of a history "
                                "window (keymap rule 3)")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _count(name: str, spec: Mapping[str, Any], field: str, key: str) -> int | None:
    value = spec.get(field)
    if value is None:
        return None
    if not _is_int(value):
        raise KeymapError(
            f"output key {shown(name)}: {field} must be an integer, got {shown(value)}",
            key=key)
    if not 1 <= value <= MAX_WINDOW:
        raise KeymapError(
            f"output key {shown(name)}: {field} must be in [1, {MAX_WINDOW}], got {value!r}",
            key=key)
    return int(value)


def _seconds(name: str, spec: Mapping[str, Any], field: str, key: str) -> float | None:
    value = spec.get(field)
    if value is None:
        return None
    if not _is_number(value):
        raise KeymapError(
            f"output key {shown(name)}: {field} must be a number of seconds, got "
            f"{shown(value)}", key=key)
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise KeymapError(
            f"output key {shown(name)}: {field} must be in (0, {MAX_SECONDS:g}] seconds "
            f"(omit it for none), got {value!r}", key=key)
    return float(value)


def _offsets(name: str, spec: Mapping[str, Any], key: str) -> tuple[float, ...] | None:
    """``offsets_s``: 1 to ``MAX_WINDOW`` finite offsets in seconds, each within
    ``MAX_SECONDS`` of the sample's frame, either sign, in the order given."""
    value = spec.get("offsets_s")
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise KeymapError(
            f"output key {shown(name)}: offsets_s must be a list of offsets in seconds, "
            f"got {shown(value)}", key=key)
    if not 1 <= len(value) <= MAX_WINDOW:
        raise KeymapError(
            f"output key {shown(name)}: offsets_s must hold 1 to {MAX_WINDOW} offsets, got "
            f"{len(value)}" + (" (omit it for a single frame)" if not value else ""), key=key)
    for k, o in enumerate(value):
        if not _is_number(o) or not math.isfinite(o) or abs(o) > MAX_SECONDS:
            raise KeymapError(
                f"output key {shown(name)}: offsets_s[{k}] must be a finite number of seconds "
                f"in [-{MAX_SECONDS:g}, {MAX_SECONDS:g}], got {shown(o)}", key=key)
    return tuple(float(o) for o in value)
