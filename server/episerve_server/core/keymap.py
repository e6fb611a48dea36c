"""The keymap: what one sample is (docs/KEYMAP.md), parsed and validated from plain dicts.

Parsing is strict (docs/KEYMAP.md): an unknown field, a field that does not apply to the
entry's rule, or a value of the wrong type is a ``KeymapError`` naming the entry and the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from episerve_proto.contract import (
    IS_PAD_SUFFIX,
    KEYMAP_FIELDS,
    MAX_NAME_CHARS,
    TOTAL_FRAMES,
    did_you_mean,
)
from episerve_proto.errors import KeymapError, LimitExceeded, shown

KEY_TYPES = ("camera_keys", "proprio_keys", "action_keys", "annotation_keys", "metadata_keys")
_FIELDS = frozenset(KEYMAP_FIELDS)
MAX_WINDOW = 4096
#: The largest offset (``offsets_s``), lag or stride, in seconds.
MAX_SECONDS = 3600.0
#: Entries of one keymap (the daemon's ``--max-keymap-entries`` default).
MAX_ENTRIES = 256
#: Names users from other loaders reach for, and the field that does the job here.
_ALIASES = {"delta_timestamps": "offsets_s", "offsets": "offsets_s", "chunk_size": "horizon",
            "n_obs_steps": "history", "key": "zarr_key", "type": "key_type"}


class Rule(Enum):
    """Which window rule (docs/KEYMAP.md) an entry lands in (the first matching rule wins; rule 6,
    ``offsets_s``, is checked right after rule 1)."""

    ANNOTATION = 1
    HORIZON = 2
    HISTORY = 3
    LAG = 4
    FRAME = 5
    OFFSETS = 6


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One keymap entry, validated."""

    name: str
    zarr_key: str
    key_type: str
    horizon: int | None = None
    history: int | None = None
    history_stride: int = 1
    history_stride_s: float | None = None
    lag_s: float | None = None
    offsets_s: tuple[float, ...] | None = None
    # Derived once, when the entry is made (the planner asks for them on every batch).
    rule: Rule = dataclasses.field(init=False, compare=False, repr=False)
    length: int = dataclasses.field(init=False, compare=False, repr=False)  # rows in the window
    # A windowed output: (W, *feature) per sample, with an ``_is_pad`` mask on request.
    time_axis: bool = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        rule = self._rule()
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "length", self._length(rule))
        object.__setattr__(self, "time_axis",
                           rule in (Rule.HORIZON, Rule.HISTORY, Rule.OFFSETS))

    def _rule(self) -> Rule:
        if self.key_type == "annotation_keys":
            return Rule.ANNOTATION
        if self.offsets_s is not None:
            return Rule.OFFSETS
        if self.horizon is not None:
            return Rule.HORIZON
        if self.history is not None and (self.history > 1 or self.key_type == "camera_keys"):
            return Rule.HISTORY
        if self.lag_s is not None:
            return Rule.LAG
        return Rule.FRAME

    def _length(self, rule: Rule) -> int:
        if rule is Rule.HORIZON:
            return self.horizon or 1
        if rule is Rule.HISTORY:
            return self.history or 1
        if rule is Rule.OFFSETS:
            return len(self.offsets_s or ())
        return 1

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"zarr_key": self.zarr_key, "key_type": self.key_type}
        for name in ("horizon", "history", "history_stride_s", "lag_s"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.history_stride != 1:
            out["history_stride"] = self.history_stride
        if self.offsets_s is not None:
            out["offsets_s"] = list(self.offsets_s)
        return out


@dataclass(frozen=True, slots=True)
class Keymap:
    """A validated keymap. Entry order is the user's order; it only decides which entry
    provides ``action_pad_mask`` and ``proprio_history_mask`` (the first one in keymap order)."""

    entries: tuple[KeySpec, ...]
    # derived when made: the keys of windowed (not annotation) reads, and so on
    zarr_keys: frozenset[str] = dataclasses.field(init=False, compare=False, repr=False)
    annotation_keys: frozenset[str] = dataclasses.field(init=False, compare=False, repr=False)
    action_mask_entry: KeySpec | None = dataclasses.field(init=False, compare=False, repr=False)
    proprio_mask_entry: KeySpec | None = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        entries = self.entries
        object.__setattr__(self, "zarr_keys", frozenset(
            e.zarr_key for e in entries if e.rule is not Rule.ANNOTATION))
        object.__setattr__(self, "annotation_keys", frozenset(
            e.zarr_key for e in entries if e.rule is Rule.ANNOTATION))
        object.__setattr__(self, "action_mask_entry", next(
            (e for e in entries if e.key_type == "action_keys" and e.rule is Rule.HORIZON),
            None))
        object.__setattr__(self, "proprio_mask_entry", next(
            (e for e in entries
             if e.key_type != "camera_keys" and e.rule is Rule.HISTORY and (e.history or 0) > 1),
            None))

    def __iter__(self) -> Iterator[KeySpec]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {e.name: e.as_dict() for e in self.entries}

    @classmethod
    def parse(cls, raw: Mapping[str, Any], *, max_entries: int = MAX_ENTRIES) -> Keymap:
        """Validate a keymap of at most ``max_entries`` entries; names are at most
        ``contract.MAX_NAME_CHARS`` characters."""
        if not isinstance(raw, Mapping) or not raw:
            raise KeymapError(f"a keymap is a non-empty mapping of output keys, got {shown(raw)}")
        if len(raw) > max_entries:
            raise LimitExceeded(
                f"keymap.entries: the keymap has {len(raw)} entries, over the limit of "
                f"{max_entries} (--max-keymap-entries)")
        entries = tuple(_parse_entry(name, spec) for name, spec in raw.items())
        reserved = _reserved_names(entries)
        for e in entries:
            if e.name in reserved:
                raise KeymapError(
                    f"output key {shown(e.name)} clashes with a reserved output name "
                    f"({reserved[e.name]}); rename the entry", key=e.zarr_key)
        return cls(entries)


def _reserved_names(entries: tuple[KeySpec, ...]) -> dict[str, str]:
    """Every name the daemon may add to a sample, and what adds it."""
    names = {n: "a sample field" for n in ("episode_hash", "embodiment", "fps", "frame_index")}
    names[TOTAL_FRAMES] = "a sample field with masks='all'"
    names["action_pad_mask"] = names["proprio_history_mask"] = "a shared mask"
    for e in entries:
        if e.key_type == "camera_keys":
            names[f"{e.name}_mask"] = f"the mask of camera output {e.name!r}"
        if e.time_axis:
            names[f"{e.name}{IS_PAD_SUFFIX}"] = f"the masks='all' mask of output {e.name!r}"
    return names


def _check_length(what: str, value: str, key: str = "") -> None:
    if len(value) > MAX_NAME_CHARS:
        raise KeymapError(
            f"{what} {shown(value)} is {len(value)} characters long, over the limit of "
            f"{MAX_NAME_CHARS}", key=key)


def _parse_entry(name: object, spec: object) -> KeySpec:
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
    out = KeySpec(
        name=name,
        zarr_key=zarr_key,
        key_type=key_type,
        horizon=_count(name, spec, "horizon", minimum=1),
        history=_count(name, spec, "history", minimum=1),
        history_stride=_count(name, spec, "history_stride", minimum=1) or 1,
        history_stride_s=_seconds(name, spec, "history_stride_s"),
        lag_s=_seconds(name, spec, "lag_s"),
        offsets_s=_offsets(name, spec),
    )
    _check_applies(out, {f for f in KEYMAP_FIELDS[2:] if spec.get(f) is not None}, spec)
    return out


def _hint(field: object) -> str:
    if not isinstance(field, str):
        return ""
    if field in _ALIASES:
        return f"; did you mean {_ALIASES[field]!r}?"
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


def _check_applies(e: KeySpec, given: set[str], spec: Mapping[str, Any]) -> None:
    """Every window field given must change the entry's window: anything else is refused."""
    def refuse(field: str, why: str) -> KeymapError:
        return KeymapError(
            f"output key {shown(e.name)}: field {field!r} (= {shown(spec[field])}) does not "
            f"apply {why}", key=e.zarr_key)

    if e.key_type == "annotation_keys":
        for field in sorted(given, key=KEYMAP_FIELDS.index):
            raise refuse(field, "to annotation_keys: an annotation entry is the texts of the "
                                "spans at the sample's frame, not a window (keymap rule 1); "
                                "give only zarr_key and key_type")
    for field, others, why in _EXCLUSIVE:
        if field in given:
            for other in others:
                if other in given:
                    raise refuse(other, f"together with {field!r}: {why}")
    if "horizon" in given and e.key_type == "camera_keys":
        raise refuse("horizon", "to camera_keys: a horizon is an action chunk; give a camera "
                                "window as history (past frames) or offsets_s (any frames)")
    for field in ("history_stride", "history_stride_s"):
        if field in given and "history" not in given:
            raise refuse(field, "without 'history': a stride spaces the frames of a history "
                                "window (keymap rule 3)")


def _count(name: str, spec: Mapping[str, Any], field: str, *, minimum: int) -> int | None:
    value = spec.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeymapError(
            f"output key {shown(name)}: {field} must be an integer, got {shown(value)}")
    if not minimum <= value <= MAX_WINDOW:
        raise KeymapError(
            f"output key {shown(name)}: {field} must be in [{minimum}, {MAX_WINDOW}], got {value!r}"
        )
    return value


def _seconds(name: str, spec: Mapping[str, Any], field: str) -> float | None:
    value = spec.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KeymapError(
            f"output key {shown(name)}: {field} must be a number of seconds, got {shown(value)}"
        )
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise KeymapError(
            f"output key {shown(name)}: {field} must be in (0, {MAX_SECONDS:g}] seconds "
            f"(omit it for none), got {value!r}"
        )
    return float(value)


def _offsets(name: str, spec: Mapping[str, Any]) -> tuple[float, ...] | None:
    """``offsets_s``: 1 to ``MAX_WINDOW`` finite offsets in seconds, each within
    ``MAX_SECONDS`` of the sample's frame, either sign, in the order given."""
    value = spec.get("offsets_s")
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise KeymapError(
            f"output key {shown(name)}: offsets_s must be a list of offsets in seconds, "
            f"got {shown(value)}")
    if not 1 <= len(value) <= MAX_WINDOW:
        raise KeymapError(
            f"output key {shown(name)}: offsets_s must hold 1 to {MAX_WINDOW} offsets, got "
            f"{len(value)}" + (" (omit it for a single frame)" if not value else ""))
    for k, o in enumerate(value):
        if isinstance(o, bool) or not isinstance(o, int | float) or not math.isfinite(o) \
                or abs(o) > MAX_SECONDS:
            raise KeymapError(
                f"output key {shown(name)}: offsets_s[{k}] must be a finite number of seconds "
                f"in [-{MAX_SECONDS:g}, {MAX_SECONDS:g}], got {shown(o)}")
    return tuple(float(o) for o in value)
